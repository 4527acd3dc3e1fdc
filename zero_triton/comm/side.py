"""One process group's side channel: what ZeroAdam keeps beside the user's group, and
when it goes.

The agreements (``zero_triton.comm.agreement``) and the shard server
(``zero_triton.comm.serve``) talk over a gloo group of their own: on the host whatever
the user's backend, and never paired with the user's data collectives. There is one per
process group, made by the group's first ZeroAdam (collectively: every rank of the group
is in that constructor) and shared by every ZeroAdam on it.

What a rank holds per group while the channel lives (docs/checkpoints.md: the arithmetic at 1,000
and 10,000 ranks): one gloo group (one worker thread, one transport thread, one socket
per peer and a listening one); the shard server's thread, blocked in a read of its own
store connection; no store keys (gloo's rendezvous keys are deleted once every rank has
connected; a request is a queue entry its peer pops).

When it goes (``close``): when the last ZeroAdam on the group is dropped; when the user
destroys the process group (torch drops the group's store from its registry: the signal,
``_on_destroy``); when the main thread ends; at exit. When the main thread ends normally,
or the group is destroyed (but not while an exception is on its way), the rank first
*leaves* (``leave``): a peer may still ask for
this rank's shards (``if rank == 0: torch.save(opt.state_dict())`` as a script's last
line, the other ranks done first), so it waits for every peer to leave too, serving
meanwhile. Leaving is one all-gather on the side group of a row that says so: a blocked
wait, no polling, no store. It ends when every peer has left, or one died (gloo fails
the all-gather at once when a peer's connection closes), or a peer is at an agreement
instead (that peer raises at once: "rank r has left"), or after ``LINGER_S``. A main
thread that ended on an exception (uncaught, or turned into a non-zero exit code by
``multiprocessing``, as ``torch.multiprocessing.spawn`` does) does not wait: it closes
at once, and its peers fail when its connections close.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from zero_triton.comm import serve
from zero_triton.comm.group import without_python_tls

# The agreement's row (``zero_triton.comm.agreement``): int64 words, a magic number, the
# optimizer's ordinal, the call's code. A row with the code ``LEFT`` says the rank has
# left (its main thread ended, or it destroyed the group).
WORDS = 14
MAGIC = 0x7A7401
LEFT = 99
LINGER_S = 120.0  # the longest a leaving rank waits for its peers to leave

_channels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pg -> SideChannel
_made: dict = {}  # group name -> channels this process made for it (their store prefixes)
_hooked = False
_inherited: list = []  # a forked child's copies of its parent's channels, never ended here


def group_timeout(pg) -> datetime.timedelta:
    """The timeout ``pg``'s collectives wait for (``init_process_group(timeout=...)`` or
    ``new_group(timeout=...)``; torch's default where the backend does not say): a side
    exchange waits for a peer no longer than the user's own collectives would."""
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except (RuntimeError, AttributeError):  # no backend for that device
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return dist.default_pg_timeout


def held(pg) -> bool:
    """Whether this process holds an open side channel of ``pg``."""
    ch = _channels.get(pg)
    return ch is not None and not ch.closed


def channel(pg, fresh: bool = False) -> "SideChannel":
    """``pg``'s side channel in this process, made on first use (collectively: every
    rank of ``pg`` makes it together); ``fresh``: made anew, closing the one held (every
    rank agreed: some had none left, their last optimizer on ``pg`` collected)."""
    ch = _channels.get(pg)
    if ch is not None and fresh:
        ch.close()
    if ch is None or ch.closed:
        ch = _channels[pg] = SideChannel(pg)
    return ch


def open_channels() -> list:
    return [ch for ch in list(_channels.values()) if not ch.closed]


class SideChannel:
    """The side gloo group of one process group, its shard server, and their lifetime."""

    def __init__(self, pg):
        global _hooked
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.timeout = group_timeout(pg)
        self.closed = False
        self.users = 0
        base = dist.distributed_c10d._get_default_store()
        # A prefix of its own per channel made for this group name (the same count on
        # every rank): a group destroyed and made again under its name starts afresh.
        generation = _made[pg.group_name] = _made.get(pg.group_name, 0) + 1
        prefix = f"zero_triton/side/{pg.group_name}/{generation}/"
        mesh = dist.PrefixStore(prefix + "mesh/", base)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._threads = 1  # one exchange at a time: the agreements are sequential
        self.group = dist.ProcessGroupGloo(mesh, self.rank, self.world_size, options)
        # Every rank has connected to every other once all have built the group: its
        # rendezvous keys (one per rank) are read by nobody after that.
        self._exchange(torch.zeros(1, dtype=torch.int64))
        with contextlib.suppress(Exception):
            mesh.delete_key(f"0/{self.rank}")
        self.server = serve.ShardServer(self.group, base, prefix + "serve/", self.rank,
                                        self.world_size, self.timeout)
        # torch holds the group's store in its registry until destroy_process_group
        # drops it: our cue to leave, with no patch of torch (``_on_destroy``).
        entry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}).get(pg)
        watched = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else pg
        self._destroyed = weakref.finalize(watched, _on_destroy, weakref.ref(self))
        self._destroyed.atexit = False
        if not _hooked:
            _hooked = True
            register = getattr(threading, "_register_atexit", None)
            if register is not None:  # CPython: called before threads are joined at exit
                with contextlib.suppress(RuntimeError):  # made while the interpreter exits
                    register(_at_main_thread_end)

    # -- users --------------------------------------------------------------------------
    def attach(self, owner) -> None:
        """``owner`` (a ZeroAdam) uses the channel; when the last owner is dropped, the
        channel closes."""
        self.users += 1
        weakref.finalize(owner, _detach, weakref.ref(self)).atexit = False

    def _exchange(self, mine: torch.Tensor, seconds: float | None = None) -> torch.Tensor:
        every = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype)
        with without_python_tls():
            work = self.group._allgather_base(every, mine)
        if seconds is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=seconds))
        return every

    # -- lifetime -----------------------------------------------------------------------
    def leave(self) -> None:
        """Wait until every peer has left as well (or died, or is at an agreement, which
        then raises there), at most ``LINGER_S``, answering their requests meanwhile;
        then close."""
        if self.closed:
            return
        self.server.leaving = True
        row = torch.zeros(WORDS, dtype=torch.int64)
        row[0], row[1], row[2] = MAGIC, -1, LEFT
        every = torch.empty(self.world_size * WORDS, dtype=torch.int64)
        together = False
        try:
            with without_python_tls():
                work = self.group._allgather_base(every, row)
            work.wait(datetime.timedelta(seconds=min(LINGER_S, self.timeout.total_seconds())))
            together = all(r[2] == LEFT for r in every.view(self.world_size, WORDS).tolist())
        except RuntimeError:  # a peer died or exited (its connections closed), or the cap
            pass
        if together:
            # Every rank left: each stops its server, then one more exchange, so that no
            # server is still reading the store when the rank that hosts it exits.
            self.server.stop()
            with contextlib.suppress(RuntimeError):
                self._exchange(torch.zeros(1, dtype=torch.int64), seconds=10.0)
        self.close()

    def close(self) -> None:
        """Stop the server thread and shut the gloo group down (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._destroyed.detach()
        self.server.stop()
        self.server.release()
        with contextlib.suppress(Exception):
            self.group.shutdown()
        self.group = None  # the last reference: the group joins its threads, closes its sockets


def _detach(ref) -> None:
    ch = ref()
    if ch is not None:
        ch.users -= 1
        if ch.users <= 0:
            ch.close()


def _on_destroy(ref) -> None:
    ch = ref()
    if ch is None or ch.closed:
        return
    if sys.exc_info()[1] is not None:
        # Destroyed while an exception is on its way (a ``finally:`` clause, an ``except:``
        # handler): this rank failed, and does not wait; its peers fail as its side
        # connections close.
        ch.close()
    else:
        ch.leave()


def _at_main_thread_end() -> None:
    """Before the interpreter joins threads at exit (or a multiprocessing child ends):
    leave every open channel, or close them at once if the main thread failed."""
    failed = _ended_on_failure()
    for ch in open_channels():
        if failed:
            ch.close()
        else:
            ch.leave()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker: fork is its default on Linux) holds copies of
    its parent's channels, whose sockets and store connection it shares and whose threads
    it lacks. It must neither leave (an all-gather no thread of its would run: each
    worker's end waited 5 s, DataLoader's join limit, each epoch) nor close (a shutdown
    acts on the sockets the parent still uses): they are marked closed, and kept
    referenced so that nothing in the child ends them."""
    for ch in list(_channels.values()):
        ch.closed = True
        ch._destroyed.detach()
        _inherited.append(ch)
    _channels.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def close_all() -> None:
    for ch in open_channels():
        ch.close()


def _ended_on_failure() -> bool:
    """The main thread ended on an uncaught exception (the interpreter printed it), or
    in a ``multiprocessing`` child with a non-zero exit code (``torch.multiprocessing.
    spawn`` turns a rank's exception into ``sys.exit(1)``; the child's bootstrap holds
    the code when it shuts threading down). A plain script's ``sys.exit(n)`` cannot be
    told from a normal end: such a rank leaves (docs/checkpoints.md, "State dicts on one rank")."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_bootstrap" and \
                code.co_filename.endswith(os.path.join("multiprocessing", "process.py")):
            return frame.f_locals.get("exitcode", 0) not in (0, None)
        frame = frame.f_back
    return False
