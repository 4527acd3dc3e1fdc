"""DistributedDataParallel around a model that ZeroAdam trains: a communication hook that
communicates nothing."""
from __future__ import annotations

import torch


def ddp_local_grads_hook(state, bucket):
    """A DistributedDataParallel communication hook that communicates nothing: each
    rank keeps its local gradients, and ZeroAdam averages them in its reduce-scatter.
    For models that a library wraps in DDP anyway (accelerate, HF Trainer) and that
    ZeroAdam trains: ``ddp_model.register_comm_hook(None, ddp_local_grads_hook)``.
    Never use it with an optimizer that expects DDP to average the gradients."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
