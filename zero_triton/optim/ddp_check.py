"""The first step's check that nothing averaged the gradients before ZeroAdam: a
DistributedDataParallel wrapper (accelerate and HF Trainer add one: correct, but every
step then pays DDP's all-reduce on top of ZeroAdam's reduce-scatter), or every rank
drawing the same batches (the ranks repeat each other's work).

``AlreadyAveraged`` owns what it needs: whether the check is still to run, this rank's
fingerprint of its local gradients (taken before the reduce-scatter changes them,
compared with every rank's after it, so a failing reduce-scatter fails first), and
whether a DDP wrapper was found (Join refuses one that averages too).
"""
from __future__ import annotations

import warnings

import torch

from zero_triton.optim import join

_FINGERPRINT_CHUNK = 1 << 18  # elements: 2 MiB of float64 at a time


@torch.no_grad()
def fingerprint(shards):
    """(sum, sum of squares) of this rank's local gradients, before any reduction, in
    float64 a chunk at a time (a float64 copy of the whole buffer, and its square, were
    four times the gradients' size at the first step's peak); None without flat buffers."""
    if not shards:
        return None
    device = shards[0].device
    mine = torch.zeros(2, dtype=torch.float64, device=device)
    for f in shards:
        for chunk in f.flat_grad.split(_FINGERPRINT_CHUNK):
            g = chunk.double()  # the gradients themselves when they are float64: read only
            mine[0] += g.sum().to(device)
            mine[1] += torch.dot(g, g).to(device)
    return mine


class AlreadyAveraged:
    """``comm``: the optimizer's communicator; ``needed``: False where the question does
    not arise (one rank; stage 2, which refuses a DDP wrapper at the step)."""

    def __init__(self, comm, needed: bool):
        self.comm = comm
        self.pending = needed      # the fingerprint is still to be taken
        self.mine = None           # taken, not yet compared
        self.ddp_averaged = False  # the first step found a DDP that averages before us

    def before_reduce(self, shards) -> None:
        """The local gradients are all in the flat buffers (every .grad copied in: HF
        Trainer's model.zero_grad() makes DDP hand over tensors of their own), before the
        reduce-scatter changes them: take their fingerprint, once."""
        if self.pending:
            self.pending = False
            self.mine = fingerprint(shards)

    def after_reduce(self, params, join_enabled: bool) -> None:
        """Compare every rank's fingerprint (a collective, once); warn if they are the
        same and not all zero, saying which of the two causes it found."""
        mine, self.mine = self.mine, None
        if mine is None:
            return
        every = torch.empty(self.comm.world_size * 2, dtype=torch.float64, device=mine.device)
        self.comm.all_gather(every, mine)
        rows = every.view(-1, 2).tolist()
        if not (rows[0][1] > 0 and all(r == rows[0] for r in rows)):
            return
        self.ddp_averaged = join.averaging_ddp(params)
        self.refuse_under_join(join_enabled)
        if self.ddp_averaged:
            warnings.warn(
                "zero_triton: the gradients were identical on every rank before ZeroAdam "
                "reduced them: the model is wrapped in DistributedDataParallel, which "
                "already all-reduced them. Training is correct, but each step pays DDP's "
                "all-reduce on top of ZeroAdam's reduce-scatter. Do not wrap the model in "
                "DDP (ZeroAdam averages the gradients itself), or, where a library wraps it "
                "(accelerate, HF Trainer), turn DDP's all-reduce off with "
                "ddp_model.register_comm_hook(None, zero_triton.ddp_local_grads_hook).",
                stacklevel=4)
        else:
            warnings.warn(
                "zero_triton: the gradients were identical on every rank at the first "
                "step, and no DistributedDataParallel averages them: every rank probably "
                "drew the same batches (a DataLoader without a DistributedSampler, or one "
                "random seed for every rank's sampler), so the ranks repeat one rank's "
                "work. Give each rank its own part of the data (DistributedSampler, or "
                "split the dataset by rank); if another wrapper averaged the gradients "
                "before ZeroAdam, each step pays that all-reduce too.", stacklevel=4)

    def refuse_under_join(self, join_enabled: bool) -> None:
        """Under Join, a DDP wrapper that averages the gradients too (no
        ``ddp_local_grads_hook``) is refused: a joined rank has zeros where the others
        hold DDP's average, so ours would halve it (and a joined rank shadows DDP's
        all-reduces before ours, where backward interleaves them). Raised at the same call
        on every rank: Join's construction, or the first step, which finds DDP."""
        if self.ddp_averaged and join_enabled:
            raise RuntimeError(
                "ZeroAdam under Join with a DistributedDataParallel wrapper that averages the "
                "gradients too: a rank that ran out of inputs would count zeros where the "
                "others hold DDP's average. Turn DDP's all-reduce off, "
                "ddp_model.register_comm_hook(None, zero_triton.ddp_local_grads_hook) (ZeroAdam "
                "averages the gradients itself), or do not wrap the model in DDP and use "
                "Join([optimizer]). Nothing was stepped")
