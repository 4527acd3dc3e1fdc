"""master_weights="remainder8": bf16 parameters and 8 more bits of their master beside
them (int8), a 24-bit master. Every (parameter, remainder) pair is one master and splits
back to itself; each kernel, with each moments format, is its backend's fp32-master step
of that master rounded to 24 bits and split; the optimizers hold it bit for bit at every
world size, bucket size and stage, through checkpoints, DCP, state dicts and FSDP2; it
stays within 2**-16 of the exact master per step; refusals name the fix."""
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.kernels import quant, remainder
from zero_triton.memory.model import memory_table

from adam_cases import spelled_step
from dist_utils import run_ranks
from lowbit_cases import assert_refused, assert_same, gpu_backends, moment_operands
from test_remainder import (KERNELS, KW, SPECIAL, _floats, _job, _job_fsdp2, _job_masters,
                            _masters, _train, kernel)  # noqa: F401 (kernel: a fixture)

INT8 = torch.int8


def test_every_pair_is_one_master_that_splits_back_to_it():
    """All 2**16 parameters with the edge remainders and random ones: join then split
    gives the pair back, and the master is a 24-bit number, wherever the pair makes a
    finite master (a +-0 parameter with a rounded-up remainder makes none, as with the
    int16 remainder)."""
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    edges = torch.tensor([-128, -127, -64, -1, 0, 1, 64, 126, 127], dtype=INT8)
    rs = torch.cat([edges, torch.randint(-128, 128, (7,), generator=torch.Generator().manual_seed(0),
                                         dtype=INT8)])
    rr, p = rs.repeat_interleave(every.numel()), every.repeat(rs.numel())
    m = remainder.join(p, rr)
    finite_p = torch.isfinite(p.float())
    ok = torch.isfinite(m) & finite_p
    back, again = remainder.split(m, INT8)
    assert torch.equal(back.view(torch.int16)[ok], p.view(torch.int16)[ok])
    assert torch.equal(again[ok], rr[ok])
    assert not (m[ok].view(torch.int32) & 0xFF).any()
    assert torch.equal(remainder.consistent(p, rr)[ok], rr[ok])
    lost = finite_p & ~ok  # +-0 with each negative remainder tried
    assert (p[lost] == 0).all() and (rr[lost] < 0).all()
    assert int(lost.sum()) == 2 * int((rs < 0).sum())


def test_the_master_is_the_value_rounded_to_24_bits():
    x = _floats(1 << 20)
    p, r = remainder.split(x, INT8)
    m = remainder.join(p, r)
    nan = torch.isnan(x)
    assert torch.equal(m[~nan].view(torch.int32), remainder.round24(x)[~nan].view(torch.int32))
    assert torch.isnan(m[nan]).all() and torch.isnan(p[nan]).all()
    normal = torch.isfinite(x) & (x.abs() > 1e-37) & (x.abs() < 3e38)
    rel = ((m - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -16
    # to nearest, ties to even: the error is at most half the 24-bit step, and a tie goes
    # to the even one
    low = x.view(torch.int32).to(torch.int64) & 0xFF
    kept = m.view(torch.int32).to(torch.int64) >> 8 & 1
    tie = (low == 0x80) & normal
    assert tie.any() and not kept[tie].any()
    # the parameter is the 24-bit master rounded to nearest (ties away): the exact
    # remainder's parameter of that master
    assert torch.equal(p.view(torch.int16)[~nan], remainder.split(m)[0].view(torch.int16)[~nan])


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_each_kernel_is_the_fp32_master_step_rounded_to_24_bits(kernel, fmt):
    backend, n = kernel, 70_000
    master = _floats(n - len(SPECIAL), seed=3)
    master = torch.where(torch.isfinite(master), master.clamp(-4, 4), master)[:n]
    master[:64] = torch.randn(64)
    master = remainder.round24(master)  # a 24-bit master to start from
    g = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2).bfloat16()
    step, lr = torch.tensor([5.0]), torch.tensor([1e-3])
    ops = moment_operands(fmt, n)
    want_ops = [o.clone() if o is not None else None for o in ops]
    keyed = {"seed": 7, "index": 3} if fmt == "bf16" else {}
    want = master.clone()
    spelled_step(backend, fmt)(want, g, *want_ops, None, step, lr, **KW, **keyed)
    p, r = remainder.split(master, INT8)
    spelled_step(backend, fmt)(p, g, *ops, None, step, lr, **KW, **keyed, remainder=r)
    nan = torch.isnan(want)
    got = remainder.join(p, r)
    assert torch.equal(got[~nan].view(torch.int32), remainder.round24(want)[~nan].view(torch.int32))
    assert torch.isnan(got[nan]).all()
    assert torch.equal(p.view(torch.int16)[~nan], remainder.split(want, INT8)[0].view(torch.int16)[~nan])
    for a, b in zip(ops, want_ops):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_one_byte_per_parameter_within_a_few_24_bit_steps_of_the_exact_master(moments):
    """Six steps at lr 1e-2 on each backend: the master stays within six 24-bit roundings
    of the exact one of the same backend (each at most 2**-16 of the weight it rounds,
    which is within 6 lr of the last one: the gradients do not depend on the weights),
    and the memory report counts one byte per element."""
    for backend in ("cpu", "torch"):
        params, opt = _train("remainder8", moments, backend=backend)
        _, exact = _train(None, moments, backend=backend)
        got, want = _masters(opt), _masters(exact)
        assert ((got - want).abs() <= (want.abs() + 6 * 1e-2) * 6 * 2.0 ** -16).all(), backend
        assert not torch.equal(got, want) and not (got.view(torch.int32) & 0xFF).any()
    n = sum(p.numel() for p in params)
    layout = opt._shards.groups[0][0].layout
    assert opt.memory_report()["master"] == n + layout.padding
    assert exact.memory_report()["master"] == 4 * (n + layout.padding)
    table = memory_table(10 ** 9, 1, "remainder8", moments)
    assert table["K"] == (1 + 8 if moments == "fp32" else 1 + 2 + 8 / 256)


def test_state_dicts_move_between_the_formats_and_resume_bit_for_bit():
    """remainder8 -> remainder8 resumes exactly; its 24-bit masters load into the exact
    formats unchanged (they are fp32 values); an exact master loads into remainder8
    rounded to 24 bits, as a step would leave it."""
    _, straight = _train("remainder8", steps=6)
    for first in ("remainder8", "remainder", None):
        params, opt = _train(first, steps=3)
        sd = opt.state_dict()
        again = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = zt.FusedAdamW(again, lr=1e-2, weight_decay=0.1, master_weights="remainder8")
        other.load_state_dict(sd)
        loaded = _masters(other)
        assert torch.equal(loaded.view(torch.int32), remainder.round24(_masters(opt)).view(torch.int32))
        if first == "remainder8":
            for t in range(3, 6):
                gen = torch.Generator().manual_seed(t)
                for p in again:
                    p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
                other.step()
            assert torch.equal(_masters(other).view(torch.int32), _masters(straight).view(torch.int32))
            into_exact = zt.FusedAdamW([torch.nn.Parameter(p.detach().clone()) for p in params],
                                       lr=1e-2, master_weights="remainder")
            into_exact.load_state_dict(sd)
            assert torch.equal(_masters(into_exact).view(torch.int32), _masters(opt).view(torch.int32))


def test_a_parameter_written_with_its_own_value_keeps_its_master():
    saved = {}

    def write(t, params):
        with torch.no_grad():
            if t == 2:
                saved["w"] = [p.detach().clone() for p in params]
                for p in params:
                    p.zero_()
                for p, w in zip(params, saved["w"]):
                    p.copy_(w)
    _, a = _train("remainder8")
    _, b = _train("remainder8", write=write)
    assert torch.equal(_masters(a).view(torch.int32), _masters(b).view(torch.int32))


@pytest.mark.parametrize("kwargs,dtype,match", [
    ({"master_weights": "remainder8"}, torch.float32, "their own master"),
    ({"master_weights": "remainder8"}, torch.float16, "bfloat16 only"),
    ({"master_weights": "remainder8", "differentiable": True}, torch.bfloat16, "differentiable"),
    ({"master_weights": "remainder9"}, torch.bfloat16, "'remainder8' \\(8 more bits"),
])
def test_refused_before_anything_changes(kwargs, dtype, match):
    assert_refused(kwargs, dtype, match)


def test_bitwise_at_each_world_size_stage_and_bucket_size_and_through_a_checkpoint(tmp_path):
    """ZeroAdamW at 1 and 2 ranks (stage 2, many buckets) steps the same masters and
    parameters; a checkpoint saved at 2 ranks (stage 1) resumes at 4 as the straight run
    (``mean_grads``: the same mean gradient at world sizes that divide 4)."""
    one = run_ranks(_job, 1, None, 1, "remainder8", "int8", 5, None, None)[0]
    assert_same(run_ranks(_job, 2, 0.002, 2, "remainder8", "int8", 5, None, None)[0], one, "2 ranks")
    path = os.fspath(tmp_path / "ckpt")
    run_ranks(_job, 2, 0.002, 1, "remainder8", "int8", 3, path, None)
    assert_same(run_ranks(_job, 4, 0.001, 1, "remainder8", "int8", 2, None, path)[0], one,
                "saved at 2, resumed at 4")
    assert not (_job_masters(one) & 0xFF).any()  # 24-bit masters in the state dict


def test_fsdp2_dtensor_parameters_step_the_same_masters_at_one_and_two_ranks():
    pytest.importorskip("torch.distributed.fsdp")
    one = run_ranks(_job_fsdp2, 1, "remainder8", timeout=300)[0]
    two = run_ranks(_job_fsdp2, 2, "remainder8", timeout=300)[0]
    for a, b in zip(one, two):
        assert (a == b).all() and not (a & 0xFF).any()


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_remainder8_kernels_on_cuda_are_their_fp32_master_step_rounded_to_24_bits(backend, fmt):
    """Five steps on CUDA tensors: the fused int8-remainder step of a backend is bitwise
    that backend's fp32-master step with the master rounded to 24 bits after each; a run
    split at a block boundary is bitwise one launch."""
    n = quant.BLOCK * 400 + 9

    def run(mode, split=None):
        gen = torch.Generator().manual_seed(0)
        master = remainder.round24(torch.randn(n, generator=gen)).cuda()
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16().cuda()
        ops = [o.cuda() if o is not None else None for o in moment_operands(fmt, n)]
        p, r = remainder.split(master, INT8)
        fn = spelled_step(backend, fmt)
        for t in range(1, 6):
            step, lr = torch.tensor([float(t)], device="cuda"), torch.tensor([1e-2], device="cuda")
            for a, b in ([(0, n)] if split is None else [(0, split), (split, n)]):
                sub = (ops[0][a:b], ops[1][a:b],
                       None if ops[2] is None else ops[2][a // quant.BLOCK:a // quant.BLOCK + quant.blocks(b - a)])
                keyed = {"seed": 5, "index": a} if fmt == "bf16" else {}
                if mode == "remainder8":
                    fn(p[a:b], g[a:b], *sub, None, step, lr, **KW, **keyed, remainder=r[a:b])
                else:
                    fn(master[a:b], g[a:b], *sub, None, step, lr, **KW, **keyed)
            if mode != "remainder8":
                master.copy_(remainder.round24(master))
        return (remainder.join(p, r) if mode == "remainder8" else master).cpu()
    got = run("remainder8")
    assert torch.equal(got.view(torch.int32), run("master").view(torch.int32))
    assert torch.equal(run("remainder8", split=quant.BLOCK * 100).view(torch.int32), got.view(torch.int32))
