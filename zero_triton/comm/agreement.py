"""Every rank at the same call before any collective: ZeroAdam's entry-point agreement.

Collectives pair up by their order on each rank. When one rank does what the others do
not — ``if rank == 0: torch.save(opt.state_dict())``, a skipped ``step()``, a
``.grad`` edited after backward averaged it, an error caught on one rank — its next
collective pairs with a different one elsewhere, and every rank waits for the
process-group timeout (30 minutes), or worse, adds up unrelated buffers.

So each entry point of ZeroAdam that starts collectives (backward's first bucket of a
round, ``step``, ``clip_grad_norm_``, GradScaler's inf agreement, the state dicts, the
checkpoints) first exchanges one row of fourteen integers with every rank over the group's
side channel (``zero_triton.comm.side``: a gloo group of its own; host memory only: no
device work, no sync on a GPU, and never paired with a data collective): which optimizer, which call, how many steps it has taken, what
it found locally (gradients edited after their bucket was averaged, parameters written,
``opt.state`` reset), whether it refuses the call and, for ``step``, the signature of
the buckets backward launched, a digest of the parameters it has no gradient for and one
of its hyperparameters (and for ``clip_grad_norm_`` its max_norm and norm_type, which a
rank that ran out of inputs under torch's Join reads to make the same call).
The side group waits as long as the process group's own collectives (``side.group_timeout``).
Every rank then reads the same rows and takes the same decision: go on, do an agreed
extra (average again, re-seed, reset), or raise — on every rank, naming the ranks, the
calls and the fix. A rank that exits instead of joining closes its side connections,
which fails the others at once; a rank whose script ended normally sends a row that says
it has left (``zero_triton.comm.side``), which fails them at once too. The step needs a data all-reduce
(``zero_triton.comm.step_flags``) only for GradScaler's found_inf or when the ranks lack
gradients for different parameters.
"""
from __future__ import annotations

import atexit
import hashlib
import struct
import weakref
from dataclasses import dataclass

import torch

from zero_triton.comm import side
from zero_triton.comm.group import without_python_tls

ENTRIES = ("backward", "step", "clip_grad_norm_", "GradScaler", "state_dict",
           "load_state_dict", "consolidated_state_dict", "checkpoint.save", "checkpoint.load",
           "sharded_state_dict")
_CODE = {name: i + 1 for i, name in enumerate(ENTRIES)}

# Row layout (int64).
(_MAGIC, _ORDINAL, _ENTRY, _STEPS, _BACKWARDS, _FLAGS, _COUNT, _HASH, _ERROR, _SIGNATURE,
 _MISSING, _ARG0, _ARG1, _HYPER) = range(14)
WORDS = side.WORDS
_NO_ARG = struct.unpack("<q", struct.pack("<d", float("nan")))[0]
MAGIC = side.MAGIC

# Flags: what a rank found locally, OR-ed over the ranks by the caller.
STALE = 1     # gradients changed after their bucket was averaged (or were never averaged)
RESET = 2     # opt.state was replaced or cleared: start the state over
JOINED = 16   # this rank ran out of inputs under torch's Join and shadows the others
# Not sent: set in what ``check`` returns when the ranks' launch signatures differ, and
# when they lack gradients for different parameters.
DIFFER = 4
GRADS_DIFFER = 8
HYPER_DIFFER = 32  # at step: ranks with inputs hold different hyperparameters (``hyper``)

# What a rank that shadows under Join (``JOINED``, at its ``step``) can catch up with when
# the others are at another call first: it makes that call (``CatchUp``) and enters its
# step again. A ``clip_grad_norm_`` row carries max_norm and norm_type (``args``).
CATCH_UP = ("backward", "clip_grad_norm_")

# Refusals a rank can send (with its own message raised locally).
REFUSALS = {1: "its param_groups were edited by hand", 3: "its opt.state was edited",
            4: "a DistributedDataParallel wraps its model"}

_FIXES = {
    "state_dict": "ZeroAdam.state_dict() right after opt.state was edited by hand is "
                  "collective (every rank agrees on the edit first): call it on every rank, "
                  "or after the next step(), when it works on one rank alone",
    "consolidated_state_dict": "consolidated_state_dict(to_rank=0) is collective: call it on "
                               "every rank; only to_rank receives the state",
    "load_state_dict": "load_state_dict is collective: call it on every rank with the same "
                       "state dict",
    "checkpoint.save": "zero_triton.checkpoint.save is collective: call it on every rank",
    "sharded_state_dict": "get_optimizer_state_dict (ZeroAdam.sharded_state_dict) is "
                          "collective, as DCP's save and load are: call it on every rank",
    "checkpoint.load": "zero_triton.checkpoint.load is collective: call it on every rank",
    "clip_grad_norm_": "clipping under ZeroAdam all-reduces the norm: clip on every rank or on "
                       "none",
    "GradScaler": "GradScaler.unscale_/step agree on inf over the ranks: call them on every "
                  "rank",
    "step": "every rank must call step() once per iteration (a rank that skips a step, e.g. "
            "on a NaN loss, must skip it everywhere: decide with an all-reduce, or let "
            "GradScaler skip it)",
    "backward": "every rank must run the same backward passes between steps, reaching the "
                "same parameters (a parameter that some ranks' backward never reaches: pass "
                "bucket_cap_mb=None)",
}

_ordinals: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# At exit, while Python still runs: the side channels' groups shut down, instead of being
# left to static destructors, which abort the process when they run in the wrong order.
atexit.register(side.close_all)


def next_ordinal(pg) -> int:
    """How many agreements this process made on ``pg`` before (ranks build their
    optimizers in the same order, so the same number on every rank)."""
    n = _ordinals.get(pg, 0)
    _ordinals[pg] = n + 1
    return n


class CatchUp(Exception):
    """Raised on a rank that shadows under Join (and only there) when the ranks with
    inputs are at ``entry`` where it is at ``step``: it makes that call (``args``: the
    ones they made it with), whose agreement is this one (``Agreement.pending``), and
    then enters ``step`` again. The others go on with their call."""

    def __init__(self, entry: str, args: tuple, rows: list):
        super().__init__(f"catch up with {entry}")
        self.entry, self.args, self.rows = entry, args, rows


def _as_bits(value) -> int:
    return _NO_ARG if value is None else struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _as_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Row:
    """What this rank tells the others at an entry (``Agreement.check``): backward passes
    since the last step (``backwards``), its ``flags`` (STALE, RESET, JOINED), the
    parameters it saw written (``written``: ints), a refusal code of ``REFUSALS``
    (``refuse``), what it was about to start (``detail``, for errors), the checksum of the
    buckets it launched (``signature``; None: not compared), ``missing_digest`` of the
    parameters without a gradient (``missing``), a call's two float arguments (``args``)
    and a digest of its hyperparameters (``hyper``, compared at ``step``)."""

    backwards: int = 0
    flags: int = 0
    written: tuple = ()
    refuse: int = 0
    detail: str = ""
    signature: int | None = None
    missing: int = 0
    args: tuple = (None, None)
    hyper: int = 0


class Agreement:
    """The agreement of one optimizer (``ordinal``: its place among the optimizers built
    on this process group, the same on every rank) over ``comm``'s ranks."""

    def __init__(self, comm, ordinal: int, channel):
        self.comm = comm
        self.ordinal = ordinal
        self.channel = channel  # zero_triton.comm.side: its gloo group carries the rows
        self.mine = torch.zeros(WORDS, dtype=torch.int64)
        self.rows = torch.zeros(comm.world_size * WORDS, dtype=torch.int64)
        self.steps = 0  # step() calls completed, counted alike on every rank
        self.pending = None  # (call, rows) of a CatchUp: the next check, of that call, uses them

    @property
    def group(self):
        """The side channel's gloo group; None once the channel closed."""
        return self.channel.group

    def check(self, entry: str, ask: Row = Row()) -> int:
        """Exchange this rank's row ``ask`` for ``entry`` and return the flags OR-ed over
        the ranks, with ``HYPER_DIFFER`` added when the hyperparameters' digests differ
        (at ``step``), ``DIFFER`` when the launched buckets' ``signature`` is not the same
        on every rank and ``GRADS_DIFFER`` when ``missing`` is not; raise on every rank if
        they are at different calls, have taken different numbers of steps, wrote
        different parameters, reset the state on some ranks only, or one refuses (that
        rank raises its own error afterwards)."""
        backwards, flags, written, refuse = ask.backwards, ask.flags, ask.written, ask.refuse
        detail, signature, missing, args, hyper = ask.detail, ask.signature, ask.missing, ask.args, ask.hyper
        row = self.mine
        row[_MAGIC], row[_ORDINAL], row[_ENTRY], row[_STEPS] = MAGIC, self.ordinal, _CODE[entry], self.steps
        row[_BACKWARDS] = backwards
        row[_FLAGS], row[_COUNT], row[_HASH], row[_ERROR] = flags, len(written), _digest(written), refuse
        row[_SIGNATURE] = signature if signature is not None else -1
        row[_MISSING] = missing
        row[_ARG0], row[_ARG1] = _as_bits(args[0]), _as_bits(args[1])
        row[_HYPER] = hyper
        if self.group is None:
            raise RuntimeError(f"ZeroAdam: {entry} was called after the process group's side "
                               "channel closed (destroy_process_group() was called, or the "
                               "process is exiting); nothing was changed")
        pending, self.pending = self.pending, None
        if pending is not None:  # exchanged already: the call a joined rank catches up with
            caught, rows = pending
            if caught != entry:
                raise RuntimeError(f"zero_triton: a rank shadowing under Join caught up with "
                                   f"{caught} and then made {entry}")
            return self._decide(entry, rows, signature, refuse, written)
        try:
            self._allgather(self.rows, row)
        except RuntimeError as exc:
            what = f"{entry} ({detail})" if detail else entry
            if "timed out" in str(exc).lower():
                seconds = self.channel.timeout.total_seconds()
                why = (f"a peer rank did not join it within the process group's timeout "
                       f"({seconds:g} s) ({exc}); it is stuck, far slower, at another call, "
                       "or out of inputs")
            else:
                why = (f"a peer rank did not join it ({exc}); it probably died or exited, or "
                       "ran out of inputs")
            why += (" (ranks with different numbers of batches: wrap the training loop in "
                    "torch.distributed.algorithms.join.Join([optimizer]); under accelerate, "
                    "Join([model, optimizer.optimizer]), which accelerator.join_uneven_inputs"
                    "([model, optimizer.optimizer], even_batches=False) builds on GPUs)")
            raise RuntimeError(f"zero_triton: {what} failed on rank {self.comm.rank}: {why}. "
                               f"If it is alive: {_FIXES[entry]}") from exc
        rows = self.rows.view(self.comm.world_size, WORDS).tolist()
        if not _same_call(rows):
            caught = self._catch_up(rows)
            if caught is None:
                raise RuntimeError(self._describe_mismatch(rows))
            if rows[self.comm.rank][_FLAGS] & JOINED:
                raise CatchUp(caught, tuple(_as_float(rows[self._leader(rows)][w])
                                            for w in (_ARG0, _ARG1)), rows)
        return self._decide(entry, rows, signature, refuse, written)

    def _allgather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        # A profiler range: the side group's all-gather is no training collective.
        with torch.profiler.record_function("zero_triton.agreement"), without_python_tls():
            self.group._allgather_base(out, mine).wait()

    @staticmethod
    def _leader(rows) -> int:
        """The first rank that has inputs (is not shadowing under Join)."""
        return next(i for i, r in enumerate(rows) if not r[_FLAGS] & JOINED)

    def _catch_up(self, rows):
        """The call the ranks with inputs are at, when the only difference is that the
        joined ones are at ``step`` and could make that call first (``CATCH_UP``; a
        ``clip_grad_norm_`` made with its max_norm); else None."""
        if any(r[_MAGIC] != MAGIC or r[_ORDINAL] != self.ordinal for r in rows):
            return None
        joined = [r for r in rows if r[_FLAGS] & JOINED]
        others = [r for r in rows if not r[_FLAGS] & JOINED]
        if not joined or not others:
            return None
        if len({(r[_ENTRY], r[_STEPS], r[_BACKWARDS], r[_ARG0], r[_ARG1]) for r in others}) != 1 or \
                len({r[_STEPS] for r in rows}) != 1 or \
                any(r[_ENTRY] != _CODE["step"] for r in joined):
            return None
        entry = ENTRIES[others[0][_ENTRY] - 1] if 1 <= others[0][_ENTRY] <= len(ENTRIES) else None
        if entry not in CATCH_UP or (entry == "clip_grad_norm_" and others[0][_ARG0] == _NO_ARG):
            return None
        return entry

    def _decide(self, entry: str, rows: list, signature, refuse: int, written) -> int:
        """What every rank does after an exchange at ``entry`` whose rows are ``rows``."""
        refusing = [(i, r[_ERROR]) for i, r in enumerate(rows) if r[_ERROR]]
        if refusing and not refuse:
            who = ", ".join(f"rank {i} ({REFUSALS.get(code, 'refused')})" for i, code in refusing)
            raise RuntimeError(f"ZeroAdam: {entry} was refused on {who}; the error there says "
                               "why. Nothing was changed on any rank")
        marks = [(r[_COUNT], r[_HASH]) for r in rows]
        if any(m != marks[0] for m in marks):
            wrote = [i for i, m in enumerate(marks) if m[0]]
            raise RuntimeError(
                f"ZeroAdam: parameters were written on some ranks and not others before {entry} "
                f"(ranks that wrote: {wrote}; this rank wrote parameters {list(written)[:8]} of its "
                "flat buffers); the optimizer's copies would differ from rank to rank. Write "
                "parameters on every rank alike (load the same state dict everywhere, or "
                "broadcast from one rank with torch.distributed.broadcast). Nothing was changed")
        resets = {r[_FLAGS] & RESET for r in rows}
        if len(resets) > 1:
            raise RuntimeError(
                f"ZeroAdam: opt.state was reset (replaced or cleared) on ranks "
                f"{[i for i, r in enumerate(rows) if r[_FLAGS] & RESET]} only, before {entry}; "
                "the shards of the state would start over on some ranks and not others. Reset "
                "it on every rank. Nothing was changed")
        agreed = 0
        for r in rows:
            agreed |= r[_FLAGS]
        if signature is not None and any(r[_SIGNATURE] != rows[0][_SIGNATURE] for r in rows):
            agreed |= DIFFER
        if any(r[_MISSING] != rows[0][_MISSING] for r in rows):
            agreed |= GRADS_DIFFER
        if len({r[_HYPER] for r in rows if not r[_FLAGS] & JOINED}) > 1:
            agreed |= HYPER_DIFFER
        return agreed

    def stepped(self) -> None:
        self.steps += 1

    def exchange(self, values: list) -> list:
        """Every rank's ``values`` (floats, as many on every rank), over the side group,
        right after an agreement that told every rank to exchange them."""
        mine = torch.tensor(values, dtype=torch.float64)
        every = torch.empty(self.comm.world_size * len(values), dtype=torch.float64)
        try:
            self._allgather(every, mine)
        except RuntimeError as exc:
            raise RuntimeError(f"zero_triton: an exchange of hyperparameters failed on rank "
                               f"{self.comm.rank}: a peer rank did not join it ({exc})") from exc
        return every.view(self.comm.world_size, len(values)).tolist()

    def _describe_mismatch(self, rows) -> str:
        def name(rank, r):
            code = r[_ENTRY]
            if r[_MAGIC] == MAGIC and code == side.LEFT:
                return f"rank {rank}: has left (its script ended, or it destroyed the process group)"
            call = ENTRIES[code - 1] if 1 <= code <= len(ENTRIES) and r[_MAGIC] == MAGIC else "?"
            return f"rank {rank}: {call} after {r[_STEPS]} steps and {r[_BACKWARDS]} backward passes" + (
                f" (optimizer #{r[_ORDINAL]})" if r[_ORDINAL] != self.ordinal else "")
        calls = {ENTRIES[r[_ENTRY] - 1] for r in rows if 1 <= r[_ENTRY] <= len(ENTRIES)}
        steps = {(r[_STEPS], r[_BACKWARDS]) for r in rows}
        fixes = [_FIXES[c] for c in ENTRIES if c in calls and c not in ("backward", "step")]
        if len(steps) > 1 or not fixes:
            fixes.append(_FIXES["step"])
        if "backward" in calls:
            fixes.append(_FIXES["backward"])
        if any(r[_MAGIC] == MAGIC and r[_ENTRY] == side.LEFT for r in rows):
            fixes.insert(0, "A rank left while the others still call ZeroAdam: every rank must run "
                            "the same iterations and end together (ranks with different numbers "
                            "of batches: torch's Join; a rank that fails must fail everywhere).")
        joined = [i for i, r in enumerate(rows) if r[_MAGIC] == MAGIC and r[_FLAGS] & JOINED]
        if joined:
            fixes.insert(0, f"Ranks {joined} ran out of inputs under torch's Join, and a joined "
                            "rank shadows the others' backward and step() only: under Join, clip "
                            "with max_grad_norm= (inside the step), step without GradScaler, and "
                            "save or load state after the Join block.")
        return ("ZeroAdam: the ranks are at different calls (" + "; ".join(name(i, r) for i, r in enumerate(rows)) +
                "), which would pair unrelated collectives and hang every rank. Nothing was "
                "changed on any rank. " + " ".join(fixes))


def _same_call(rows) -> bool:
    """Every rank at the same call of the same optimizer after as many steps and, but for
    ranks shadowing under Join (a joined rank runs one backward where the others may
    have run several under ``no_sync``), as many backward passes."""
    if any(r[_MAGIC] != MAGIC for r in rows):
        return False
    active = [r for r in rows if not r[_FLAGS] & JOINED] or rows
    first = active[0]
    return all((r[_ORDINAL], r[_ENTRY], r[_STEPS]) == (first[_ORDINAL], first[_ENTRY], first[_STEPS])
               and (r[_FLAGS] & JOINED or r[_BACKWARDS] == first[_BACKWARDS]) for r in rows)


def missing_digest(stepped) -> int:
    """0 when ``stepped`` (per flat buffer: None, every parameter has a gradient, or a
    list of bools) holds no False, else a 56-bit digest of it plus one: ranks whose
    digests are equal lack gradients for the same parameters."""
    lists = [(i, s) for i, s in enumerate(stepped) if s is not None and not all(s)]
    if not lists:
        return 0
    bits = repr([(i, [bool(b) for b in s]) for i, s in lists]).encode()
    return 1 + int.from_bytes(hashlib.blake2b(bits, digest_size=7).digest(), "little")


def _digest(indices) -> int:
    """An order-free digest of a set of (flat buffer, parameter) indices."""
    h = 0
    for i in indices:
        h = (h + (int(i) + 1) * 2654435761) % (1 << 61)
    return h
