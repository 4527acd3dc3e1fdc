"""What the low-bit tests share (test_int8, test_bf16_moments, test_stochastic,
test_remainder, test_compact_state): moment operands of each format, the mean gradient
that every world size feeds, the C++ kernel held to one instruction set, and the GPU
backends to check when there is a GPU."""
import contextlib

import pytest
import torch

import zero_triton as zt

from zero_triton.kernels import quant
from zero_triton.native import backends


def moment_operands(fmt: str, n: int) -> tuple:
    """A step's moment operands of format ``fmt`` over ``n`` elements, from the same
    float32 moments whatever the format (MomentStore.operands' order)."""
    gen = torch.Generator().manual_seed(1)
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-4
    if fmt == "fp32":
        return (m, v, None)
    if fmt == "bf16":
        return (m.bfloat16(), v.bfloat16(), None)
    codes_m, codes_v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    scales = torch.zeros(quant.blocks(n), 2)
    quant.quantize(m, quant.FIRST, codes_m, scales[:, 0])
    quant.quantize(v, quant.SECOND, codes_v, scales[:, 1])
    return (codes_m, codes_v, scales)


def mean_grads(rank: int, world_size: int, t: int, shapes) -> list:
    """Step ``t``'s gradients on ``rank``: the mean over its share of 4 virtual ranks'
    (float32, exact in bf16), so that every world size averages the same mean gradient."""
    share = 4 // world_size
    per = []
    for r in range(rank * share, (rank + 1) * share):
        g = torch.Generator().manual_seed(t * 100 + r)
        per.append([torch.randint(-16, 17, s, generator=g).float() * 2.0 ** -8 for s in shapes])
    return [sum(x[i] for x in per) / share for i in range(len(shapes))]


@contextlib.contextmanager
def held_isa(isa: str):
    """The C++ kernel held to instruction set ``isa`` (skips where the CPU lacks it)."""
    from zero_triton.native import ext
    mod = ext.load()
    try:
        mod._set_cpu_isa(isa)
    except Exception as exc:  # noqa: BLE001 (the CPU lacks it)
        pytest.skip(f"this CPU cannot run the {isa} variant: {exc}")
    try:
        yield
    finally:
        mod._set_cpu_isa("")


def gpu_backends() -> list:
    """The GPU backends usable here, or one parameter that skips, saying why."""
    out = [b for b in ("triton", "cuda")
           if torch.cuda.is_available() and backends.why_not(b, torch.device("cuda")) is None]
    return out or [pytest.param("none", marks=pytest.mark.skip(
        reason="needs an NVIDIA GPU with Triton or the CUDA extension"))]


SHAPES = [(37, 19), (300,), (5,), (64, 33)]


def bf16_zero_job(rank, world_size, bucket_cap_mb, stage, master_weights, moments, steps,
                  save_to, load_from):
    """ZeroAdamW over bf16 parameters of ``SHAPES``, stepped ``steps`` times on
    ``mean_grads`` (from step 3 after loading the checkpoint ``load_from``; saving one to
    ``save_to`` at the end): (the parameters, the state dict's state), as numpy."""
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in SHAPES]
    opt = zt.ZeroAdamW(params, lr=1e-2, master_weights=master_weights, moments=moments,
                       bucket_cap_mb=bucket_cap_mb, stage=stage)
    first = 0
    if load_from:
        zt.checkpoint.load(load_from, opt)
        first = 3
    for t in range(first, first + steps):
        for p, g in zip(params, mean_grads(rank, world_size, t, SHAPES)):
            p.grad = g.bfloat16()
        opt.step()
        opt.zero_grad()
    if save_to:
        zt.checkpoint.save(save_to, opt)
    sd = opt.state_dict()
    return ([p.detach().float().numpy().copy() for p in params],
            {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()})


def assert_same(a, b, where):
    """Two ``bf16_zero_job`` results bitwise equal: parameters and every state."""
    for x, y in zip(a[0], b[0]):
        assert torch.equal(torch.from_numpy(x), torch.from_numpy(y)), where
    for k in b[1]:
        for n in b[1][k]:
            assert torch.equal(torch.from_numpy(a[1][k][n]), torch.from_numpy(b[1][k][n])), (where, k, n)


def assert_refused(kwargs: dict, dtype: torch.dtype, match: str) -> None:
    """FusedAdamW(**kwargs) over a parameter of ``dtype`` raises ValueError matching
    ``match``, and the parameter's storage was not moved into a flat buffer."""
    p = torch.nn.Parameter(torch.randn(40, 3).to(dtype))
    storage = p.data_ptr()
    with pytest.raises(ValueError, match=match):
        zt.FusedAdamW([p], **kwargs)
    assert p.data_ptr() == storage


def disagreeing_ranks_job(rank, world_size, dtype, first: dict, others: dict):
    """ZeroAdamW built with ``first`` on rank 0 and ``others`` elsewhere: the message of
    the RuntimeError each rank raised, or None."""
    p = torch.nn.Parameter(torch.randn(40).to(dtype))
    try:
        zt.ZeroAdamW([p], **(first if rank == 0 else others))
    except RuntimeError as exc:
        return str(exc)
    return None
