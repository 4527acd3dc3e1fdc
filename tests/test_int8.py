"""moments="int8": the codes (zero_triton.kernels.quant), the kernels against them, the
optimizers with them, their state dicts and checkpoints, and the same parameters at
every world size and bucket size (bitwise)."""
import copy
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.kernels import quant
from zero_triton.native import backends
from zero_triton.state.int8 import BLOCK

from adam_cases import spelled_step
from dist_utils import run_ranks
from lowbit_cases import disagreeing_ranks_job, gpu_backends, held_isa

HAS_CPU = backends.why_not("cpu", torch.device("cpu")) is None
BACKENDS = ["torch"] + (["cpu"] if HAS_CPU else []) + (
    ["triton"] if backends.why_not("triton", torch.device("cpu")) is None else [])


# -- the codes ------------------------------------------------------------------------
def _moments(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8
    v = torch.randn(n, generator=gen) ** 2 * torch.rand(n, generator=gen) ** 20
    return m, v


def _quantized(x, fmt):
    codes = torch.empty(x.numel(), dtype=fmt.dtype)
    scale = torch.empty(quant.blocks(x.numel()))
    quant.quantize(x, fmt, codes, scale)
    return codes, scale


@pytest.mark.parametrize("which", ["first", "second"])
def test_codes_round_trip_and_error_bound(which):
    fmt = quant.FIRST if which == "first" else quant.SECOND
    m, v = _moments(5 * BLOCK + 77)
    x = m if which == "first" else v
    codes, scale = _quantized(x, fmt)
    y = quant.decode(codes, scale, fmt)
    # Within the map's range the relative error is at most half a mantissa step.
    floor = scale.repeat_interleave(BLOCK)[:x.numel()] * 2.0 ** -(fmt.bias - 1)
    inside = x.abs() >= floor
    assert inside.sum() > x.numel() // 4  # the check below is not vacuous
    assert ((y - x).abs()[inside] <= x.abs()[inside] * 2.0 ** -(fmt.man_bits + 1)).all()
    assert torch.equal(scale, quant.block_absmax(x))  # the block's largest decodes exactly
    # Decoding and encoding again is the identity (a torch-format export loads back exactly).
    again = _quantized(y, fmt)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scale)
    assert torch.equal(y[x == 0], x[x == 0])


def test_second_moment_never_rounds_a_positive_value_to_zero():
    v = torch.tensor([1.0] + [1e-30, 1e-12, 0.0] + [0.0] * (BLOCK - 4))
    codes, scale = _quantized(v, quant.SECOND)
    y = quant.decode(codes, scale, quant.SECOND)
    assert (y[:3] > 0).all() and y[3] == 0
    # The first moment's map keeps its sign and lets values far below the block's go to 0.
    m = torch.tensor([-1.0, 0.5, -1e-9] + [0.0] * (BLOCK - 3))
    y = quant.decode(*_quantized(m, quant.FIRST), quant.FIRST)
    assert y[0] == -1.0 and y[1] == 0.5 and y[2] == 0


# -- the kernels ----------------------------------------------------------------------
def _composed_step(fp32_step, p, g, codes_m, codes_v, scales, lp, step, lr, **kw):
    """The definition: decode, the fp32 kernel of the same backend, encode."""
    m = quant.decode(codes_m, scales[:, 0], quant.FIRST)
    v = quant.decode(codes_v, scales[:, 1], quant.SECOND)
    fp32_step(p, g, m, v, None, lp, step, lr, **kw)
    quant.quantize(m, quant.FIRST, codes_m, scales[:, 0])
    quant.quantize(v, quant.SECOND, codes_v, scales[:, 1])


def _against_definition(backend, n, lp_dtype, extras):
    """One step of ``backend``'s int8 kernel against decode + its fp32 kernel + encode."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-2).to(lp_dtype or torch.float32)
    codes_m, scale_m = _quantized(_moments(n)[0] * 1e-3, quant.FIRST)
    codes_v, scale_v = _quantized(_moments(n)[1] * 1e-4, quant.SECOND)
    scales = torch.stack([scale_m, scale_v], dim=1).contiguous()
    lp = torch.zeros(n, dtype=lp_dtype) if lp_dtype else None
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=False,
              maximize=False)
    kw.update({k: v for k, v in extras.items() if k in kw})
    kw.update({k: torch.tensor([v]) for k, v in extras.items() if k not in kw})
    step, lr = torch.tensor([3.0]), torch.tensor([1e-3])
    want = [t.clone() if t is not None else None for t in (p, codes_m, codes_v, scales, lp)]
    _composed_step(spelled_step(backend, "fp32"), want[0], g, want[1], want[2],
                   want[3], want[4], step, lr, **kw)
    got = (p, codes_m, codes_v, scales, lp)
    spelled_step(backend, "int8")(p, g, codes_m, codes_v, scales, lp, step, lr, **kw)
    for name, a, b in zip(("param", "exp_avg codes", "exp_avg_sq codes", "scales", "param_lp"),
                          got, want):
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.skipif(not HAS_CPU, reason="the C++ extension is not available here (see `python -m zero_triton info`)")
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("n,lp_dtype,extras", [
    (BLOCK * 3, None, {}),
    (BLOCK * 7 + 100, torch.bfloat16, {"grad_scale": 4.0, "clip_coef": 0.5}),
    (1000, torch.float16, {"maximize": True, "adamw": False, "weight_decay": 0.01}),
    (70_000, None, {"found_inf": 1.0}),
])
def test_cpu_kernel_is_decode_fp32_step_encode(isa, n, lp_dtype, extras):
    with held_isa(isa):
        _against_definition("cpu", n, lp_dtype, extras)


@pytest.mark.parametrize("n,lp_dtype,extras", [
    (BLOCK * 3, None, {}),
    (BLOCK * 600 + 3, None, {"found_inf": 0.0}),
    (BLOCK * 5 + 100, torch.bfloat16, {"grad_scale": 4.0, "clip_coef": 0.5}),
    (700, torch.float16, {"maximize": True, "adamw": False, "weight_decay": 0.01}),
])
@pytest.mark.skipif(backends.why_not("triton", torch.device("cpu")) is not None,
                    reason="Triton cannot run on CPU tensors here (not installed, or "
                           "TRITON_INTERPRET is not 1)")
def test_triton_kernel_is_decode_fp32_step_encode(n, lp_dtype, extras):
    """Under the interpreter (CPU tensors): bitwise against the Triton fp32 kernel between
    decode and encode."""
    _against_definition("triton", n, lp_dtype, extras)


def test_torch_fallback_matches_the_cpu_kernel_closely():
    """Two implementations of one step (torch's ops round differently: not bitwise)."""
    if not HAS_CPU:
        pytest.skip("the C++ extension is not available here")
    n = BLOCK * 9 + 5
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    out = []
    for name in ("torch", "cpu"):
        pp = p.clone()
        cm, cv = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
        sc = torch.zeros(quant.blocks(n), 2)
        for t in range(1, 6):
            spelled_step(name, "int8")(
                pp, g * t, cm, cv, sc, None, torch.tensor([float(t)]), torch.tensor([1e-2]),
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, amsgrad=False,
                maximize=False)
        out.append(pp)
    assert torch.allclose(out[0], out[1], rtol=0, atol=1e-5)


# -- the optimizers ---------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))


def _train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(96, 32, generator=gen), torch.randint(0, 10, (96,), generator=gen)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_trains_like_fp32_adamw(backend):
    a, b = _model(), _model()
    int8 = zt.FusedAdamW(a.parameters(), lr=3e-3, moments="int8", backend=backend)
    ref = torch.optim.AdamW(b.parameters(), lr=3e-3)
    la, lb = _train(a, int8, 60), _train(b, ref, 60)
    assert la[-1] < 0.5 * la[0]
    assert abs(la[-1] - lb[-1]) <= 0.05 * lb[-1] + 0.01, (la[-1], lb[-1])
    report = int8.memory_report()
    n = int8._shards.groups[0][0].layout.padded_numel  # every parameter padded to a block
    assert report["moments"] == n * (2 + 8 / BLOCK)  # 2 B + a scale pair per block


def test_bf16_parameters_with_int8_moments():
    a = _model().to(torch.bfloat16)
    opt = zt.FusedAdamW(a.parameters(), lr=3e-3, moments="int8")
    x = torch.randn(64, 32).bfloat16()
    y = torch.randint(0, 10, (64,))
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(a(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert set(opt.state_dict()["state"][0]) >= {"exp_avg", "exp_avg_sq", "master_param"}


def test_state_dict_is_torch_format_and_round_trips_bitwise():
    a = _model()
    opt = zt.FusedAdamW(a.parameters(), lr=1e-2, moments="int8")
    _train(a, opt, 5)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    assert sd["state"][0]["exp_avg"].shape == a[0].weight.shape
    flat = opt._shards.groups[0][0]
    before = [t.clone() for t in flat.state.moments.storage()]
    # Into torch.optim.AdamW (dequantized), and back from it (quantized): the same codes.
    b = copy.deepcopy(a)
    torch_opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    torch_opt.load_state_dict(sd)
    c = copy.deepcopy(a)
    again = zt.FusedAdamW(c.parameters(), lr=1e-2, moments="int8")
    again.load_state_dict(torch_opt.state_dict())
    after = again._shards.groups[0][0].state.moments.storage()
    for x, y in zip(before, after):
        assert torch.equal(x, y)
    # Both continue the same way.
    assert _train(a, opt, 3, seed=1) == _train(c, again, 3, seed=1)


def test_switching_formats_both_ways():
    a = _model()
    fp32 = zt.FusedAdamW(a.parameters(), lr=1e-2)
    _train(a, fp32, 4)
    b = copy.deepcopy(a)
    int8 = zt.FusedAdamW(b.parameters(), lr=1e-2, moments="int8")
    int8.load_state_dict(fp32.state_dict())
    m32 = fp32.state_dict()["state"][0]["exp_avg"]
    m8 = int8.state_dict()["state"][0]["exp_avg"]
    assert torch.allclose(m8, m32, rtol=1 / 16, atol=m32.abs().max().item() * 2 ** -14)
    c = copy.deepcopy(b)
    back = zt.FusedAdamW(c.parameters(), lr=1e-2)
    back.load_state_dict(int8.state_dict())
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], m8)


def test_opt_state_edits_reach_the_codes():
    a = _model()
    opt = zt.FusedAdamW(a.parameters(), lr=1e-2, moments="int8")
    _train(a, opt, 2)
    w = a[0].weight
    assert "exp_avg" not in opt.state[w]  # codes are not torch's moments: no views to show
    opt.state[w]["exp_avg"] = torch.zeros_like(w)
    opt.state[w]["exp_avg_sq"] = torch.full_like(w, 1e-6)
    opt.zero_grad()
    opt.step()  # no grads: nothing steps, the edit is taken in
    got = opt.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], torch.zeros_like(w))
    assert torch.equal(got["exp_avg_sq"], torch.full_like(w, 1e-6))
    opt.state.clear()
    assert opt.state_dict()["state"][0]["exp_avg_sq"].abs().max() == 0


@pytest.mark.parametrize("kwargs,dtype,match", [
    ({"amsgrad": True}, torch.float32, "amsgrad"),
    ({"differentiable": True}, torch.float32, "differentiable"),
    ({}, torch.float64, "float64"),
    ({}, torch.complex64, "complex64"),
    ({"moments": "int2"}, torch.float32, "moments must be one of"),
])
def test_refused_before_anything_changes(kwargs, dtype, match):
    p = torch.nn.Parameter(torch.randn(40, 3, dtype=dtype))
    storage = p.data_ptr()
    kwargs = {"moments": "int8", **kwargs}
    with pytest.raises(ValueError, match=match):
        zt.FusedAdamW([p], **kwargs)
    assert p.data_ptr() == storage  # not re-homed into a flat buffer


def test_amsgrad_switched_on_later_is_refused():
    a = _model()
    opt = zt.FusedAdamW(a.parameters(), moments="int8")
    _train(a, opt, 1)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        _train(a, opt, 1)


def test_layout_puts_every_parameter_on_a_block_boundary():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(5,), (300, 7), (3,), (1000,)]]
    opt = zt.FusedAdamW(params, moments="int8")
    layout = opt._shards.groups[0][0].layout
    assert all(o % BLOCK == 0 for o in layout.offsets)


# -- the same numbers at every world size ----------------------------------------------
SHAPES = [(37, 19), (300,), (5,), (64, 33), (1000,)]


def _exact_grads(rank, step):
    """Small multiples of 2^-8: their sums and their means by 2 and 4 are exact, so every
    world size steps the same mean gradient."""
    gen = torch.Generator().manual_seed(step * 100 + rank)
    return [torch.randint(-16, 17, s, generator=gen).float() * 2.0 ** -8 for s in SHAPES]


def _job_int8(rank, world_size, bucket_cap_mb, stage, steps, save_to, load_from):
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = zt.ZeroAdamW(params, lr=1e-2, moments="int8", bucket_cap_mb=bucket_cap_mb, stage=stage)
    if load_from:
        zt.checkpoint.load(load_from, opt)
    first = 0 if not load_from else 3
    for t in range(first, first + steps):
        if world_size == 1:  # the mean of 4 ranks' gradients, fed to one
            per = [_exact_grads(r, t) for r in range(4)]
            grads = [sum(g[i] for g in per) / 4 for i in range(len(SHAPES))]
        else:  # each rank 4 / world_size of the 4 gradients, summed: the same mean
            share = 4 // world_size
            per = [_exact_grads(r, t) for r in range(rank * share, (rank + 1) * share)]
            grads = [sum(g[i] for g in per) / share for i in range(len(SHAPES))]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    if save_to:
        zt.checkpoint.save(save_to, opt)
    sd = opt.state_dict()
    # numpy arrays: pickled by value (a torch tensor would travel by shared memory,
    # gone with this process)
    state = {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()}
    dist.barrier()
    return [p.detach().numpy().copy() for p in params], state


def _int8_result(world_size, bucket_cap_mb=None, stage=1, steps=3, save_to=None, load_from=None):
    return run_ranks(_job_int8, world_size, bucket_cap_mb, stage, steps, save_to, load_from)[0]


def _assert_same(a, b, where):
    (pa, sa), (pb, sb) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(torch.from_numpy(x), torch.from_numpy(y)), f"{where}: parameter {i}"
    assert sa.keys() == sb.keys()
    for k in sa:
        for n in sa[k]:
            assert torch.equal(torch.from_numpy(sa[k][n]), torch.from_numpy(sb[k][n])), \
                f"{where}: state {k} {n}"


def test_int8_is_bitwise_the_same_at_every_world_size_and_bucket_size():
    one = _int8_result(1)
    for world_size, bucket_cap_mb, stage in [(2, None, 1), (2, 0.002, 2), (4, 0.001, 1),
                                             (4, None, 2)]:
        got = _int8_result(world_size, bucket_cap_mb, stage)
        _assert_same(got, one, f"{world_size} ranks, bucket_cap_mb={bucket_cap_mb}, stage {stage}")


def test_int8_checkpoint_saved_at_two_resumes_at_one_and_four_bitwise(tmp_path):
    straight = _int8_result(1, steps=5)
    path = os.fspath(tmp_path / "ckpt")
    _int8_result(2, 0.002, steps=3, save_to=path)
    for world_size in (1, 4):
        resumed = _int8_result(world_size, 0.001 if world_size > 1 else None, steps=2, load_from=path)
        _assert_same(resumed, straight, f"resumed at {world_size}")


# -- torch.distributed.checkpoint ----------------------------------------------------------
def _job_dcp(rank, world_size, path, save):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    gen = torch.Generator().manual_seed(1234)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES])
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-2, moments="int8",
                       bucket_cap_mb=0.002 if world_size == 2 else 0.001)
    steps = range(0, 3) if save else range(3, 5)
    if not save:
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    for t in steps:
        share = 4 // world_size
        per = [_exact_grads(r, t) for r in range(rank * share, (rank + 1) * share)]
        for i, p in enumerate(model):
            p.grad = sum(g[i] for g in per) / share
        opt.step()
        opt.zero_grad()
    if save:
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
    sd = opt.state_dict()
    state = {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()}
    return [p.detach().numpy().copy() for p in model], state


def test_int8_zero_state_reshards_through_dcp_bitwise(tmp_path):
    """ZeroAdamW's sharded int8 state (dequantized in torch's format) saved by DCP at 2
    ranks loads at 4 (other buckets) and continues exactly as one run of 5 steps."""
    path = os.fspath(tmp_path / "dcp")
    run_ranks(_job_dcp, 2, path, True)
    resumed = run_ranks(_job_dcp, 4, path, False)[0]
    _assert_same(resumed, _int8_result(1, steps=5), "DCP 2 -> 4 ranks")


def _job_fsdp2_dcp(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))

    def build():
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, zt.FusedAdamW(model.parameters(), lr=1e-2, moments="int8")
    model, opt = build()
    _train(model, opt, 3, seed=rank)
    saved = get_optimizer_state_dict(model, opt)
    kinds = sorted({type(v).__name__ for e in saved["state"].values() for v in e.values()})
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
    new, new_opt = build()
    _train(new, new_opt, 1, seed=99)  # state of its own first, then overwritten
    sd = {"model": get_model_state_dict(new), "optim": get_optimizer_state_dict(new, new_opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(new, sd["model"])
    set_optimizer_state_dict(new, new_opt, sd["optim"])
    a, b = _train(model, opt, 3, seed=7 + rank), _train(new, new_opt, 3, seed=7 + rank)
    same = all(torch.equal(p.full_tensor(), q.full_tensor())
               for p, q in zip(model.parameters(), new.parameters()))
    return kinds, same, a == b


def test_int8_on_fsdp2_dtensors_resumes_through_dcp_bitwise(tmp_path):
    """FSDP2's DTensor parameters: DCP saves the state as DTensors and a new optimizer
    resumes exactly at the same world size (another world size: tests/test_fsdp2_blocks.py)."""
    pytest.importorskip("torch.distributed.fsdp")
    for kinds, same, losses_same in run_ranks(_job_fsdp2_dcp, 2, os.fspath(tmp_path / "c"),
                                              timeout=300):
        assert "DTensor" in kinds, kinds
        assert same and losses_same


def test_memory_formula_takes_the_moments_format():
    from zero_triton.memory.model import memory_table
    fp32 = memory_table(10**9, 8, "none")
    int8 = memory_table(10**9, 8, "none", moments="int8")
    assert int8["K"] == 2 + 8 / 256 and fp32["K"] == 8
    z1 = {r["stage"]: r for r in int8["stages"]}["zero1"]
    assert z1["optimizer_bytes"] == 2.03125 * 10**9 / 8
    with pytest.raises(ValueError, match="moments must be one of"):
        memory_table(10, 1, moments="int2")


# -- on a GPU (run by bench/gpu_check.sh; skipped here) ----------------------------------
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_low_bit_kernels_on_cuda_match_the_cpu_definition(backend, fmt):
    """Five steps on CUDA tensors against the torch backend on CPU (not bitwise: the GPU
    contracts multiply-adds); and the same run split at a block boundary is bitwise the
    same as in one launch."""
    n = BLOCK * 1000 + 77
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=False,
              maximize=False)

    def state(device):
        if fmt == "int8":
            return (torch.zeros(n, dtype=torch.int8, device=device),
                    torch.zeros(n, dtype=torch.uint8, device=device),
                    torch.zeros(quant.blocks(n), 2, device=device))
        return (torch.zeros(n, dtype=torch.bfloat16, device=device),
                torch.zeros(n, dtype=torch.bfloat16, device=device), None)

    def run(name, device, split=None):
        p, st = p0.clone().to(device), state(device)
        fn = spelled_step(name, fmt)
        for t in range(1, 6):
            step, lr = torch.tensor([float(t)], device=device), torch.tensor([1e-2], device=device)
            cuts = [(0, n)] if split is None else [(0, split), (split, n)]
            for a, b in cuts:
                ops = (st[0][a:b], st[1][a:b],
                       st[2][a // BLOCK:a // BLOCK + quant.blocks(b - a)] if st[2] is not None else None)
                more = {"seed": 3, "index": a} if fmt == "bf16" else {}
                fn(p[a:b], g.to(device)[a:b], *ops, None, step, lr, **kw, **more)
        return p.cpu(), [t.cpu() if t is not None else None for t in st]
    want_p, _ = run("torch", "cpu")
    got_p, got_state = run(backend, "cuda")
    assert torch.allclose(got_p, want_p, rtol=0, atol=5e-4), (got_p - want_p).abs().max()  # lr 1e-2
    split_p, split_state = run(backend, "cuda", split=BLOCK * 400)
    assert torch.equal(split_p, got_p)
    for x, y in zip(split_state, got_state):
        assert (x is None and y is None) or torch.equal(x, y)


def test_ranks_that_disagree_on_the_format_are_refused_on_every_rank():
    for message in run_ranks(disagreeing_ranks_job, 2, torch.float32, {"moments": "int8"},
                             {"moments": "fp32"}):
        assert message is not None and "moments=" in message and "['int8', 'fp32']" in message
