"""The step's agreement all-reduce under ZeRO, when the host cannot answer alone.

One MAX all-reduce of [found_inf, the launch signature and its negation, a has-gradient
flag per parameter], so that every rank skips an inf step together, steps a parameter
if any rank has a gradient for it, and finds out whether every rank launched the same
buckets during backward. max(s) == -max(-s) == min(s): every rank launched the same
buckets in the same order. Otherwise collectives of different buckets were paired and
the averages are wrong: the step is skipped (as for inf) and the optimizer raises, at
once on CPU, at the next step on a GPU (read back without a host sync).

Under ``capturable=True`` the step agrees on the device only (``exchange_on_device``):
a captured step is replayed without its Python, so the host agreement would run once, at
capture. Every step then all-reduces the same flags with each rank's step count, lrs and
has-gradient flags beside their negations; where any differs, every rank skips the step
(as for inf) and remembers it in a sticky device flag (``diverged``), which the host
reads at the next call that agrees on the host (``diverged_on_device``).

Most steps do without it: the step's entry agreement (``zero_triton.comm.agreement``,
host memory) carries the launch signature and a digest of the parameters each rank has
no gradient for, so the all-reduce runs only for GradScaler's found_inf (a device value)
or when the ranks lack different gradients (a parameter steps if any rank has one).
"""
from __future__ import annotations

import torch


class StepFlags:
    """The flags of one ZeroAdam's steps, made once (the step allocates nothing), and
    whether an earlier step found that the ranks launched different buckets."""

    def __init__(self, comm):
        self.comm = comm
        self.flags = None
        self.parts = None      # [found_inf], [s, -s], [bits...], the launch check's result
        self.readback = None   # GPU: (pinned host copy, event, skip flag)
        self.pending = None    # the launch check not yet read: a CPU tensor or (pinned, event)
        self.device_flags = None  # capturable: (flags, its parts, the step count, diverged)

    def exchange(self, shards, found_inf, signature: int):
        """The all-reduce of ``found_inf`` (or None), of which parameters of ``shards``
        have a gradient and of the launch ``signature``. Returns (found_inf, partial):
        on a GPU a skip flag stands in for a None found_inf; ``partial``: some
        parameter lacks a gradient here. ``launches_differed()`` then reads the launch
        check, ``finish`` the rest."""
        n = sum(len(f.params) for f in shards)
        device = shards[0].device
        flags = self.flags
        if flags is None or flags.numel() != n + 3 or flags.device != device:
            flags = self.flags = torch.zeros(n + 3, dtype=torch.float32, device=device)
            self.parts = (flags[0:1], flags[1:3], flags[3:], torch.zeros_like(flags[0:1]))
            if device.type == "cuda":
                self.readback = (torch.zeros(1, dtype=torch.float32, pin_memory=True),
                                 torch.cuda.Event(), torch.zeros_like(flags[0:1]))
        head, sig, tail, mismatch = self.parts
        if found_inf is not None:
            head.copy_(found_inf.reshape(1))
        else:
            head.zero_()
        signature = float(signature)
        sig[0:1].fill_(signature)  # fills, not a copy from the host: no sync on a GPU
        sig[1:2].fill_(-signature)
        partial = any(f.stepped is not None for f in shards)
        if partial:
            bits = [b for f in shards for b in (f.stepped if f.stepped is not None else [True] * len(f.params))]
            tail.copy_(torch.tensor(bits, dtype=torch.float32))
        else:
            tail.fill_(1.0)
        self.comm.all_reduce(flags, "max")
        torch.add(sig[0:1], sig[1:2], out=mismatch).ne_(0)  # 1.0 where they differ
        if device.type == "cpu":  # host memory: read at once
            self.pending = mismatch
        else:
            pinned, event, skip = self.readback
            torch.maximum(head, mismatch, out=head)
            if found_inf is None:
                found_inf = skip
            pinned.copy_(mismatch, non_blocking=True)
            event.record()
            self.pending = (pinned, event)
        return found_inf, partial

    def finish(self, shards, found_inf, partial: bool):
        """The agreed answers: ``stepped`` of each of ``shards`` (a parameter steps if any
        rank has its gradient) and ``found_inf`` (returned; None if it was None)."""
        head, _, tail, _ = self.parts
        if partial:  # only a rank that lacks some gradient needs the answer on the host
            agreed = (tail > 0).tolist()
            at = 0
            for f in shards:
                mine = agreed[at:at + len(f.params)]
                at += len(f.params)
                f.stepped = None if all(mine) else mine
        if found_inf is None:
            return None
        found_inf.copy_(head.reshape(found_inf.shape).to(found_inf.device))
        return found_inf

    def exchange_on_device(self, shards, found_inf, lrs: list):
        """capturable=True: the step's agreement, all on the device (nothing allocated,
        nothing read on the host). One MAX all-reduce of [found_inf, (this rank's step
        count, each group's lr, has-gradient flags per parameter), their negations];
        where max(x) != -max(-x) the ranks differ: ``diverged`` becomes 1 and stays so.
        Returns the flag the kernels skip by (GradScaler's ``found_inf``, written with
        the agreed inf, or the optimizer's own) and writes each of ``shards``' ``stepped``
        (its own: a rank lacking other gradients than the rest is a divergence)."""
        n = sum(len(f.params) for f in shards)
        k = 1 + len(lrs) + n  # the values compared over the ranks
        device = shards[0].device
        made = self.device_flags
        if made is None or made[0].numel() != 1 + 2 * k or made[0].device != device:
            flags = torch.zeros(1 + 2 * k, dtype=torch.float32, device=device)
            head, pos, neg = flags[0:1], flags[1:1 + k], flags[1 + k:]
            made = self.device_flags = (flags, head, pos, neg, torch.zeros_like(pos),
                                        torch.zeros(1, dtype=torch.float32, device=device),
                                        torch.zeros(1, dtype=torch.float32, device=device))
        flags, head, pos, neg, differ, count, diverged = made
        if found_inf is not None:
            head.copy_(found_inf.reshape(1))
        else:
            head.zero_()
        pos[0:1].copy_(count.add_(1))
        for i, lr in enumerate(lrs):
            if isinstance(lr, torch.Tensor):
                pos[1 + i:2 + i].copy_(lr.reshape(1))
            else:  # a float: the fill is recorded with its value, as the kernels' lr is
                pos[1 + i:2 + i].fill_(float(lr))
        bits = pos[1 + len(lrs):]
        bits.fill_(1.0)
        at = 0
        for f in shards:
            if f.stepped is not None:
                for i, stepped in enumerate(f.stepped):
                    if not stepped:
                        bits[at + i:at + i + 1].fill_(0.0)
            at += len(f.params)
        torch.neg(pos, out=neg)
        self.comm.all_reduce(flags, "max")
        torch.add(pos, neg, out=differ).ne_(0)  # 1.0 where the ranks' values differ
        torch.maximum(diverged, torch.amax(differ, dim=0, keepdim=True, out=pos[0:1]), out=diverged)
        torch.maximum(head, diverged, out=head)
        if found_inf is None:
            return head
        found_inf.copy_(head.reshape(found_inf.shape))
        return found_inf

    def diverged_on_device(self) -> bool:
        """Whether a step under capturable=True found the ranks apart (a host read: made
        only at calls that agree on the host)."""
        made = self.device_flags
        return made is not None and bool(made[6].item())

    def launches_differed(self) -> bool:
        """Whether the last agreement found different launches (on a GPU: once its
        read-back has landed, never waiting for it; False until then)."""
        pending = self.pending
        if pending is None:
            return False
        if isinstance(pending, tuple):
            pinned, event = pending
            if not event.query():
                return False
            differ = bool(pinned.item())
        else:
            differ = bool(pending.item())
        self.pending = None
        return differ
