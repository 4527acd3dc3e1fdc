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


def _held_in_4_bits(opt):
    """fp32 moments as a 4-bit store holds them: each parameter's blocks (from its first
    element, as the store's layout puts them) encoded and decoded."""
    for entry in opt.state.values():
        for key, fmt in (("exp_avg", quant4.FIRST), ("exp_avg_sq", quant4.SECOND)):
            x = entry[key].view(-1)
            packed = torch.zeros(quant4.packed(x.numel()), dtype=torch.uint8, device=x.device)
            scales = torch.zeros(quant4.blocks(x.numel()), device=x.device)
            quant4.quantize(x, fmt, packed, scales)
            x.copy_(quant4.decode(packed, x.numel(), scales, fmt))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_each_backend_steps_its_fp32_step_held_in_4_bits(backend):
    """int4 on a backend is that backend's float32 step with the moments rounded to their
    4-bit codes between steps: the same parameters and moments, bit for bit; and released
    in backward, the same again."""
    if backend == "triton" and not interpreter_on():
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
    model, opt = _train(backend)
    ref_model, ref = _train(backend, moments="fp32", between=_held_in_4_bits)
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
        ref_model, ref = _train("cpu", moments="fp32", between=_held_in_4_bits)
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
    ref_model, ref = _train(backend, moments="fp32", between=_held_in_4_bits, device="cuda")
    _assert_same_run(model, opt, ref_model, ref)
