"""Compressed collectives (``zero_triton.comm.compressed``): int8 blocks on the wire for
the gradients' average (``reduce_dtype="int8"``, with error feedback) and the
parameters' all-gather (``gather_dtype="int8"``), flat and under hybrid sharding.

What must hold: every rank's parameters bit for bit the same; the fp32 master exact (the
step reads it, never the dequantized parameter), also when the user writes parameters
(a write of the value our gather left is not a write); error feedback keeps the average
of the averages unbiased; the bytes counted on the wire; bad input refused first."""
from __future__ import annotations

import io
import math

import pytest
import torch

from dist_utils import run_ranks
from zero_triton.comm import compressed as codec


# -- the codec ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 16, 255, 256, 257, 1000, 4096 + 48])
def test_int8_blocks_round_trip_within_half_a_step_of_each_blocks_absmax(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 3, n)[torch.randperm(n, generator=g)]
    if n > 300:
        x[256:512] = 0.0  # an all-zero block: scale 0, codes 0, no NaN
    buf = torch.empty(codec.payload_bytes(n), dtype=torch.uint8)
    codec.quantize(x, buf)
    assert buf.numel() == n + 4 * math.ceil(n / codec.BLOCK)
    y = codec.dequantize(buf, n, torch.empty(n))
    assert torch.isfinite(y).all()
    for b in range(0, n, codec.BLOCK):
        block = x[b:b + codec.BLOCK]
        step = block.abs().max() / 127
        assert (y[b:b + codec.BLOCK] - block).abs().max() <= step / 2 * (1 + 1e-6) + 1e-30
    if n > 300:
        assert (y[256:512] == 0).all()
    assert torch.equal(codec.roundtrip(x), y)
    # bf16 in: read as float32 (its values exact there), out rounded once to bf16
    xb = x.bfloat16()
    buf_b = torch.empty_like(buf)
    scratch = torch.empty(n)
    sent = codec.quantize(xb, buf_b, scratch)
    assert torch.equal(sent, codec.dequantize(buf_b, n, torch.empty(n)))
    assert torch.equal(codec.roundtrip(xb), sent.bfloat16())
    xf = xb.float()
    for b in range(0, n, codec.BLOCK):
        step = xf[b:b + codec.BLOCK].abs().max() / 127
        assert (sent[b:b + codec.BLOCK] - xf[b:b + codec.BLOCK]).abs().max() <= step / 2 * (1 + 1e-6) + 1e-30


# -- the average ---------------------------------------------------------------------------
def _job_average(rank, world, shape, feedback, steps):
    """The same per-rank gradient every step: with error feedback the mean of the
    averages over the steps tends to the exact average; without, one rounding stays."""
    from torch.distributed.device_mesh import init_device_mesh

    from zero_triton.comm.compressed import Int8Comm
    from zero_triton.comm.group import GroupComm
    from zero_triton.comm.hybrid import HybridComm
    wrap = lambda c: Int8Comm(c, reduce="int8", feedback=feedback)  # noqa: E731
    if shape is None:
        comm = wrap(GroupComm())
    else:
        comm = HybridComm(init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")), wrap)
    n = 4 * 1000
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(r)) * torch.logspace(-3, 1, n)
                for r in range(world)) / world
    shard = n // comm.world_size
    mine = exact[comm.rank * shard:(comm.rank + 1) * shard]
    outs = []
    for _ in range(steps):
        out = torch.empty(shard)
        comm.reduce_scatter_avg(out, grad, name="bucket 0")
        outs.append(out)
    first = (outs[0] - mine).abs().max().item()
    mean = (torch.stack(outs).mean(0) - mine).abs().max().item()
    return first, mean, torch.stack(outs).sum().item(), comm.wire


@pytest.mark.parametrize("shape", [None, (2, 2)], ids=["flat", "2x2"])
def test_error_feedback_makes_the_average_of_the_averages_exact(shape):
    steps = 16
    on = run_ranks(_job_average, 4, shape, torch.float32, steps)
    off = run_ranks(_job_average, 4, shape, None, steps)
    for (f_on, mean_on, _, wire), (f_off, mean_off, _, _) in zip(on, off):
        assert f_on == f_off  # the first step has nothing to feed back
        assert 0 < f_off < 0.2  # one int8 rounding (half a step of a block up to ~40)
        assert mean_off > 0.5 * f_off  # without: the same rounding every step
        assert mean_on < f_off / 4, (mean_on, f_off)  # with: it is sent again, and averages out
    if shape == (2, 2):  # replicas hold the same bits (rows 0 and 1 are rank 0's copy)
        assert on[0][2] == on[2][2] and on[1][2] == on[3][2]


# -- the optimizer -----------------------------------------------------------------------
def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 7)).to(dtype)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _job_master(rank, world, kw, shape):
    """Gradients that do not depend on the parameters: the master after the steps is
    the uncompressed gather's, bitwise; every rank's parameters the same."""
    import zero_triton as zt
    model = _model()
    kw = dict(kw, device_mesh=_mesh(shape)) if shape else kw
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.05, **kw)
    for step in range(5):
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    sd = opt.consolidated_state_dict(to_rank=None)
    masters = [sd["state"][i]["master_param"] for i in range(4)]
    params = [p.detach().clone() for p in model.parameters()]
    # each parameter its master to within half a quantization step of its block (and the
    # bf16 rounding of the dequantized value)
    top = max(m.abs().max().item() for m in masters)
    worst = max((p.float() - m).abs().max().item() for p, m in zip(params, masters))
    assert worst <= top * (1 / 254 + 1 / 256), (worst, top)
    buf = io.BytesIO()
    torch.save((masters, params), buf)
    return buf.getvalue()


def _load(b):
    return torch.load(io.BytesIO(b))


@pytest.mark.parametrize("shape", [None, (2, 2)], ids=["flat", "2x2"])
def test_int8_gathers_keep_the_master_exact_and_every_ranks_parameters_the_same(shape):
    plain = [_load(b) for b in run_ranks(_job_master, 4, {}, shape)]
    packed = [_load(b) for b in run_ranks(_job_master, 4, {"gather_dtype": "int8"}, shape)]
    for r in range(4):
        for m, q in zip(packed[r][0], plain[0][0]):
            assert torch.equal(m, q)  # the master never saw a dequantized parameter
        for p, q in zip(packed[r][1], packed[0][1]):
            assert torch.equal(p, q)  # every rank holds the same parameters
    differ = sum((p != q).sum().item() for p, q in zip(packed[0][1], plain[0][1]))
    assert differ > 0  # the parameters are the gather's dequantized values


def _job_writes(rank, world, shape):
    """Writes of the values our gather left (an EMA swapped in and back, DDP's
    broadcast) keep the master; a real write takes the written value; state_dict() on
    one rank sees the same."""
    import torch.distributed as dist

    import zero_triton as zt
    model = _model()
    kw = {"device_mesh": _mesh(shape)} if shape else {}
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-2, gather_dtype="int8", reduce_dtype="int8", **kw)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank)).bfloat16()
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = opt.consolidated_state_dict(to_rank=None)
    with torch.no_grad():  # an EMA swapped in for evaluation, and the weights swapped back
        saved = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.mul_(0.5)
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    one = opt.state_dict() if rank == 0 else None  # on one rank: the shard servers answer
    dist.barrier()
    after = opt.consolidated_state_dict(to_rank=None)  # the agreed entry re-seeds
    with torch.no_grad():
        model[0].weight[0, :5] = 3.0
    written = opt.consolidated_state_dict(to_rank=None)
    pick = lambda sd: [sd["state"][i]["master_param"] for i in range(4)]  # noqa: E731
    buf = io.BytesIO()
    torch.save((pick(before), pick(after), None if one is None else pick(one), pick(written)), buf)
    return buf.getvalue()


@pytest.mark.parametrize("shape", [None, (2, 2)], ids=["flat", "2x2"])
def test_a_write_of_what_the_gather_left_keeps_the_master(shape):
    for r, blob in enumerate(run_ranks(_job_writes, 4, shape)):
        before, after, one, written = _load(blob)
        for a, b in zip(before, after):
            assert torch.equal(a, b), f"rank {r}: the swap-back re-seeded the master"
        if one is not None:
            for a, b in zip(before, one):
                assert torch.equal(a, b), "state_dict() on one rank re-seeded the master"
        w = written[0]
        assert (w[0, :5] == 3.0).all()  # a real write is taken
        assert torch.equal(w[1:], before[0][1:]) and torch.equal(w[0, 5:], before[0][0, 5:])


def _job_bytes(rank, world, dtype, kw):
    import zero_triton as zt
    model = _model(dtype)
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=0.05, **kw)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank)).to(dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    from zero_triton.optim.interface import internals
    comm = internals(opt).comm
    comm.reset_wire()
    model(x).float().square().mean().backward()
    opt.step()
    held = opt.memory_report()["comm"]
    if kw.get("reduce_dtype") == "int8":  # error feedback: bf16 of every local gradient
        assert held == 2 * sum(f.layout.padded_numel for _, f in internals(opt).shards()), held
    else:
        assert held == 0
    return sum(v for k, v in comm.wire.items() if "reduce_scatter" in k or "all_gather" in k)


def test_int8_collectives_send_under_a_third_of_fp32s_bytes_and_about_half_of_bf16s():
    fp32 = run_ranks(_job_bytes, 4, torch.float32, {})[0]
    bf16 = run_ranks(_job_bytes, 4, torch.bfloat16, {})[0]
    int8 = run_ranks(_job_bytes, 4, torch.bfloat16, {"gather_dtype": "int8", "reduce_dtype": "int8"})[0]
    assert int8 <= 0.3 * fp32 and int8 <= 0.55 * bf16, (int8, bf16, fp32)
    assert int8 >= 0.25 * fp32  # 1 byte and a scale per 256 of 4: nothing left out of the count


# -- bad input ---------------------------------------------------------------------------
def _job_refusals(rank, world):
    import zero_triton as zt

    def said(model_dtype, **kw):
        model = _model(model_dtype)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            zt.ZeroAdamW(model.parameters(), **kw)
        except (ValueError, TypeError) as exc:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            return str(exc)
        return None

    return {
        "fp32 gather": said(torch.float32, gather_dtype="int8"),
        "fp64 gather": said(torch.float64, gather_dtype="int8"),
        "fp64 reduce": said(torch.float64, reduce_dtype="int8"),
        "stochastic gather": said(torch.bfloat16, gather_dtype="int8", master_weights="stochastic"),
        "remainder gather": said(torch.bfloat16, gather_dtype="int8", master_weights="remainder"),
        "differentiable": said(torch.float32, reduce_dtype="int8", differentiable=True),
        "feedback alone": said(torch.float32, error_feedback=False),
        "bad gather": said(torch.bfloat16, gather_dtype="int4"),
        "bad reduce": said(torch.bfloat16, reduce_dtype="int4"),
        "bad feedback": said(torch.bfloat16, reduce_dtype="int8", error_feedback=torch.float16),
    }


def test_bad_compression_arguments_are_refused_with_the_fix():
    said = run_ranks(_job_refusals, 2)[0]
    assert "train in bf16" in said["fp32 gather"] and "its own master" in said["fp32 gather"]
    assert "torch.float64" in said["fp64 gather"]
    assert "reduce_dtype=None" in said["fp64 reduce"]
    assert "master_weights=None" in said["stochastic gather"]
    assert "master_weights=None" in said["remainder gather"]
    assert "differentiable=True" in said["differentiable"]
    assert "reduce_dtype='int8'" in said["feedback alone"]
    assert "'int8'" in said["bad gather"] and "'int8'" in said["bad reduce"]
    assert "error_feedback must be" in said["bad feedback"]


def _job_resume(rank, world, path, shape):
    """A checkpoint saved under int8 gathers and averages (error feedback off: its
    buffers are per rank and not saved) resumes bit for bit: the load's published
    master goes through what the gather writes, as the other ranks' shards in the
    model file did."""
    import zero_triton as zt
    model = _model()
    kw = {"device_mesh": _mesh(shape)} if shape else {}
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-2, gather_dtype="int8", reduce_dtype="int8",
                       error_feedback=False, stage=2, bucket_cap_mb=0.05, **kw)

    def run(steps, start):
        for s in range(start, start + steps):
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(10 * s + rank)).bfloat16()
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    run(3, 0)
    zt.checkpoint.save(path, opt, model)
    run(2, 3)
    straight = [p.detach().clone() for p in model.parameters()]
    zt.checkpoint.load(path, opt, model)
    run(2, 3)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), straight))


@pytest.mark.parametrize("shape", [None, (2, 2)], ids=["flat", "2x2"])
def test_a_checkpoint_under_int8_collectives_resumes_bit_for_bit(tmp_path, shape):
    assert all(run_ranks(_job_resume, 4, str(tmp_path / "ckpt"), shape))
