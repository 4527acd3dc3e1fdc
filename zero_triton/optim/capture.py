"""torch's ``capturable`` keyword turned into parts, once, where the optimizer is built
(``Spec.build`` makes a spec's ``capture``): below that, nothing asks whether the step is
captured; each part that differs is handed its own (docs/capture.md).

A step a CUDA graph can capture (``CAPTURED``) reads and writes the same memory at every
replay and reads nothing on the host. What changes for it, and nothing else:

- the buffers the step's parts use (``buffers``): ``state.buffers.Kept``, made at the
  first step and handed out again, instead of fresh ones from torch's allocator;
- ZeRO-2's staging (``staging``): a buffer of its own per bucket
  (``comm.staging.OwnStaging``) instead of pooled, adopted ones;
- when the buckets are averaged (``early``): in ``step()`` only, a captured step being
  self-contained, not from backward's hooks;
- how the ranks agree (``ranks``): on the device for the calls a graph captures
  (``optim.ranks.CapturedRanks``);
- what the step can be launched with (``check_backend``): a kernel that reads lr, the
  step and GradScaler's flag on the device, never torch's ops;
- torch's Join, refused (``check_join``): a joined rank shadows the others from the host.

``EAGER`` is the default: every call agreed on the host, fresh buffers.
"""
from __future__ import annotations

import torch

from zero_triton.comm.staging import OwnStaging, Staging
from zero_triton.native import backends
from zero_triton.optim.ranks import AgreedRanks, CapturedRanks, OneRank
from zero_triton.state.buffers import PLAIN, Buffers, Kept


class Eager:
    """capturable=False: the step as torch's eager optimizers run it."""

    keywords = {"capturable": False}  # in torch's param groups, and a copy's options
    staging = Staging
    agreed = AgreedRanks  # the ranks part over a group of several

    def buffers(self) -> Buffers:
        """A new part's buffers."""
        return PLAIN

    @staticmethod
    def early(bucket_cap_mb) -> bool:
        """Whether backward's hooks launch the buckets' averages (``bucket_cap_mb`` None:
        in ``step()`` only, whatever backward reaches)."""
        return bucket_cap_mb is not None

    def ranks(self, seat, comm, spec):
        """The ``Ranks`` part of a ZeroAdam over ``comm`` (``optim.ranks``)."""
        return self.agreed(seat, comm, spec) if comm.everyone.world_size > 1 else OneRank()

    def check_backend(self, backend: str, dtype: torch.dtype, device) -> None:
        """Refuse, before anything is built, a shard of ``dtype`` on ``device`` that the
        step cannot launch as this mode needs."""

    def check_join(self) -> None:
        """Refuse torch's Join where this mode cannot shadow the others' steps."""


class Captured(Eager):
    """capturable=True: a step a CUDA graph can capture."""

    keywords = {"capturable": True}
    staging = OwnStaging
    agreed = CapturedRanks

    def buffers(self) -> Buffers:
        return Kept()

    @staticmethod
    def early(bucket_cap_mb) -> bool:
        return False

    def check_backend(self, backend: str, dtype: torch.dtype, device) -> None:
        """A kernel that reads lr, step and the flags on the device: torch's ops (float64
        parameters, or no kernel here) read them on the host."""
        if device.type == "meta":
            return
        backend = "torch" if dtype == torch.float64 else backends.resolve(backend, device)
        if backend == "torch":
            raise ValueError(
                f"capturable=True with {dtype} parameters on {device}: they would be stepped by "
                "torch's ops, which read lr, the step count and GradScaler's flag on the host "
                "(a sync a CUDA graph cannot capture). Step float32/bf16/fp16 parameters with a "
                "kernel (backend='auto' with Triton or the extension built), or leave "
                "capturable out")

    def check_join(self) -> None:
        raise ValueError(
            "ZeroAdam(capturable=True) under torch's Join: a rank that ran out of inputs "
            "shadows the others' steps from the host, which a captured step never "
            "consults (it agrees on the device); give every rank the same number of "
            "batches (DistributedSampler(drop_last=True)), or leave capturable out")


EAGER, CAPTURED = Eager(), Captured()
