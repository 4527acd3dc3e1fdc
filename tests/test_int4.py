"""moments="int4" (zero_triton.state.int4, zero_triton.kernels.quant4): 4-bit codes, two
to a byte; the same bits on every backend and at every world size, state dicts (torch's
and compact) and checkpoints that load back bit for bit, gradient release over them."""
import pytest
import torch

import zero_triton as zt
from conftest import interpreter_on
from dist_utils import run_ranks
from lowbit_cases import assert_refused, assert_same, bf16_zero_job, gpu_backends
from zero_triton.kernels import quant, quant4


@pytest.mark.parametrize("fmt", [quant4.FIRST, quant4.SECOND], ids=["first", "second"])
@pytest.mark.parametrize("n", [1, 127, 128, 301])
def test_codes_pack_and_decode_back_to_themselves(fmt, n):
    """Packing keeps every code (odd lengths too); decoding and encoding again gives the
    same codes and scales; the block's largest decodes to its scale; the second moment
    keeps a positive value positive."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)
    if not fmt.signed:
        x = x.abs()
    packed = torch.zeros(quant4.packed(n), dtype=torch.uint8)
    scales = torch.zeros(quant4.blocks(n))
    quant4.quantize(x, fmt, packed, scales)
    codes = quant.encode(x, scales, fmt, quant4.BLOCK)
    assert torch.equal(quant4.unpack(packed, n, fmt), codes)
    y = quant4.decode(packed, n, scales, fmt)
    again, scales2 = torch.zeros_like(packed), torch.zeros_like(scales)
    quant4.quantize(y, fmt, again, scales2)
    assert torch.equal(again, packed) and torch.equal(scales2, scales)
    assert torch.equal(y.abs().view(-1)[x.abs().argmax()], scales[x.abs().argmax() // quant4.BLOCK])
    if not fmt.signed:
        assert bool((y[x > 0] > 0).all())
    if n % 2:
        assert packed[-1] >> 4 == 0  # the padding element's nibble


def test_second_moment_rounded_stochastically_keeps_its_mean_and_its_codes():
    """In a step the second moment and its scales round stochastically: over many steps'
    bits the mean of the decoded value is the value (a moment that moves by 0.1% a step
    moves), codes already on the grid stay under any bits (a skipped step, a reload), the
    block's largest takes the top code, a positive value stays positive, and a run cut
    anywhere on a block boundary draws the bits the whole run would."""
    n = 301
    x = torch.rand(n, generator=torch.Generator().manual_seed(0)) ** 6
    x[7] = 0.0
    packed = torch.zeros(quant4.packed(n), dtype=torch.uint8)
    scales = torch.zeros(quant4.blocks(n), dtype=torch.bfloat16)
    total = torch.zeros(n)
    for t in range(1, 301):
        quant4.quantize_stochastic(x, packed, scales, quant4.step_keys(torch.tensor([float(t)]), 3), 256)
        y = quant4.decode(packed, n, scales, quant4.SECOND)
        total += y
        assert bool((y[x > 0] > 0).all()) and y[7] == 0
        again, scales2 = torch.zeros_like(packed), torch.zeros_like(scales)
        quant4.quantize_stochastic(y, again, scales2, quant4.step_keys(torch.tensor([t + 1.0]), 5), 256)
        assert torch.equal(again, packed) and torch.equal(scales2, scales)
    big = x > 0.05 * x.max()
    assert abs(float((total[big] / 300 / x[big]).mean()) - 1) < 0.01
    quant4.quantize_stochastic(x, packed, scales, (11, 12), 0)
    y = quant4.decode(packed, n, scales, quant4.SECOND)
    for b in range(quant4.blocks(n)):
        part = slice(b * quant4.BLOCK, (b + 1) * quant4.BLOCK)
        assert y[part].max() == y[part][x[part].argmax()] == scales[b].float()
    head, tail = torch.zeros(64, dtype=torch.uint8), torch.zeros(quant4.packed(n - 128), dtype=torch.uint8)
    s_head, s_tail = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    quant4.quantize_stochastic(x[:128], head, s_head, (11, 12), 0)
    quant4.quantize_stochastic(x[128:], tail, s_tail, (11, 12), 128)
    assert torch.equal(torch.cat([head, tail]), packed) and torch.equal(torch.cat([s_head, s_tail]), scales)


def _train(backend, steps=3, moments="int4", between=None, device="cpu", **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.GELU(),
                                torch.nn.Linear(129, 5)).to(device, torch.bfloat16)
    opt = zt.FusedAdamW(model.parameters(), lr=1e-2, backend=backend, moments=moments,
                        master_weights="remainder8", **kw)
    for t in range(steps):
        x = torch.randn(4, 37, generator=torch.Generator().manual_seed(t)).to(device, torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(opt)
    return model, opt


def _moments(opt):
    return [t for _, s in opt._shards.listed(opt.param_groups) for t in s.state.moments.storage()]


def _assert_same_run(model, opt, other_model, other):
    """Two trainings ended with the same parameters and moments, bit for bit."""
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other_model.parameters()))
    mine, theirs = opt.state_dict()["state"], other.state_dict()["state"]
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in ("exp_avg", "exp_avg_sq"))


def _held_in_4_bits(int4_opt):
    """A ``between`` that holds fp32 moments as ``int4_opt``'s store does: each parameter's
    blocks (from its first element, as the store's layout puts them) encoded and decoded,
    exp_avg to nearest, exp_avg_sq stochastically by the bits of the step and of each
    element's canonical index in ``int4_opt``'s layout."""
    (_, shard), = int4_opt._shards.listed(int4_opt.param_groups)
    home = shard.home
    starts = home.layout.offsets  # one rank: the flat buffer is the canonical layout

    def hold(opt):
        for i, entry in enumerate(opt.state.values()):
            for key, fmt in (("exp_avg", quant4.FIRST), ("exp_avg_sq", quant4.SECOND)):
                x = entry[key].view(-1)
                packed = torch.zeros(quant4.packed(x.numel()), dtype=torch.uint8, device=x.device)
                scales = torch.zeros(quant4.blocks(x.numel()), dtype=torch.bfloat16, device=x.device)
                if fmt is quant4.FIRST:
                    quant4.quantize(x, fmt, packed, scales)
                else:
                    step = entry["step"].to(x.device, torch.float32).view(1)
                    quant4.quantize_stochastic(x, packed, scales, quant4.step_keys(step, home.seed),
                                               starts[i])
                x.copy_(quant4.decode(packed, x.numel(), scales, fmt))
    return hold


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_each_backend_steps_its_fp32_step_held_in_4_bits(backend):
    """int4 on a backend is that backend's float32 step with the moments rounded to their
    4-bit codes between steps: the same parameters and moments, bit for bit; and released
    in backward, the same again."""
    if backend == "triton" and not interpreter_on():
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
    model, opt = _train(backend)
    ref_model, ref = _train(backend, moments="fp32", between=_held_in_4_bits(opt))
    _assert_same_run(model, opt, ref_model, ref)
    released_model, released = _train(backend, grad_release=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), released_model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(_moments(opt), _moments(released)))
    n = sum(p.numel() for p in model.parameters())
    assert opt.memory_report()["moments"] < 1.2 * n  # 1.03 B/param, and the blocks' padding


@pytest.mark.parametrize("compact", [False, True])
def test_state_dicts_and_checkpoints_load_back_bit_for_bit(tmp_path, compact):
    model, opt = _train("cpu")
    sd = opt.state_dict(compact=compact)
    if compact:
        assert sd["compact"]["moments"] == "int4" and "exp_avg_codes4" in sd["state"][0]
    other_model, other = _train("cpu", steps=1)
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(_moments(opt), _moments(other)))
    zt.checkpoint.save(str(tmp_path), opt, model=model, compact=compact)
    zt.checkpoint.load(str(tmp_path), other, model=other_model)
    assert all(torch.equal(a, b) for a, b in zip(_moments(opt), _moments(other)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other_model.parameters()))


def test_the_same_bits_at_every_world_size_and_bucket_size():
    one = run_ranks(bf16_zero_job, 1, None, 1, "remainder8", "int4", 3, None, None)[0]
    for world_size, cap, stage in [(2, 0.002, 2), (4, None, 1)]:
        got = run_ranks(bf16_zero_job, world_size, cap, stage, "remainder8", "int4", 3, None, None)[0]
        assert_same(got, one, f"{world_size} ranks, bucket_cap_mb={cap}, stage {stage}")


def _rank_tensor_parallel(rank, world, root):
    import io
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tp_layouts as bench
    import zero_triton
    trained = bench._train(rank, world, ["dp4", "2x2", "1x4"], ["int4"], 2, root)
    loaded = bench._load(rank, world, ["1x4"], ["2x2"], ["int4"], ["compact"], 2, root)
    net = bench.build("1x4", torch.float32)
    opt = bench._optimizer(net, "int4")
    with zero_triton.compact_state_dicts(opt):
        keys = sorted(opt.state_dict()["state"][next(
            i for i, (name, _) in enumerate(net.named_parameters()) if name == "side.weight")])
    if rank:
        return None
    same = [bench.compare(*(torch.load(io.BytesIO(trained[lay, "int4"]))[w] for lay in ("dp4", other)))
            for w in (0, 1) for other in ("2x2", "1x4")]
    got = loaded["1x4", "int4", "2x2", "compact"]
    assert not isinstance(got, str), got
    got = torch.load(io.BytesIO(got))
    want = [torch.load(io.BytesIO(trained["2x2", "int4"]))[w] for w in (0, 1)]
    return same + [bench.compare(a, b) for a, b in zip(want, got)], keys


def test_tensor_parallel_and_fsdp2_layouts_step_and_load_the_same_bits(tmp_path):
    """DTensor parameters keep int4 blocks of 128 of their rows (``bench/tp_layouts.py``'s
    model: a RowwiseParallel weight whose rows of 384 are cut into 96 at tp=4, so ranks
    share its blocks and agree on their scales; another cut into whole blocks; FSDP2's
    strided and empty shards): 2x2 and 1x4 train to the bits of dp4 (FSDP2 alone: whole
    rows, stepped by the kernel), and 2x2's compact DCP checkpoint loads at 1x4 as saved
    and steps on as 2x2 does. The shared weight's compact entry is 4-bit codes."""
    results, keys = run_ranks(_rank_tensor_parallel, 4, str(tmp_path), timeout=300)[0]
    for same, total, differ in results:
        assert same == total, differ
    assert "exp_avg_sq_codes4" in keys and "moment_scales4" in keys, keys


@pytest.mark.parametrize("kwargs,dtype,match", [
    ({"moments": "int4", "amsgrad": True}, torch.float32, "amsgrad"),
    ({"moments": "int4"}, torch.float64, "float64"),
    ({"moments": "int4", "differentiable": True}, torch.float32, "differentiable"),
])
def test_refused_before_anything_changes(kwargs, dtype, match):
    assert_refused(kwargs, dtype, match)


@pytest.mark.parametrize("master_weights", ["remainder8", "stochastic"])
def test_stepped_a_chunk_at_a_time_the_same_bits(monkeypatch, master_weights):
    """The step decodes a run CHUNK elements at a time (its temporaries bounded): the
    same bits as in one piece, a stochastically rounded parameter's keys included."""
    def run():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3000).bfloat16()),
                  torch.nn.Parameter(torch.randn(70, 9).bfloat16())]
        opt = zt.FusedAdamW(params, lr=1e-2, moments="int4", master_weights=master_weights)
        for t in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t)).bfloat16()
            opt.step()
        return params, _moments(opt)
    whole = run()
    monkeypatch.setattr(quant4, "CHUNK", 2 * quant4.BLOCK)
    chunked = run()
    assert all(torch.equal(a, b) for a, b in zip(whole[0], chunked[0]))
    assert all(torch.equal(a, b) for a, b in zip(whole[1], chunked[1]))


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_cpu_kernel_on_each_instruction_set(isa):
    """The C++ int4 kernel, held to each instruction set: its float32 step with the
    moments held in 4 bits between steps, bit for bit."""
    from lowbit_cases import held_isa
    with held_isa(isa):
        model, opt = _train("cpu")
        ref_model, ref = _train("cpu", moments="fp32", between=_held_in_4_bits(opt))
    _assert_same_run(model, opt, ref_model, ref)


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_offloaded_the_same_bits(fraction):
    """offload="cpu" (all, or half: the cut on a block boundary) steps the same bits."""
    model, opt = _train("cpu")
    off_model, off = _train("cpu", offload="cpu", offload_fraction=fraction)
    _assert_same_run(model, opt, off_model, off)


# -- on a GPU (run by bench/gpu_check.sh; skipped here) ----------------------------------
@pytest.mark.parametrize("backend", gpu_backends())
def test_int4_on_cuda_steps_its_fp32_step_held_in_4_bits(backend):
    """Each GPU backend's int4 step (Triton's kernel, CUDA's torch ops) is its own float32
    step with the moments held in 4 bits between steps, bit for bit."""
    model, opt = _train(backend, device="cuda")
    ref_model, ref = _train(backend, moments="fp32", between=_held_in_4_bits(opt), device="cuda")
    _assert_same_run(model, opt, ref_model, ref)
