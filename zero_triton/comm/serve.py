"""A rank's shards, sent to any rank that asks, whatever this rank is doing.

``ZeroAdam.state_dict()`` needs every rank's shard of the state. As a collective it
needs every rank to call it, and the commonest save in training scripts calls it on one:
``if rank == 0: torch.save(opt.state_dict())`` followed by ``dist.barrier()`` (PyTorch's
DDP tutorial), or HF Trainer's checkpoint. The other ranks then wait in a collective of
their own that nothing pairs with, and every rank hangs for the process group's timeout.

So each process runs one ``ShardServer`` per process group: a thread that serves
requests for this rank's shards while its main thread is anywhere (in a barrier, in
backward, waiting at the next step's agreement). A rank that wants the state posts a
request to each peer through the rendezvous store (a key, then a counter the thread
polls) and receives the shards over a gloo group of the server's own, chunk by chunk in
an order both sides derive from the same layout. The optimizer provides what is sent
(``register``): its shards are only changed inside collective calls that need every
rank, so while a rank is in ``state_dict()`` no peer can change its shard; a peer still
finishing the step it already took is waited for. The thread outlives the main thread
while a peer may still ask (``ShardServer``).
"""
from __future__ import annotations

import atexit
import contextlib
import struct
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist

from zero_triton.comm import agreement

# A request, as the store carries it: ordinal, requester, tag, then the optimizer's own
# words (its step count and a digest of its layout).
_REQUEST = struct.Struct("<6q")
HEADER_WORDS = 4
# Header statuses (the first word of a server's answer): answered; no optimizer of that
# ordinal here; it failed reading (its stderr says why); at another step count; other
# flat buffers.
OK, NO_OPTIMIZER, FAILED, STEPS, LAYOUT = range(5)
POLL_S = 0.05  # how often an idle server looks for requests
LINGER_S = 120.0  # at most this long after the main thread ended, for a peer still to ask
HOST_GRACE_S = 5.0  # rank 0, after its main thread ended, for the peers to end
BLOCKED_S = 1.0  # a main thread waiting this long in an agreement is told to the others

_servers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_made: dict = {}  # group name -> servers this process made for it (their store prefixes)


def server_for(pg) -> "ShardServer":
    """The server of ``pg`` in this process, made (collectively: every rank of ``pg``
    builds its gloo group together) on first use."""
    server = _servers.get(pg)
    if server is None:
        server = _servers[pg] = ShardServer(pg)
    return server


def _stop_all() -> None:
    """At exit (the server threads have ended by then, unless they could not): shut down."""
    for server in list(_servers.values()):
        server.close()
    _servers.clear()


atexit.register(_stop_all)


class ShardServer:
    """One process group's server thread, and the requests this rank makes of others.

    The thread is not a daemon: when the main thread ends, it stays (answering) while a
    peer's main thread still runs and so may still ask, at most ``LINGER_S``. So a
    script that ends with ``if rank == 0: torch.save(opt.state_dict())``, or with ``sd =
    opt.state_dict()`` on every rank, ends on every rank, whichever rank is done first.
    It does not stay for a peer waiting in an agreement (it waits for this rank, which
    will not come: it fails once this process exits, as it did without the server),
    nor when the main thread ended on an exception."""

    def __init__(self, pg):
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.timeout = agreement.group_timeout(pg)
        base = dist.distributed_c10d._get_default_store()
        # A prefix of its own per server made for this group name (the same count on
        # every rank): a group destroyed and made again under its name starts afresh.
        generation = _made[pg.group_name] = _made.get(pg.group_name, 0) + 1
        prefix = f"zero_triton/serve/{pg.group_name}/{generation}/"
        self.store = dist.PrefixStore(prefix + "requests/", base)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "data/", base),
                                           self.rank, self.world_size, self.timeout)
        self.providers: dict = {}          # ordinal -> weakref.WeakMethod of a provider
        self.asking = threading.Lock()     # one request of this rank's at a time
        self.asked = 0                     # requests this rank made
        self.blocked = False               # what _say_if_blocked last told the others
        self.stopping = threading.Event()
        # Set when the interpreter starts shutting down (threading's exit hooks run before
        # it joins this thread): an idle server wakes at once instead of at its next poll.
        self.wake = threading.Event()
        register_exit = getattr(threading, "_register_atexit", None)
        if register_exit is not None:
            register_exit(self.wake.set)
        self.thread = threading.Thread(target=self._serve, name="zero_triton shard server")
        self.thread.start()

    def register(self, ordinal: int, provider) -> None:
        """``provider(words) -> (header, chunks)``: the answer to a request with the
        requester's ``words``: a header (``HEADER_WORDS`` ints, status first) and, when
        the status is OK, the tensors to send in order."""
        self.providers[ordinal] = weakref.WeakMethod(provider)

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL_S + 1)
        with contextlib.suppress(Exception):
            self.group.shutdown()

    # -- serving ----------------------------------------------------------------------
    def _serve(self) -> None:
        seen = 0
        try:
            while not self.stopping.is_set() and threading.main_thread().is_alive():
                seen = self._poll(seen)
                self._say_if_blocked()
            self.store.set(f"ended/{self.rank}", b"1")  # this rank asks for nothing more
            if not self.stopping.is_set() and not _ended_on_an_exception():
                self._linger(seen)
            self.store.set(f"exited/{self.rank}", b"1")
        except Exception:  # the store or a peer went away (exit, a failed job): stop serving
            return

    def _poll(self, seen: int, idle=None) -> int:
        """Answer the requests that arrived (a counter per rank, then a key per
        requester); when there are none, ``idle()`` (by default: wait up to ``POLL_S``,
        or until the interpreter starts shutting down). Returns the counter read."""
        count = self.store.add(f"count/{self.rank}", 0)
        if count == seen:
            if idle is not None:
                idle()
            else:
                self.wake.wait(POLL_S)
            return seen
        for requester in range(self.world_size):
            key = f"request/{self.rank}/{requester}"
            if requester != self.rank and self.store.check([key]):
                words = _REQUEST.unpack(self.store.get(key))
                self.store.delete_key(key)
                try:
                    self._answer(words)
                except Exception:  # that requester went away: serve the others on
                    traceback.print_exc()
        return count

    def _say_if_blocked(self) -> None:
        """Tell the others (a key in the store, written when it changes) whether this
        rank's main thread has waited in an agreement for over ``BLOCKED_S``: a rank
        whose main thread has ended need not stay for it, it is waiting for the others."""
        since = agreement.waiting_since()
        blocked = since is not None and time.monotonic() - since > BLOCKED_S
        if blocked != self.blocked:
            self.blocked = blocked
            if blocked:
                self.store.set(f"blocked/{self.rank}", b"1")
            else:
                self.store.delete_key(f"blocked/{self.rank}")

    def _linger(self, seen: int) -> None:
        """After the main thread ended: answer on while a peer's main thread still runs
        and may ask (not ended, not waiting in an agreement for the ranks that ended), at
        most ``LINGER_S``; rank 0, which usually holds the store the others read, also
        waits up to ``HOST_GRACE_S`` for the others to end."""
        now = time.monotonic()
        until = now + min(LINGER_S, self.timeout.total_seconds())
        host_until = now + HOST_GRACE_S
        peers = [p for p in range(self.world_size) if p != self.rank]
        while True:
            running = [p for p in peers if not self.store.check([f"exited/{p}"])
                       and not self.store.check([f"blocked/{p}"])]
            asking = [p for p in running if not self.store.check([f"ended/{p}"])]
            now = time.monotonic()
            if (not asking or now > until) and (self.rank != 0 or not running or now > host_until):
                return
            seen = self._poll(seen, lambda: time.sleep(POLL_S / 5))

    def _answer(self, words) -> None:
        ordinal, requester, tag = words[:3]
        # An optimizer registers at the end of its constructor, after its last collective:
        # a peer done first may ask before (accelerate's prepare asks at once).
        deadline = time.monotonic() + min(30.0, self.timeout.total_seconds() / 4)
        while ordinal not in self.providers and time.monotonic() < deadline:
            time.sleep(0.002)
        ref = self.providers.get(ordinal)
        provider = ref() if ref is not None else None
        if provider is None:
            header, chunks = [NO_OPTIMIZER] + [0] * (HEADER_WORDS - 1), ()
        else:
            try:
                header, chunks = provider(list(words[3:]))
            except Exception:  # never leave the requester waiting for a header
                traceback.print_exc()
                header, chunks = [FAILED] + [0] * (HEADER_WORDS - 1), ()
        self._send(torch.tensor(header, dtype=torch.int64), requester, tag)
        for chunk in chunks:
            self._send(chunk, requester, tag)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tensor.device.type != "cpu":
            torch.cuda.synchronize(tensor.device)  # the main thread's streams wrote it
            tensor = tensor.cpu()
        self.group.send([tensor.contiguous()], dst, tag).wait()

    # -- asking -------------------------------------------------------------------------
    @contextlib.contextmanager
    def ask(self, ordinal: int, words: list):
        """Ask every peer for optimizer ``ordinal``'s shards (``words``: two ints the
        provider reads); yields a ``Reply`` to receive the answers with. A reply is read
        to its end (``Reply.drain`` reads what is left), or the peers would wait."""
        with self.asking:
            self.asked += 1
            tag = 1 + self.asked % (1 << 30)  # sends pair by (peer, tag): ours alone
            payload = _REQUEST.pack(ordinal, self.rank, tag, *words, 0)
            peers = [r for r in range(self.world_size) if r != self.rank]
            for peer in peers:
                self.store.set(f"request/{peer}/{self.rank}", payload)
                self.store.add(f"count/{peer}", 1)
            reply = Reply(self, peers, tag)
            try:
                yield reply
            finally:
                reply.drain()


class Reply:
    """The peers' answers to one request: a header each, then, from each peer whose
    status is OK, the tensors its provider sends, received in the same order."""

    def __init__(self, server: ShardServer, peers: list, tag: int):
        self.server, self.peers, self.tag = server, peers, tag
        self.headers = {}
        works = {}
        for peer in peers:
            self.headers[peer] = torch.empty(HEADER_WORDS, dtype=torch.int64)
            works[peer] = server.group.recv([self.headers[peer]], peer, tag)
        for peer, work in works.items():
            _wait(work, peer, server)
        self.headers = {peer: h.tolist() for peer, h in self.headers.items()}
        self.sending = [p for p in peers if self.headers[p][0] == OK]
        self.expected = None  # the chunks each OK peer sends, when the reader knows

    def expect(self, sizes: list) -> None:
        """The (numel, dtype) of each tensor every peer that said OK will send, in order:
        what ``drain`` reads and drops if the reader stops early."""
        self.expected = list(sizes)

    def receive(self, outs: dict) -> None:
        """Receive the next tensor from each peer in ``outs`` (peer -> a CPU tensor of
        the size that peer sends next)."""
        if self.expected:
            self.expected.pop(0)
        works = {peer: self.server.group.recv([out], peer, self.tag) for peer, out in outs.items()}
        for peer, work in works.items():
            _wait(work, peer, self.server)

    def drain(self) -> None:
        while self.expected and self.sending:
            numel, dtype = self.expected[0]
            self.receive({peer: torch.empty(numel, dtype=dtype) for peer in self.sending})


def _wait(work, peer: int, server: ShardServer) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise RuntimeError(
            f"zero_triton: rank {server.rank} asked rank {peer} for its shards and got no answer "
            f"within the process group's timeout ({server.timeout.total_seconds():g} s) or the "
            f"connection closed ({exc}); it probably died or exited") from exc


def _ended_on_an_exception() -> bool:
    """The main thread ended on an uncaught exception (the interpreter printed it)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
