"""A rank's shards, sent to any rank that asks, whatever this rank's main thread is doing.

``ZeroAdam.state_dict()`` needs every rank's shard of the state. As a collective it
needs every rank to call it, and the commonest save in training scripts calls it on one:
``if rank == 0: torch.save(opt.state_dict())`` followed by ``dist.barrier()`` (PyTorch's
DDP tutorial), or HF Trainer's checkpoint. The other ranks then wait in a collective of
their own that nothing pairs with. Their main threads cannot answer, so something beside
them must: the simplest thing that can is one thread per process group, and this is it.

- **Idle costs nothing.** The thread blocks in one read of its mailbox in the
  rendezvous store (``zero_triton.comm.mailbox``: a store queue, or on torch 2.7 a
  numbered key, on a store connection of its own): no polling; one store operation per
  ``mailbox.IDLE_WAIT`` (an hour) while nobody asks.
- **A request** is one entry pushed to each peer's mailbox: O(world size) store
  operations per request, one or two per peer; the data goes over the side channel's gloo group
  (``zero_triton.comm.side``), a header then the shards in chunks, in an order both sides
  derive from the same layout.
- **No wait cycles.** A server never waits for a requester: it posts every send of an
  answer at once (gloo sends complete when the receiver takes them) and goes back to its
  queue. A requester waits only for servers, and a server only for its own main thread to
  finish the tail of a step both ranks took (bounded). So any set of ranks can ask at
  once, in any order.
- **Consistent.** A rank's shards change only inside calls that need every rank (``step``,
  loads), so none can change while a peer is in ``state_dict()``; the sends read them in
  place. A shard on a GPU is copied to the host on a stream of the server's own, after an
  event the optimizer recorded when it last wrote the state (``Answer.ready``): never a
  device-wide synchronize, which would wait for the main thread's kernels (an NCCL
  barrier spinning for the asking rank, say). Concurrent requesters share one host copy.
- **Loud.** An answer that fails sends a FAILED header with the reason, which the
  requester raises; a server that loses its store says so on its rank's stderr, and a
  requester finds the store gone at once. A peer that died fails the request at once
  (gloo closes its connections).
- **Lifetime.** The side channel stops the thread (``stop``: a STOP entry in its own
  mailbox) when the group is destroyed, its last optimizer dropped, or the process exits.
"""
from __future__ import annotations

import contextlib
import datetime
import struct
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch

from zero_triton.comm.mailbox import MailboxError, open_mailbox

# A mailbox entry: kind, ordinal, requester, tag, then the optimizer's three words (its step
# count, a digest of its layout, its count of loads).
_ENTRY = struct.Struct("<7q")
ASK, STOP = 1, 2
HEADER_WORDS = 4
# Header statuses (the first word of a server's answer): answered; no optimizer of that
# ordinal here; it failed reading (the reason follows as bytes: word 2 is their count);
# at another step count; other flat buffers; at another count of loads.
OK, NO_OPTIMIZER, FAILED, STEPS, LAYOUT, LOADS = range(6)
REGISTER_WAIT_S = 30.0  # at most this long for an optimizer still being built to register


# ``Answer.ready``: wait for everything queued on the device (a state that CUDA graph
# replays write, which record no event: capturable=True).
AFTER_DEVICE = "after the device"


@dataclass
class Answer:
    """What a provider returns: the header (``HEADER_WORDS`` ints, status first), the
    tensors to send in order when the status is OK, and for state on a GPU the events
    after the state's last write (one per device) plus a key that changes with every
    write (``version``), under which one host copy serves every requester."""
    header: list
    chunks: object = ()
    ready: object = None
    version: object = None


class ShardServer:
    """One process group's server thread, and the requests this rank makes of others,
    over ``group`` (the side channel's gloo group) and a mailbox under ``prefix`` of the
    rendezvous store ``base``."""

    def __init__(self, group, base, prefix: str, rank: int, world_size: int,
                 timeout: datetime.timedelta):
        self.group = group
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.providers: dict = {}          # ordinal -> weakref.WeakMethod of a provider
        self.registered = threading.Condition()
        self.asking = threading.Lock()     # one request of this rank's at a time
        self.asked = 0                     # requests this rank made
        self.sending: list = []            # (work, tensor) of answers not yet taken
        self.copies: dict = {}             # ordinal -> (version, host tensors)
        self.streams: dict = {}            # device -> the server's copy stream
        self.failure = None                # why the thread stopped, if not asked to
        self.stopping = False
        self.leaving = False               # the rank is leaving: its store may go first
        self.inbox = None
        self.thread = None
        try:  # with a store connection of the thread's own: its blocked read holds it
            self.inbox = open_mailbox(base, prefix, rank)
        except MailboxError as exc:
            self.failure = str(exc)
            return
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"zero_triton shard server (rank {rank})")
        self.thread.start()

    def register(self, ordinal: int, provider) -> None:
        """``provider(words) -> Answer``: the answer to a request with the requester's
        ``words`` (its step count, layout digest and count of loads)."""
        with self.registered:
            self.providers[ordinal] = weakref.WeakMethod(provider)
            self.registered.notify_all()

    def stop(self) -> None:
        """End the thread (a STOP entry in its own queue) and wait for it, briefly."""
        self.stopping = True
        with self.registered:
            self.registered.notify_all()
        if self.thread is None or not self.thread.is_alive():
            return
        try:
            self.inbox.push(self.rank, _ENTRY.pack(STOP, 0, 0, 0, 0, 0, 0))
        except Exception:  # the store is gone: the blocked read fails by itself
            pass
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)

    def release(self) -> None:
        """Drop the group, the store connections and what answers held (after ``stop``)."""
        self.group = self.inbox = None
        self.sending.clear()
        self.copies.clear()
        self.streams.clear()

    # -- serving ----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                entry = self.inbox.pop()
            except Exception as exc:  # noqa: BLE001 - any store failure ends the thread
                if "timeout" in str(exc).lower() and not self.stopping:
                    continue  # nobody asked for an hour: read again
                if not self.stopping:
                    self.failure = f"its store connection failed ({exc})"
                if not self.stopping and not self.leaving:
                    sys.stderr.write(f"zero_triton: rank {self.rank}'s shard server stopped: "
                                     f"{self.failure}; state_dict() on one rank can no longer "
                                     "reach this rank (call it on every rank, or use "
                                     "zero_triton.checkpoint.save)\n")
                return
            kind, ordinal, requester, tag, *words = _ENTRY.unpack(entry)
            if kind == STOP:
                return
            self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
            try:
                self._answer(ordinal, requester, tag, words)
            except Exception:  # noqa: BLE001 - the requester went away: serve the others on
                if not self.stopping:
                    traceback.print_exc()

    def _provider(self, ordinal: int):
        """The live provider of ``ordinal``; one never registered is waited for (a peer
        done with its constructor first may ask at once: accelerate's prepare does)."""
        deadline = time.monotonic() + min(REGISTER_WAIT_S, self.timeout.total_seconds() / 4)
        with self.registered:
            while ordinal not in self.providers and not self.stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.registered.wait(left)
            ref = self.providers.get(ordinal)
        return ref() if ref is not None else None

    def _answer(self, ordinal: int, requester: int, tag: int, words: list) -> None:
        provider = self._provider(ordinal)
        reason = b""
        if provider is None:
            answer = Answer([NO_OPTIMIZER] + [0] * (HEADER_WORDS - 1))
        else:
            try:
                answer = provider(words)
                chunks = list(answer.chunks) if answer.header[0] == OK else []
                if any(c.device.type != "cpu" for c in chunks):
                    chunks = self._host_copy(ordinal, chunks, answer)
            except Exception as exc:  # noqa: BLE001 - never leave the requester waiting
                traceback.print_exc()
                reason = f"{type(exc).__name__}: {exc}".encode()[:4096]
                answer, chunks = Answer([FAILED, 0, len(reason), 0]), []
        header = list(answer.header) + [0] * (HEADER_WORDS - len(answer.header))
        self._post(torch.tensor(header, dtype=torch.int64), requester, tag)
        if reason:
            self._post(torch.frombuffer(bytearray(reason), dtype=torch.uint8), requester, tag)
        for chunk in (chunks if header[0] == OK else ()):
            self._post(chunk, requester, tag)

    def _post(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send without waiting: gloo keeps it until ``dst`` receives it (the tensor is
        held here until then)."""
        tensor = tensor.contiguous()
        self.sending.append((self.group.send([tensor], dst, tag), tensor))

    def _host_copy(self, ordinal: int, chunks: list, answer: Answer) -> list:
        """``chunks`` (on a GPU) copied to pinned host memory on a stream of the server's
        own, after ``answer.ready`` (the events after the state's last write); one copy
        per ``answer.version``, shared by every requester of it."""
        cached = self.copies.get(ordinal)
        if cached is not None and cached[0] == answer.version and answer.version is not None:
            return cached[1]
        self.copies.pop(ordinal, None)  # the old copy goes before the new one is made
        device = chunks[0].device
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        host = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True) for c in chunks]
        if answer.ready is AFTER_DEVICE:
            torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            for event in () if answer.ready is AFTER_DEVICE else answer.ready or ():
                stream.wait_event(event)
            for h, c in zip(host, chunks):
                h.copy_(c, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # this stream's copies only: the main thread's work goes on
        self.copies[ordinal] = (answer.version, host)
        return host

    # -- asking -------------------------------------------------------------------------
    def ask(self, ordinal: int, words: list, peers=None) -> "Reply":
        """Ask every peer (``peers``: those ranks of the channel; hybrid sharding asks its
        own copy's) for optimizer ``ordinal``'s shards (``words``: three ints the
        provider reads); returns a ``Reply`` to receive the answers with, read to its end
        (``Reply.drain``: ``with server.ask(...) as reply``), or the peers' sends wait."""
        if self.stopping:
            raise RuntimeError("ZeroAdam.state_dict() on one rank: the process group's side "
                               "channel is closed (destroy_process_group() was called, or "
                               "the process is exiting)")
        if self.inbox is None or self.failure is not None:
            raise RuntimeError(f"ZeroAdam.state_dict() on one rank: rank {self.rank}'s shard "
                               f"server is not running: {self.failure}. Call "
                               "consolidated_state_dict() on every rank instead, or use "
                               "zero_triton.checkpoint.save")
        self.asking.acquire()
        try:
            self.asked += 1
            tag = 1 + self.asked % (1 << 30)  # sends pair by (peer, tag): ours alone
            entry = _ENTRY.pack(ASK, ordinal, self.rank, tag, *words)
            peers = [r for r in (range(self.world_size) if peers is None else peers)
                     if r != self.rank]
            for peer in peers:
                self.inbox.push(peer, entry)
        except BaseException:
            self.asking.release()
            raise
        return Reply(self, peers, tag)  # it lets the next request go (on failure, at once)


class Reply:
    """The peers' answers to one request: a header each (and a FAILED one's reason),
    then, from each peer whose status is OK, the tensors its provider sends, received in
    the same order. A context manager: on exit it reads what is left and lets the next
    request of this rank's go."""

    def __init__(self, server: ShardServer, peers: list, tag: int):
        self.server, self.peers, self.tag = server, peers, tag
        self.expected = None  # the chunks each OK peer sends, when the reader knows
        self.sending = []
        self.reasons = {}
        try:
            headers = {p: torch.empty(HEADER_WORDS, dtype=torch.int64) for p in peers}
            self._receive(headers)
            self.headers = {peer: h.tolist() for peer, h in headers.items()}
            failed = {p: torch.empty(h[2], dtype=torch.uint8)
                      for p, h in self.headers.items() if h[0] == FAILED and h[2] > 0}
            self._receive(failed)
            self.reasons = {p: bytes(t.tolist()).decode(errors="replace") for p, t in failed.items()}
            self.sending = [p for p in peers if self.headers[p][0] == OK]
        except BaseException:
            server.asking.release()
            raise

    def __enter__(self) -> "Reply":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.drain()
        finally:
            self.server.asking.release()

    def expect(self, sizes: list) -> None:
        """The (numel, dtype) of each tensor every peer that said OK will send, in order:
        what ``drain`` reads and drops if the reader stops early."""
        self.expected = list(sizes)

    def receive(self, outs: dict) -> None:
        """Receive the next tensor from each peer in ``outs`` (peer -> a CPU tensor of
        the size that peer sends next)."""
        if self.expected:
            self.expected.pop(0)
        self._receive(outs)

    def _receive(self, outs: dict) -> None:
        group, tag = self.server.group, self.tag
        works, peer = {}, None
        try:
            for peer, out in outs.items():
                works[peer] = group.recv([out], peer, tag)
            for peer, work in works.items():
                work.wait()
        except RuntimeError as exc:  # posting fails at once where the connection closed
            for other in works.values():  # the receives already posted land before we go
                if not other.is_completed():  # waiting a finished receive again waits for
                    with contextlib.suppress(RuntimeError):  # another: the timeout
                        other.wait()
            raise RuntimeError(
                f"zero_triton: rank {self.server.rank} asked rank {peer} for its shards and "
                f"got no answer within the process group's timeout "
                f"({self.server.timeout.total_seconds():g} s) or the connection closed "
                f"({exc}); it probably died, exited or destroyed its process group") from exc

    def drain(self) -> None:
        while self.expected and self.sending:
            numel, dtype = self.expected[0]
            self.receive({peer: torch.empty(numel, dtype=dtype) for peer in self.sending})
