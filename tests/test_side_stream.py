"""The reducer's GPU mode (zero_triton.comm.streams), its host logic run on gloo ranks.

On a GPU each bucket's average runs on a side stream and returns an event; the
compute stream waits for an event only where it touches what that average touches.
``HostSide`` keeps that contract on CPUs: ``run`` finishes the collective at once, and
its events pass only ``lag`` launches later (or when waited for), as averages still
queued behind the network would. So the reducer's GPU bookkeeping (receive buffers
reused in the stream's order, staging buffers reused by event, new ones while none has
passed, the cap) runs here, and what is checked is:
- the results are bitwise those of the CPU mode, stage 1 and 2, micro-batches,
  GradScaler's unscale_ (gradients averaged again);
- backward never waits for an average (a single backward per step, stage 1 and 2, and
  stage 2's micro-batches), and ZeRO-2's staging buffers stay within the cap;
- with averages that never pass on their own, the cap makes backward wait, and the
  results are still the same.
The CUDA streams and events themselves run in tests/test_cuda_* when a GPU is there.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import requires_cuda  # noqa: E402
from test_overlap import TINY, assert_bitwise, packed, ranks, train  # noqa: E402

import zero_triton.comm.streams  # noqa: E402


class HostDone:
    def __init__(self, log):
        self.log, self.passed = log, False

    def wait(self):
        if not self.passed and torch._C._current_graph_task_id() != -1:
            self.log["backward_waits"] += 1  # the compute stream would wait in backward
        self.passed = True

    def query(self):
        return self.passed


class HostSide:
    def __init__(self, log, lag):
        self.log, self.lag, self.recent = log, lag, []

    def run(self, start, landed=None):
        start().wait()
        if landed is not None:  # offload's copy, behind the average on the side stream
            landed()
            self.log["landed"] += 1
        done = HostDone(self.log)
        self.recent.append(done)
        while len(self.recent) > self.lag:
            self.recent.pop(0).passed = True
        self.log["runs"] += 1
        return done


RUNS = {
    "stage 1": dict(bucket_cap_mb=TINY, use_overlap=True),
    "stage 2": dict(bucket_cap_mb=TINY, use_overlap=True, stage=2),
    "stage 2, micro-batches": dict(bucket_cap_mb=TINY, use_overlap=False, stage=2, accumulate=3),
    "stage 1, micro-batches without no_sync": dict(bucket_cap_mb=TINY, use_overlap=False,
                                                   accumulate=3, no_sync=False),
    "stage 1, GradScaler skipping a step": dict(bucket_cap_mb=TINY, use_overlap=True, scaler=True,
                                                inf_at=1),
    # The state in host memory: each average copied to the host as it lands.
    "stage 2, offloaded, unscaled and clipped": dict(bucket_cap_mb=TINY, use_overlap=True, stage=2,
                                                     offload="cpu", scaler=True, clip="torch"),
}


@packed
def _job_side(rank, world_size):
    original = zero_triton.comm.streams.side_stream
    out = {}
    for name, kwargs in RUNS.items():
        for lag in (None, 2, 10**9):  # None: the CPU mode
            if lag == 10**9 and kwargs.get("stage") != 2:
                continue
            log = {"backward_waits": 0, "runs": 0, "landed": 0}
            if lag is not None:
                zero_triton.comm.streams.side_stream = lambda device, lag=lag, log=log: HostSide(log, lag)
            try:
                out[name, lag] = {**train(rank, world_size, **kwargs), "log": log}
            finally:
                zero_triton.comm.streams.side_stream = original
    return out


def test_gpu_mode_changes_no_bit_and_backward_never_waits():
    for rank, out in enumerate(ranks(_job_side, 3, timeout=300)):
        for name, kwargs in RUNS.items():
            cpu = out[name, None]
            assert cpu["log"]["runs"] == 0
            gpu = out[name, 2]
            assert gpu["log"]["runs"] > 0, f"{name}: the side stream was not used"
            assert (gpu["log"]["landed"] > 0) == ("offload" in kwargs), f"{name}: {gpu['log']}"
            assert_bitwise(gpu, cpu, f"rank {rank}, {name}: GPU mode (events pass 2 launches "
                                     "later) vs CPU mode")
            if kwargs.get("no_sync", True):  # without no_sync a micro-batch waits for its own bucket
                assert gpu["log"]["backward_waits"] == 0, \
                    f"rank {rank}, {name}: backward waited {gpu['log']['backward_waits']} times"
            # One receive buffer per kind is enough: the side stream reuses it in order.
            assert gpu["made"].get("recv", 0) <= 2, f"{name}: {gpu['made']}"
            if kwargs.get("stage") == 2:
                assert gpu["made"]["staging"] <= 4, f"rank {rank}, {name}: {gpu['made']}"
                capped = out[name, 10**9]
                assert_bitwise(capped, cpu, f"rank {rank}, {name}: averages that never pass")
                assert capped["log"]["backward_waits"] > 0, \
                    f"rank {rank}, {name}: past the cap, backward must wait for the oldest average"
                assert capped["made"]["staging"] <= 4, f"rank {rank}, {name}: {capped['made']}"


CUDA_RUNS = ("stage 1", "stage 2, micro-batches")  # short: bench/gpu_check.sh gives its stage 75 s


@packed
def _job_cuda(rank, world_size):
    torch.cuda.set_device(0)  # one GPU: both gloo ranks on it
    original = zero_triton.comm.streams.side_stream
    out = {}
    for name in CUDA_RUNS:
        for side in (True, False):
            if not side:  # the CPU mode on CUDA tensors: gloo's waits block the host
                zero_triton.comm.streams.side_stream = lambda device: None
            try:
                result = train(rank, world_size, device="cuda", **RUNS[name])
            finally:
                zero_triton.comm.streams.side_stream = original
            torch.cuda.synchronize()
            out[name, side] = {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                               for k, v in result.items() if k != "state"}
            out[name, side]["params"] = {n: p.cpu() for n, p in result["params"].items()}
            out[name, side]["state"] = None
    return out


@requires_cuda
def test_cuda_side_stream_equals_waiting_on_the_host():
    """Two gloo ranks on one GPU (NCCL refuses two ranks on one device): the averages
    run on real side streams and events, and change no bit against host waits."""
    for rank, out in enumerate(ranks(_job_cuda, 2, timeout=300)):
        for name in CUDA_RUNS:
            assert_bitwise(out[name, True], out[name, False],
                           f"rank {rank}, {name}: CUDA side stream vs host waits")
