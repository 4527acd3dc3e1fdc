"""What the gradients cost per rank (zero_triton.comm.buckets): bucket sizes, ZeRO-2's
staging buffers, and the gradient a one-parameter bucket takes as it is.

- ``bucket_numel``: ``bucket_cap_mb`` at most, a flat buffer cut into MIN_BUCKETS or more
  where each keeps MIN_BUCKET_BYTES;
- ZeRO-2 takes the gradient autograd made for a bucket of one parameter as its staging
  buffer (no copy, no buffer the size of the embedding) where the bucket has no padding
  (its size divides into the ranks' aligned shards: 2048 x 64 at 2 ranks; at 3 it is
  padded and staged); a second gradient before the
  launch (micro-batches averaged at ``step`` only) moves it to a staging buffer, never
  writing the taken one; the results equal stage 1's (bitwise for one backward per step);
- the receive and staging buffers are made at the size each bucket needs, so after
  backward they stay within the limit's worth of ordinary buckets plus the large
  parameters' own gradients, whatever the largest bucket is.
"""
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from test_overlap import packed, ranks  # noqa: E402

from zero_triton import ZeroAdamW  # noqa: E402
from zero_triton.comm import buckets  # noqa: E402

MiB = 2**20


def test_bucket_numel_caps_and_cuts():
    f32, bf16 = torch.float32, torch.bfloat16
    # a large buffer: the cap
    assert buckets.bucket_numel(25, f32, 10**9) == 25 * MiB // 4
    # a mid-size one (40 MiB of fp32): eight buckets of 5 MiB
    assert buckets.bucket_numel(25, f32, 10 * MiB) == 10 * MiB // 8
    # a small one: never under MIN_BUCKET_BYTES
    assert buckets.bucket_numel(25, f32, 1000) == buckets.MIN_BUCKET_BYTES // 4
    assert buckets.bucket_numel(25, bf16, 1000) == buckets.MIN_BUCKET_BYTES // 2
    # a cap below the floor is the user's: kept
    assert buckets.bucket_numel(0.001, f32, 10**9) == int(0.001 * MiB) // 4


class Wide(nn.Module):
    """An embedding far larger than the rest (the shape of a language model's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(2048, 64)                       # 0.5 MiB
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16 KiB each
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(self.body(self.emb(x)).mean(1))


def _train(rank, world_size, stage, cap, accumulate=1, steps=3):
    model = Wide()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=cap, backend="torch")
    after_backward = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 2048, (8 * accumulate, 4), generator=g)
        y = torch.randn(8 * accumulate, 16, generator=g)
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            nn.functional.mse_loss(model(xs), ys).backward()
        after_backward.append(opt.memory_report()["buckets"])
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "counts": dict(opt._reducer.staging.counts), "buckets_after_backward": after_backward,
            "largest": max(b.geometry.numel for b in opt._reducer.buckets),
            "nbuckets": len(opt._reducer.buckets)}


@packed
def _job(rank, world_size):
    small = 0.02  # MiB: the embedding gets a bucket of its own, the linears share some
    return {"s1": _train(rank, world_size, 1, small), "s2": _train(rank, world_size, 2, small),
            "s1_acc": _train(rank, world_size, 1, None, accumulate=3),
            "s2_acc": _train(rank, world_size, 2, None, accumulate=3)}


def test_stage2_takes_one_parameter_gradients_and_matches_stage1():
    for rank, out in enumerate(ranks(_job, 2, timeout=240)):
        s1, s2 = out["s1"], out["s2"]
        assert s2["counts"]["adopted"] > 0, s2["counts"]
        assert s2["counts"]["restaged"] == 0, s2["counts"]
        for n, p in s1["params"].items():
            assert torch.equal(s2["params"][n], p), f"rank {rank}: {n}, stage 2 vs stage 1"
        # The embedding's bucket is the largest; its gradient is taken, not staged, so the
        # buffers held after backward stay below two copies of it plus its scratch.
        emb = s2["largest"] * 4
        assert max(s2["buckets_after_backward"]) < 2 * emb, (s2["buckets_after_backward"], emb)
        # One bucket per flat buffer (None): the Wide model's holds many parameters, so
        # nothing is taken there; the micro-batches' averages add up to stage 1's average.
        acc1, acc2 = out["s1_acc"], out["s2_acc"]
        assert acc2["nbuckets"] == 1 and acc2["counts"]["adopted"] == 0, acc2
        for n, p in acc1["params"].items():
            torch.testing.assert_close(acc2["params"][n], p, rtol=1e-4, atol=1e-5,
                                       msg=f"rank {rank}: {n}, stage 2 micro-batches vs stage 1")


class One(nn.Module):
    """One parameter: its flat buffer is one bucket of one parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = nn.Parameter(torch.randn(24, 32))  # 768 elements: no padding at 2 or 3 ranks

    def forward(self, x):
        return x @ self.w


@packed
def _job_restage(rank, world_size):
    out = {}
    for stage in (1, 2):
        model = One()
        opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=None,
                        backend="torch")
        unchanged = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            taken = []
            for k in range(3):  # averaged at step() only: the second gradient finds the first
                x = torch.randn(4, 24, generator=g)
                model(x).square().mean().backward()
                if stage == 2 and k == 0:
                    taken = [(b.grad_in, b.grad_in.clone()) for b in opt._reducer.buckets if b.staged and b.staged.adopted]
            unchanged.extend(torch.equal(t, before) for t, before in taken)
            opt.step()
            opt.zero_grad()
        out[stage] = {"w": model.w.detach().clone(), "counts": dict(opt._reducer.staging.counts),
                      "unchanged": unchanged}
    return out


def test_a_taken_gradient_is_never_written():
    """With averages at step() only, micro-batch 2 finds micro-batch 1's gradient taken:
    it moves to a staging buffer and the sum is stage 1's."""
    for rank, out in enumerate(ranks(_job_restage, 2, timeout=120)):
        counts = out[2]["counts"]
        assert counts["adopted"] == 3 and counts["restaged"] == 3, counts
        assert out[2]["unchanged"] == [True] * 3, out[2]["unchanged"]
        torch.testing.assert_close(out[2]["w"], out[1]["w"], rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank}: stage 2 vs stage 1")
