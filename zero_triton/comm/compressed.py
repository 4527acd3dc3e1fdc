"""Compressed collectives: int8 blocks on the wire (ZeRO++'s qwZ and qgZ).

``Int8Comm`` wraps any ``comm.protocol.Comm`` (a group's, or each dimension's of a
hybrid mesh) through what the protocol declares (``exchange``, ``all_gather``, ``wire``,
``buffers``) and sends what it is told to
compress as int8 codes with one float32 scale per block of ``BLOCK`` elements (absmax /
127, rounded to nearest), the blocks starting at each rank's chunk, so a chunk of any
size is sent compressed (the last block is short): nothing falls back to the full-width
collective.

- **Parameters** (``gather="int8"``, ``gather_params``): each rank quantizes its shard,
  the int8 payloads are all-gathered, and every rank, the owner included, writes the
  dequantized values: every rank's parameters stay bit for bit the same. The fp32
  master is not touched (the step reads it, not the parameter), so it stays exact;
  ``gathered`` tells the optimizer what its own gather made of a shard, so that a
  parameter equal to that is not taken for one the user wrote (which would seed the
  master from dequantized values: DeepSpeed's hpZ-after-load class of bug).
- **Gradients** (``reduce="int8"``, ``reduce_scatter_avg``): each rank quantizes the
  chunks it sends (its own chunk stays exact: it does not travel), sends them pairwise
  (gloo) or as one all-to-all, and each rank dequantizes what it received and sums it
  with its own chunk in float32 in rank order, then divides by the world size. With
  error feedback (``feedback``: the dtype of the error buffers, or None) what
  quantization dropped from a chunk is kept per rank and bucket and added to that
  chunk before it is quantized the next time (1-bit Adam's and LoCo's worker-side
  compensation), so the error does not accumulate over the steps.

Everything else (objects, flags, norms, the state dicts' gathers) passes through exact.
Bytes per element on the wire: 1 + 4 / BLOCK (1.016) where the parameters' dtype takes
2 and float32 4.
"""
from __future__ import annotations

import torch

from zero_triton.state.buffers import PLAIN

from .group import settled

BLOCK = 256
CODECS = ("int8",)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def payload_bytes(n: int) -> int:
    """Bytes of ``n`` elements compressed: the scales, then the codes."""
    return 4 * blocks(n) + n


def _rows(t: torch.Tensor, n: int):
    """The first ``n`` elements of ``t`` as whole blocks (a [k, BLOCK] view) and the short
    last block (a [1, n % BLOCK] view, or None)."""
    k = n // BLOCK
    tail = t[k * BLOCK:n].view(1, -1) if n % BLOCK else None
    return t[:k * BLOCK].view(k, BLOCK), tail


def quantize(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None,
             work: "Scratch | None" = None) -> torch.Tensor:
    """``out`` (uint8, ``payload_bytes(x.numel())``) takes ``x`` (float) as float32 scales
    (absmax / 127 per block) then int8 codes (round to nearest, ties to even). Returns
    the values the codes stand for (what ``dequantize`` gives, in float32), in
    ``scratch`` (float32, at least ``x.numel()``; made when None): no tensor of ``x``'s
    size is allocated per call, whose first touch costs more than the arithmetic.
    ``work`` (a ``Scratch``): where the per-block values go, so that nothing at all is
    allocated (None: made per call)."""
    n = x.numel()
    nb = blocks(n)
    scales = out[:4 * nb].view(torch.float32)
    codes = out[4 * nb:4 * nb + n].view(torch.int8)
    if x.dtype != torch.float32:  # read as float32 (not in ``scratch``: it is overwritten)
        x = x.float()
    s = (torch.empty(n, dtype=torch.float32, device=x.device) if scratch is None
         else scratch[:n])
    at = 0
    for rows, vals in zip(_rows(x, n), _rows(s, n)):
        if rows is None or rows.numel() == 0:
            continue
        k = rows.shape[0]
        torch.abs(rows, out=vals)
        scale = scales[at:at + k]
        absmax, inv = _inverse_scales(vals, k, work)
        torch.div(absmax, 127.0, out=scale)
        torch.mul(rows, inv[:, None], out=vals)
        vals.round_().clamp_(-127, 127)
        codes[at * BLOCK:at * BLOCK + vals.numel()].copy_(vals.view(-1))
        vals.mul_(scale[:, None])
        at += k
    return s


def _inverse_scales(absvals: torch.Tensor, k: int, work) -> tuple:
    """(the largest |x| of each of ``k`` blocks, 127 / it where it is > 0 and 0 elsewhere),
    from the blocks' |x| (``absvals``, [k, BLOCK]); in ``work``'s buffers when given."""
    if work is None:
        absmax = absvals.amax(dim=1)
        return absmax, torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    device = absvals.device
    absmax = torch.amax(absvals, dim=1, out=work.get("absmax", k, device))
    inv, positive = work.get("inverse", k, device), work.get("positive", k, device, torch.bool)
    torch.gt(absmax, 0, out=positive)
    torch.reciprocal(absmax, out=inv).mul_(127.0)  # the ops 127.0 / absmax dispatches
    return absmax, inv.masked_fill_(positive.logical_not_(), 0.0)


def dequantize(payload: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``n`` elements, any float dtype) takes the values ``payload`` holds: each
    code times its block's scale, computed in float32 and rounded once to ``out``'s dtype."""
    nb = blocks(n)
    scales = payload[:4 * nb].view(torch.float32)
    codes = payload[4 * nb:4 * nb + n].view(torch.int8)
    out.copy_(codes)  # small integers: exact in any float dtype
    at = 0
    for rows in _rows(out, n):
        if rows is None or rows.numel() == 0:
            continue
        k = rows.shape[0]
        rows.mul_(scales[at:at + k, None])
        at += k
    return out


def roundtrip(x: torch.Tensor, buffers=PLAIN) -> torch.Tensor:
    """What ``x`` becomes through ``quantize`` and ``dequantize``, in its dtype."""
    buf = buffers.empty(payload_bytes(x.numel()), torch.uint8, x.device)
    quantize(x, buf)
    return dequantize(buf, x.numel(), buffers.empty(x.shape, x.dtype, x.device))


class Scratch:
    """Float32 buffers reused call after call, one per role, grown to the largest
    asked: a fresh tensor of a bucket's size costs its first touch (page faults), more
    than the quantization's arithmetic on CPUs. A role is used within one call (the
    launch's, or the wait's, which run one at a time on the host, or in one stream's
    order on a GPU), never across a collective in flight."""

    def __init__(self, buffers=PLAIN):
        self.source = buffers
        self.buffers: dict = {}

    def get(self, role: str, n: int, device, dtype=torch.float32) -> torch.Tensor:
        buf = self.buffers.get((role, device))
        if buf is None or buf.numel() < n:
            buf = self.buffers[(role, device)] = self.source.empty(n, dtype, device)
        return buf[:n]


class _Gathered:
    """An int8 all-gather in flight (``handle``); ``wait`` dequantizes every rank's
    payload into ``flat`` (this rank's too)."""

    __slots__ = ("handle", "comm", "buf", "flat", "n")

    def __init__(self, handle, comm, buf, flat, n):
        self.handle, self.comm, self.buf, self.flat, self.n = handle, comm, buf, flat, n

    def landed(self) -> bool:
        return self.flat is None or self.handle.landed()

    def wait(self) -> None:
        if self.flat is None:
            return
        self.handle.wait()
        w = self.comm.world_size
        rows = self.buf.view(w, -1)
        chunks = self.flat.view(w, -1)
        for r in range(w):
            dequantize(rows[r], self.n, chunks[r])
        self.buf = self.flat = None


class _Summed:
    """An int8 reduce-scatter in flight (``handle``: the exchange of payloads); ``wait``
    sums the dequantized chunks and this rank's own (exact) in float32 in rank order into
    ``out``, divided by the world size."""

    __slots__ = ("handle", "comm", "payloads", "own", "out", "accumulate", "n")

    def __init__(self, handle, comm, payloads, own, out, accumulate, n):
        self.handle, self.comm = handle, comm
        self.payloads, self.own, self.out, self.accumulate, self.n = payloads, own, out, accumulate, n

    def landed(self) -> bool:
        return self.out is None or self.handle.landed()

    def wait(self) -> None:
        if self.out is None:
            return
        self.handle.wait()
        out, n, device = self.out, self.n, self.out.device
        scratch = self.comm.scratch
        direct = not self.accumulate and out.dtype == torch.float32
        total = out if direct else scratch.get("total", n, device)
        for r, payload in enumerate(self.payloads):
            if r == 0:
                total.copy_(self.own) if payload is None else dequantize(payload, n, total)
            else:
                total.add_(self.own if payload is None
                           else dequantize(payload, n, scratch.get("received", n, device)))
        total.div_(self.comm.world_size)
        if self.accumulate:
            out.add_(total)
        elif not direct:
            out.copy_(total)
        self.payloads = self.own = self.out = None


class Int8Comm:
    """``inner`` (any ``Comm``) with the parameters' all-gather (``gather``) and the
    gradients' average (``reduce``) sent as int8 blocks; ``feedback``: the dtype of the
    gradients' error buffers (None: no error feedback)."""

    def __init__(self, inner, gather: str | None = None, reduce: str | None = None,
                 feedback: torch.dtype | None = torch.bfloat16, buffers=None):
        self.inner = inner
        self.gather_codec, self.reduce_codec, self.feedback = gather, reduce, feedback
        # Where this rank is: the inner communicator's (the Comm protocol's fields).
        self.rank, self.world_size, self.group = inner.rank, inner.world_size, inner.group
        self.process_group, self.members = inner.process_group, inner.members
        self.replica, self.replicas = inner.replica, inner.replicas
        # ``buffers``: where each launch's payloads come from, by its name (a bucket's):
        # ``Kept`` (capturable=True, chosen by the optimizer) keeps them for the next, so
        # that a captured step sends from and receives into the same memory at every
        # replay; by default the inner communicator's, made per launch and let go at its wait.
        self.buffers = inner.buffers if buffers is None else buffers
        self.errors: dict = {}  # (name, numel) -> this rank's error buffer of that input
        self.scratch = Scratch(self.buffers)

    @property
    def wire_prefix(self) -> str:
        return self.inner.wire_prefix

    @wire_prefix.setter
    def wire_prefix(self, prefix: str) -> None:
        self.inner.wire_prefix = prefix

    @property
    def everyone(self):
        return self.inner.everyone

    @property
    def wire(self) -> dict:
        return self.inner.wire

    def reset_wire(self) -> None:
        self.inner.reset_wire()

    def held_bytes(self) -> int:
        """The error buffers' bytes (the price of error feedback) and the payloads kept."""
        return self.buffers.nbytes() + sum(e.numel() * e.element_size() for e in self.errors.values())

    # -- the gradients ---------------------------------------------------------------
    def recv_numel(self, numel: int, into_out: bool = True) -> int:
        return self.inner.recv_numel(numel, into_out) if self.reduce_codec is None else 0

    def needs_recv(self, out, inp, accumulate: bool = False) -> bool:
        return self.inner.needs_recv(out, inp, accumulate) if self.reduce_codec is None else False

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, recv=None,
                           async_op: bool = False, name: str = "reduce_scatter",
                           accumulate: bool = False):
        if self.reduce_codec is None or self.world_size == 1:
            return self.inner.reduce_scatter_avg(out, inp, recv, async_op, name, accumulate)
        w, r = self.world_size, self.rank
        n = inp.numel() // w
        device = inp.device
        chunks = inp.view(w, n)
        error = self._error(name, inp.numel(), device)
        if error is not None:
            error = error.view(w, n)
        p = payload_bytes(n)
        send = self.buffers.kept((name, "send"), w * p, torch.uint8, device).view(w, p)
        x = self.scratch.get("sent", n, device)
        for k in range(w):
            if k == r:
                continue
            x.copy_(chunks[k])
            if error is not None:
                x.add_(error[k])
            sent = quantize(x, send[k], self.scratch.get("codes", n, device), self.scratch)
            if error is not None:  # what quantization dropped, sent again next time
                error[k].copy_(x.sub_(sent))
        # This rank's own chunk does not travel: read exact, from ``inp`` (busy until the
        # wait), at the wait; nothing of it is dropped, so its error stays zero.
        own = chunks[r]
        recv = self.buffers.kept((name, "recv"), w * p, torch.uint8, device).view(w, p)
        handle = self.inner.exchange(recv, send, async_op=True, name=name, kind="reduce_scatter")
        payloads = [None if k == r else recv[k] for k in range(w)]
        return settled(_Summed(handle, self, payloads, own, out, accumulate, n), async_op)

    def all_gather_average(self, flat: torch.Tensor, part: torch.Tensor, async_op: bool = False,
                           name: str = "all_gather"):
        """Hybrid sharding's second half of an average across the replicas: every rank's
        averaged ``part`` into ``flat``, as int8 blocks that every rank (this one too)
        dequantizes, so the replicas hold the same bits; with error feedback, what this
        rank's quantization dropped from its part is added to it next time (the
        owner's compensation, as 1-bit Adam's server side)."""
        if self.reduce_codec is None or self.world_size == 1:
            return self.inner.all_gather(flat, part, async_op, name)
        error = self._error(name + " (gathered)", part.numel(), part.device)
        return self._gather_quantized(flat, part, async_op, name, error)

    def _error(self, name: str, n: int, device):
        """This rank's error buffer of the input ``name`` of ``n`` elements (None without
        error feedback)."""
        if self.feedback is None:
            return None
        key = (name, n)
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = self.buffers.zeros(n, self.feedback, device)
        return error

    def _gather_quantized(self, flat, values, async_op, name, error=None):
        """Every rank's ``values`` into ``flat`` as int8 blocks, every rank (this one too)
        writing the dequantized values; ``error``: what this rank's quantization drops,
        kept and added to its values the next time."""
        n = values.numel()
        p = payload_bytes(n)
        buf = self.buffers.kept((name, "gather"), self.world_size * p, torch.uint8, values.device)
        mine = buf.view(self.world_size, p)[self.rank]
        x = values
        if error is not None:
            x = self.scratch.get("sent", n, values.device)
            x.copy_(values)
            x.add_(error)
        sent = quantize(x, mine, self.scratch.get("codes", n, values.device), self.scratch)
        if error is not None:
            error.copy_(x.sub_(sent))
        return settled(_Gathered(self.inner.all_gather(buf, mine, async_op=True, name=name), self,
                                 buf, flat, n), async_op)

    # -- the parameters --------------------------------------------------------------
    def gather_params(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                      name: str = "all_gather"):
        if self.gather_codec is None or self.world_size == 1:
            return self.inner.gather_params(flat, shard, async_op, name)
        x = self.scratch.get("sent", shard.numel(), shard.device)
        x.copy_(shard)  # float32, read by the quantizer
        return self._gather_quantized(flat, x, async_op, name)

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """What ``gather_params`` writes for ``shard``."""
        if self.gather_codec is None or self.world_size == 1:
            return shard
        return roundtrip(shard, self.buffers)

    # -- exact ------------------------------------------------------------------------
    def all_gather(self, flat, shard, async_op: bool = False, name: str = "all_gather"):
        return self.inner.all_gather(flat, shard, async_op, name)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        self.inner.all_reduce(t, op)

    def all_gather_object(self, obj, what: str = "all_gather_object"):
        return self.inner.all_gather_object(obj, what)

    def gather(self, tensor, gather_list, dst: int, what: str = "gather") -> None:
        self.inner.gather(tensor, gather_list, dst, what)

    def exchange(self, recv, send, async_op: bool = False, name: str = "all_to_all",
                 kind: str = "all_to_all"):
        return self.inner.exchange(recv, send, async_op, name, kind)

