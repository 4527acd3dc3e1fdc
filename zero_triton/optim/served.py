"""ZeroAdam's state as the shard server sees it (``zero_triton.comm.serve``): what a
rank's thread answers when another rank's ``state_dict()`` asks for its shards, wherever
this rank's main thread is.

``ServedState`` owns the counts the answer is checked against: steps (the agreement's)
and loads completed, both counted at their ends alike on every rank, a version bumped at
every write of the state and, per GPU, an event recorded after it (a host copy for
another rank waits for that event, not for the device).
"""
from __future__ import annotations

import threading
import weakref

import torch

from zero_triton.comm import serve
from zero_triton.optim import state_dict as adam_state


class ServedState:
    """``optimizer``: the ZeroAdam's seat (``zero_triton.optim.seat``; held weakly: the
    server's registry holds this);
    ``agreement``: its ``comm.agreement.Agreement`` (the step count); ``server``: the
    group's shard server. The chunks sent are the optimizer's ``_GATHER_CHUNK`` elements,
    as the asking rank's."""

    def __init__(self, optimizer, agreement, server):
        self._optimizer = weakref.ref(optimizer)
        self.agreement, self.server = agreement, server
        self.version = 0   # bumped, with an event per GPU, whenever the state is written
        self.events = {}
        # Loads (load_state_dict, checkpoint.load, agreed resets) completed, counted alike on
        # every rank as steps are, at their ends: the shard server waits for a peer's count.
        self.loads = 0
        self.settled = threading.Condition()
        server.register(agreement.ordinal, self.answer)

    def _seat(self):
        """The optimizer's seat, None once the optimizer was dropped."""
        seat = self._optimizer()
        return None if seat is None or seat.optimizer is None else seat

    def _shards(self) -> list:
        seat = self._seat()
        return [] if seat is None else [shard for _, shard in seat.shards()]

    def _chunk(self) -> int:
        seat = self._seat()
        return adam_state.GATHER_CHUNK if seat is None else seat.gather_chunk

    def written(self) -> None:
        """Mark a write of the state (a step's kernels, a load, a reset): a new version
        and, per GPU, an event on the current stream after it (``CapturedServedState``:
        none)."""
        self.version += 1
        for device in {shard.device for shard in self._shards() if shard.device.type == "cuda"}:
            event = self.events.get(device)
            if event is None:
                event = self.events[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))

    def stepped(self) -> None:
        """A step's collectives are done on every rank and its kernels queued: count it."""
        self.written()
        with self.settled:
            self.agreement.stepped()
            self.settled.notify_all()

    def loaded(self) -> None:
        """A load (or an agreed reset) wrote the state on every rank: count it."""
        self.written()
        with self.settled:
            self.loads += 1
            self.settled.notify_all()

    def counts(self) -> list:
        """[steps, loads]: what a request for another rank's shards carries."""
        return [self.agreement.steps, self.loads]

    def answer(self, words: list):
        """Another rank's ``state_dict()`` asks for this rank's shards (on the shard
        server's thread, wherever the main thread is): its step count, layout digest and
        count of loads in ``words``. This rank's shards change only inside collective
        calls the asking rank is not in, so none can start; the tail of a step or a load
        both took (after its last collective: the kernels, the copies of a loaded state)
        may still be running here, and is waited for: the counts go up at their ends."""
        steps, digest, loads = words[0], words[1], words[2]
        # (milliseconds; bounded well inside the group's timeout, which the asking rank's
        # peers may be waiting out in a collective of their own)
        timeout = min(30.0, self.server.timeout.total_seconds() / 4)
        with self.settled:
            self.settled.wait_for(lambda: self.agreement.steps >= steps and self.loads >= loads,
                                  timeout)
        shards = self._shards()
        header = [serve.OK, self.agreement.steps, self.loads, 0]
        if self.agreement.steps != steps:
            header[0] = serve.STEPS
        elif self.loads != loads:
            header[0] = serve.LOADS
        elif adam_state.layout_digest(shards) != digest:
            header[0] = serve.LAYOUT
        if header[0] != serve.OK:
            return serve.Answer(header)
        return self._answer(header, adam_state.shard_chunks(shards, self._chunk()))

    def _answer(self, header: list, chunks) -> serve.Answer:
        """The shards' chunks, sent once the writes before them are done on the device:
        after the events recorded at those writes, unless a later version replaced them."""
        return serve.Answer(header, chunks, ready=list(self.events.values()), version=self.version)


class CapturedServedState(ServedState):
    """The served state of a captured step (capturable=True, ``optim.capture``): a
    replayed step writes the state without this Python, so no version or event follows
    it: no event is recorded at a write (one recorded while a graph is captured is not
    one a replay records), and every answer waits for the device and is copied afresh
    (``serve.AFTER_DEVICE``)."""

    def written(self) -> None:
        self.version += 1

    def _answer(self, header: list, chunks) -> serve.Answer:
        return serve.Answer(header, chunks, ready=serve.AFTER_DEVICE)
