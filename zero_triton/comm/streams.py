"""Where a bucket's gradient average runs on a GPU: a side stream per device.

Launched from backward's hooks on the compute stream, an all-to-all (or NCCL's
reduce-scatter) runs on NCCL's stream, and its sum in rank order must run after it. Waited
for on the compute stream, each sum would make backward wait for that bucket's
collective, and a receive buffer could only be reused after such a wait: the compute
stream would stall behind earlier buckets' communication (DeepSpeed's serialization,
deepspeedai/DeepSpeed#8364). Here a bucket's whole average runs on the side stream:

    side.wait_stream(compute)        # the gradients backward just wrote
    on side: collective, wait for it, sum in rank order
    done = event recorded on side

The compute stream waits for ``done`` only where it reads or writes what the average
touches: at ``step`` (the averaged shard), before another micro-batch accumulates into the
same bucket (ZeRO-1), at ``zero_grad``. Everything the averages use in turn, receive
buffers above all, is reused in the side stream's own order, so no wait is needed for it;
ZeRO-2's staging buffers, written by the compute stream, are reused once their event has
passed (``query``, a host check that never blocks), and new ones are made while none has,
up to a cap that bounds the memory (``buckets.Reducer``).

On CPUs the collectives run on gloo's threads and waiting blocks the host: ``side_stream``
returns None and the reducer waits as before.
"""
from __future__ import annotations

import torch


class Done:
    """A bucket's average recorded on a side stream (a ``comm.Pending`` to the reducer):
    ``wait()`` makes the current stream wait for it, never the host."""

    __slots__ = ("event", "device")

    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self) -> None:
        event, self.event = self.event, None
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def query(self) -> bool:
        """Whether the average has finished (never blocks)."""
        return self.event is None or self.event.query()


class SideStream:
    """One device's side stream for the gradient averages."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, start, landed=None) -> Done:
        """Run ``start()`` (a function starting a collective and returning its Pending)
        and the wait for its result on the side stream, after the work already queued
        on the current stream, then ``landed()`` (None: nothing) behind them there;
        returns the event to wait for."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start().wait()  # the side stream waits, and the rank-order sum runs on it
            if landed is not None:  # offload's copy of the average to the host
                landed()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Done(event, self.device)


def side_stream(device: torch.device):
    """The side stream for buckets on ``device``; None on CPUs (gloo's threads)."""
    return SideStream(device) if device.type == "cuda" else None
