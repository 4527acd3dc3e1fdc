"""The Triton launchers (one flat buffer; a list of tensors) called directly: bad
arguments refused, partial last blocks, 64-bit offsets, the list launcher equal to
one launch per tensor. Under the interpreter on CPU tensors."""

import pytest
import torch

from conftest import interpreter_on
from zero_triton.native import backends
from zero_triton.kernels.args import Operands, StepArgs
from zero_triton.reference import torch_adam_step_

from adam_cases import (assert_bitwise, assert_close, FP32_TOL, LAUNCH_KW, launcher_args, spelled,
                        require_backend)


# -- the Triton launcher -------------------------------------------------------------------------




def _triton_launcher():
    require_backend("triton")
    from zero_triton.kernels.adam import adam_step
    return spelled(adam_step)


@pytest.mark.parametrize("index, name, bad, match", [
    (0, "param", lambda t: torch.zeros(2 * t.numel())[::2],
     "`param` must be float32 and contiguous, got torch.float32 non-contiguous"),
    (2, "exp_avg", lambda t: torch.zeros(2 * t.numel())[::2], "`exp_avg` must be float32 and contiguous"),
    (3, "exp_avg_sq", lambda t: t.double(), "`exp_avg_sq` must be float32 and contiguous, got torch.float64"),
    (1, "grad", lambda t: t.to(torch.int32), "`grad` must be float32/float16/bfloat16"),
    (1, "grad", lambda t: torch.zeros(t.numel() + 1), r"`grad` has 34 elements, expected 33"),
    (2, "exp_avg", lambda t: torch.zeros(t.numel() - 1), r"`exp_avg` has 32 elements, expected 33"),
    (5, "param_lp", lambda t: torch.zeros(t.numel()), "`param_lp` must be float16/bfloat16"),
    (6, "step", lambda t: torch.tensor([1.0, 2.0]), r"`step` has 2 elements, expected 1"),
    (7, "lr", lambda t: torch.tensor([1e-2], dtype=torch.float64), "`lr` must be float32"),
])
def test_launcher_refuses_bad_arguments(index, name, bad, match):
    adam_step = _triton_launcher()
    args = launcher_args(33)
    args[index] = bad(args[0])
    before = [a.clone() if a is not None else None for a in args]
    with pytest.raises(ValueError, match=match):
        adam_step(*args, **LAUNCH_KW)
    for i, (a, b) in enumerate(zip(args, before)):
        if a is not None:
            assert_bitwise(a, b, f"argument {i} changed by a refused launch")


def test_launcher_amsgrad_needs_max_exp_avg_sq():
    adam_step = _triton_launcher()
    with pytest.raises(ValueError, match="amsgrad=True needs `max_exp_avg_sq`"):
        adam_step(*launcher_args(8), **{**LAUNCH_KW, "amsgrad": True})


@pytest.mark.parametrize("dtype, rtol, atol", FP32_TOL)
@pytest.mark.parametrize("n, block", [(1009, 64), (1, 16), (100, 128), (4096 + 3, 1024)])
def test_launcher_partial_last_block(monkeypatch, n, block, dtype, rtol, atol):
    # Several programs with a masked tail: sizes that are not a multiple of the block.
    adam_step = _triton_launcher()
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "_block_and_warps", lambda numel: (block, 4))
    args = launcher_args(n)
    # A guard region past the end of each in-place target must stay untouched.
    guarded = [torch.full((n + 37,), 7.0) for _ in range(3)]
    for g, i in zip(guarded, (0, 2, 3)):
        g[:n].copy_(args[i])
        args[i] = g[:n]
    ref = [a.clone() for a in args[:4]]
    torch_adam_step_(ref[0], ref[1], ref[2], ref[3], None, 3, lr=1e-2, beta1=0.9, beta2=0.999,
                     eps=1e-8, weight_decay=0.01, adamw=True, amsgrad=False, maximize=False)
    adam_step(*args, **LAUNCH_KW)
    for name, i in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert_close(args[i], ref[i], rtol, atol, f"n={n}, block={block}: {name}")
    for g in guarded:
        assert (g[n:] == 7.0).all(), f"n={n}, block={block}: the kernel wrote past the end"


def test_launcher_offsets_are_64_bit():
    # A shard of more than 2**31 elements needs 2**31 * 28 bytes of buffers; too big
    # for a test. What can be checked here: the program offset is widened to int64
    # before it is multiplied by BLOCK (the multi-block path itself runs in
    # test_launcher_partial_last_block).
    import inspect
    from zero_triton.kernels import adam as kadam
    src = inspect.getsource(kadam._adam_kernel.fn)
    pid_line = next(line for line in src.splitlines() if "program_id" in line)
    assert "tl.int64" in pid_line, f"program id not widened to 64 bits: {pid_line.strip()}"
    offs_line = next(line for line in src.splitlines() if line.strip().startswith("offs ="))
    assert "pid" in offs_line


def test_interpreter_is_on_for_cpu_triton_tests():
    # conftest sets TRITON_INTERPRET=1 before zero_triton.kernels is imported; without
    # it every CPU triton test above would skip instead of run.
    if not interpreter_on():
        pytest.skip("TRITON_INTERPRET is set to something else by the caller")
    assert backends.why_not("triton", torch.device("cpu")) is None


@pytest.mark.parametrize("lp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_list_launcher_equals_one_launch_per_tensor(monkeypatch, lp_dtype, grad_dtype, amsgrad):
    """adam_step_list (the local shards of DTensor parameters, one launch) gives the
    bits adam_step gives tensor by tensor: several blocks per tensor, an empty tensor,
    a step count per tensor, GradScaler's scale and clipping, and nothing written past
    any tensor's end."""
    _triton_launcher()
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "_list_block", lambda numels: 16)
    sizes = [5, 100, 0, 33, 1]

    def make():
        g = torch.Generator().manual_seed(1)
        guarded = []

        def tensor(values):  # with 9 guard elements of 7.0 after it
            t = torch.full((values.numel() + 9,), 7.0, dtype=values.dtype)
            t[:values.numel()].copy_(values)
            guarded.append(t)
            return t[:values.numel()]
        out = {"params": [tensor(torch.randn(n, generator=g)) for n in sizes],
               "grads": [torch.randn(n, generator=g).to(grad_dtype) for n in sizes],
               "exp_avgs": [tensor(torch.randn(n, generator=g) * 0.1) for n in sizes],
               "exp_avg_sqs": [tensor(torch.rand(n, generator=g) * 0.1) for n in sizes],
               "max": [tensor(torch.rand(n, generator=g) * 0.2) for n in sizes] if amsgrad else None,
               "lp": [tensor(torch.randn(n, generator=g).to(lp_dtype)) for n in sizes] if lp_dtype else None,
               "steps": [torch.tensor([float(k + 2)]) for k in range(len(sizes))]}
        return out, guarded
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=amsgrad,
              maximize=False, grad_scale=torch.tensor([2.0]), clip_coef=torch.tensor([0.5]),
              found_inf=torch.tensor([0.0]))
    lr = torch.tensor([1e-2])
    (one, _), (listed, guards) = make(), make()
    def operands(t, i):
        return Operands(t["params"][i], t["grads"][i],
                        (t["exp_avgs"][i], t["exp_avg_sqs"][i], t["max"][i] if amsgrad else None),
                        t["lp"][i] if lp_dtype else None, t["steps"][i], lr)
    for i in range(len(sizes)):
        kadam.adam_step(operands(one, i), StepArgs(**kw))
    kadam.adam_step_list([operands(listed, i) for i in range(len(sizes))], StepArgs(**kw))
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max", "lp"):
        if one[key] is not None:
            for i, (a, b) in enumerate(zip(one[key], listed[key])):
                assert_bitwise(b, a, f"{key}[{i}]")
    assert not torch.equal(listed["params"][1], make()[0]["params"][1]), "nothing was stepped"
    for t in guards:
        assert (t[-9:] == 7.0).all(), "the kernel wrote past a tensor's end"


def test_list_launcher_refuses_mixed_gradients_lrs_and_low_precision_copies():
    _triton_launcher()
    from zero_triton.kernels.adam import adam_step_list
    p = [torch.zeros(3), torch.zeros(4)]
    lr = torch.tensor([1e-3])

    def launches(grads, lrs=(lr, lr), lps=(None, None)):
        return [Operands(p[i], grads[i], (torch.zeros(n), torch.zeros(n), None), lps[i],
                         torch.ones(1), lrs[i]) for i, n in enumerate((3, 4))]
    args = StepArgs(**LAUNCH_KW)
    with pytest.raises(ValueError, match="several dtypes"):
        adam_step_list(launches([torch.zeros(3), torch.zeros(4).bfloat16()]), args)
    with pytest.raises(ValueError, match="one `lr` tensor"):
        adam_step_list(launches([torch.zeros(3), torch.zeros(4)], lrs=(lr, lr.clone())), args)
    with pytest.raises(ValueError, match="for every tensor or for none"):
        adam_step_list(launches([torch.zeros(3), torch.zeros(4)],
                                lps=(None, torch.zeros(4).bfloat16())), args)
    with pytest.raises(ValueError, match="stepped by adam_step"):
        adam_step_list(launches([torch.zeros(3), torch.zeros(4)]), args.replace(stochastic=True))
    assert all((t == 0).all() for t in p)
