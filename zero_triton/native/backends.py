"""Backends: name -> fused step function, and which are usable here and why not.

Every backend computes the same function (see ``zero_triton.reference``) with one
signature, ``step(ops, args)``: ``ops`` the tensors of one launch, ``args`` the step's
scalars and flags (``zero_triton.kernels.args``: ``Operands`` and ``StepArgs``, as
``csrc/adam_args.h`` is one struct for the C++ and CUDA kernels).

``ops.param`` is the fp32 master (or fp32 parameter; ``ops.param_lp`` then receives its
fp16/bf16 rounding), or the bf16 parameter itself: rounded back stochastically with
``args.stochastic`` (master_weights="stochastic", keyed by ``args.seed`` and
``args.index``), or with its int16 ``ops.remainder`` the exact master's high half
(master_weights="remainder", ``zero_triton.kernels.remainder``). ``ops.moments`` are
the moment store's operands, whose format picks the registry's row.

``"torch"`` reads ``ops.scratch``: a float32 buffer of the launch's size, so that the
step allocates nothing.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

from zero_triton.kernels.args import Operands, StepArgs

NAMES = ("auto", "triton", "cuda", "cpu", "torch")


def _value(t) -> float:
    return float(t.item()) if isinstance(t, torch.Tensor) else float(t)


def _skipped(args: StepArgs) -> bool:
    """GradScaler found an inf: the torch steps read its flag on the host."""
    return args.found_inf is not None and args.found_inf.item() != 0


def torch_step(ops: Operands, args: StepArgs) -> None:
    """The step in plain in-place torch ops on preallocated buffers (several passes
    over memory; the fallback when no kernel can run). Reads ``found_inf``, ``lr`` and
    ``step`` on the host: on CUDA tensors this path syncs once per step. A bf16
    parameter without a master (``args.stochastic``, ``ops.remainder``) is stepped in
    float32 and rounded back stochastically (keyed by ``args.seed`` and ``args.index``)
    or split again with its remainder (see the module's docstring)."""
    if _skipped(args):
        return
    param, grad, (exp_avg, exp_avg_sq, max_exp_avg_sq), param_lp, step, lr, remainder, scratch = ops
    if args.stochastic or remainder is not None:
        from zero_triton.kernels import remainder as remainders, rounding
        master = param.float() if remainder is None else remainders.join(param, remainder)
        torch_step(Operands(master, grad, ops.moments, None, step, lr, scratch=scratch),
                   args.replace(stochastic=False, found_inf=None))
        if remainder is not None:
            high, low = remainders.split(master, remainder.dtype)
            param.copy_(high)
            remainder.copy_(low)
            return
        bits = rounding.random_bits(rounding.key(args.seed, int(_value(step)), rounding.PARAM_STREAM),
                                    args.index, master.numel(), master.device)
        param.copy_(rounding.to_bf16_stochastic(master, bits))
        return
    if scratch is None:
        scratch = torch.empty_like(param)
    lr_value, t = _value(lr), _value(step)
    beta1, beta2, weight_decay = args.beta1, args.beta2, args.weight_decay
    g = scratch
    g.copy_(grad)
    if args.grad_scale is not None:
        g.div_(args.grad_scale)
    if args.clip_coef is not None:
        g.mul_(args.clip_coef)
    if args.maximize:
        g.neg_()
    if weight_decay != 0:
        if args.adamw:
            param.mul_(1 - lr_value * weight_decay)
        else:
            g.add_(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if args.amsgrad:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        v = max_exp_avg_sq
    else:
        v = exp_avg_sq
    bias_correction1 = 1 - beta1 ** t
    bias_correction2_sqrt = (1 - beta2 ** t) ** 0.5  # as torch.optim.Adam computes it
    denom = torch.sqrt(v, out=scratch)  # g is dead: reuse its buffer
    denom.div_(bias_correction2_sqrt).add_(args.eps)
    param.addcdiv_(exp_avg, denom, value=-lr_value / bias_correction1)
    if param_lp is not None:
        param_lp.copy_(param)


def torch_step_int8(ops: Operands, args: StepArgs) -> None:
    """The step over int8 moments (``zero_triton.state.int8``) in torch ops: decode the
    blocks (``zero_triton.kernels.quant``), ``torch_step`` on them, encode them again
    with their new scales. Allocates the decoded moments (the fallback, not the fast path)."""
    from zero_triton.kernels import quant
    if _skipped(args):
        return
    exp_avg, exp_avg_sq, scales = ops.moments
    m = quant.decode(exp_avg, scales[:, 0], quant.FIRST)
    v = quant.decode(exp_avg_sq, scales[:, 1], quant.SECOND)
    torch_step(ops._replace(moments=(m, v, None)), args.replace(amsgrad=False, found_inf=None))
    quant.quantize(m, quant.FIRST, exp_avg, scales[:, 0])
    quant.quantize(v, quant.SECOND, exp_avg_sq, scales[:, 1])


def torch_step_bf16(ops: Operands, args: StepArgs) -> None:
    """The step over bf16 moments (``zero_triton.state.bf16``) in torch ops: widen them,
    ``torch_step``, round them back stochastically (``zero_triton.kernels.rounding``:
    keyed by ``seed``, the step, the moment and ``index`` + element). Allocates."""
    from zero_triton.kernels import rounding
    if _skipped(args):
        return
    exp_avg, exp_avg_sq, _ = ops.moments
    m, v = exp_avg.float(), exp_avg_sq.float()
    torch_step(ops._replace(moments=(m, v, None)), args.replace(amsgrad=False, found_inf=None))
    t = int(_value(ops.step))
    for moment, x, stream in ((exp_avg, m, rounding.FIRST_STREAM), (exp_avg_sq, v, rounding.SECOND_STREAM)):
        bits = rounding.random_bits(rounding.key(args.seed, t, stream), args.index, x.numel(), x.device)
        moment.copy_(rounding.to_bf16_stochastic(x, bits))


def _triton_why_not(device: torch.device) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, Linux only)"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    return (f"Triton runs on CUDA tensors, not {device.type}; for CPU tensors set "
            "TRITON_INTERPRET=1 before importing zero_triton (slow, for tests) or use "
            "backend='cpu' or 'torch'")


def _native_why_not(device: torch.device) -> str | None:
    try:
        from zero_triton.native import ext as _ext
        mod = _ext.load()
    except ImportError as exc:
        return f"zero_triton.native.ext cannot be imported ({exc})"
    if mod is None:
        return f"the native extension zero_triton._C is unavailable: {_ext.unavailable_reason()}"
    if device.type == "cuda" and not _ext.cuda_available():
        return ("zero_triton._C was built without CUDA kernels; rebuild with "
                "ZERO_TRITON_BUILD_EXT=1 pip install --no-build-isolation . on a CUDA machine")
    return None


def why_not(name: str, device: torch.device) -> str | None:
    """None when backend ``name`` can step tensors on ``device``, else the reason."""
    device = torch.device(device)
    if name == "torch":
        return None
    if name == "triton":
        return _triton_why_not(device)
    if name == "cpu":
        if device.type != "cpu":
            return f"backend 'cpu' steps CPU tensors, got {device.type}; use 'auto'"
        return _native_why_not(device)
    if name == "cuda":
        if device.type != "cuda":
            return f"backend 'cuda' steps CUDA tensors, got {device.type}; use 'auto'"
        return _native_why_not(device)
    raise ValueError(f"unknown backend {name!r}; choose one of {NAMES}")


_said: set[str] = set()


def _say_once(message: str) -> None:
    """One line on stderr, once per process: resolve() runs for every parameter group
    and flat buffer, and a warning's usual second line (the calling source line) only
    repeats what the message says."""
    if message not in _said:
        _said.add(message)
        print(" ".join(message.split()), file=sys.stderr, flush=True)


def resolve(name: str, device: torch.device) -> str:
    """The concrete backend for ``name`` on ``device``; raises with the fix if unusable.

    auto: CUDA tensors -> triton, else cuda, else torch; CPU tensors -> cpu (the C++
    kernel), else torch, said once.
    """
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {NAMES}")
    device = torch.device(device)
    if name != "auto":
        reason = why_not(name, device)
        if reason is not None:
            raise RuntimeError(f"backend={name!r} cannot run here: {reason}")
        return name
    order = ("triton", "cuda", "torch") if device.type == "cuda" else ("cpu", "torch")
    reasons = []
    for candidate in order:
        reason = why_not(candidate, device)
        if reason is None:
            if candidate == "torch" and reasons:
                _say_once("zero_triton: falling back to the plain torch step (slower, several "
                          "passes over memory) because " + "; ".join(reasons))
            return candidate
        reasons.append(f"{candidate}: {reason}")
    raise AssertionError("unreachable: the torch backend is always usable")


def _native(args: StepArgs) -> tuple:
    """The hyperparameters and flags as the C++ bindings take them (``csrc/adam.cpp``)."""
    return (float(args.beta1), float(args.beta2), float(args.eps), float(args.weight_decay),
            bool(args.adamw))


def _native_step():
    from zero_triton.native import ext as _ext
    native = _ext.load().adam_step

    def native_step(ops: Operands, args: StepArgs) -> None:
        exp_avg, exp_avg_sq, max_exp_avg_sq = ops.moments
        native(ops.param, ops.grad, exp_avg, exp_avg_sq, max_exp_avg_sq, ops.param_lp, ops.step,
               ops.lr, *_native(args), bool(args.amsgrad), bool(args.maximize), args.grad_scale,
               args.found_inf, args.clip_coef, bool(args.stochastic), int(args.seed),
               int(args.index), ops.remainder)
    return native_step


def _native_step_int8():
    from zero_triton.native import ext as _ext
    native = _ext.load().adam8_step

    def native_step_int8(ops: Operands, args: StepArgs) -> None:
        native(ops.param, ops.grad, *ops.moments, ops.param_lp, ops.step, ops.lr, *_native(args),
               bool(args.maximize), args.grad_scale, args.found_inf, args.clip_coef,
               bool(args.stochastic), int(args.seed), int(args.index), ops.remainder)
    return native_step_int8


def _native_step_int4():
    from zero_triton.native import ext as _ext
    native = _ext.load().adam4_step

    def native_step_int4(ops: Operands, args: StepArgs) -> None:
        native(ops.param, ops.grad, *ops.moments, ops.param_lp, ops.step, ops.lr, *_native(args),
               bool(args.maximize), args.grad_scale, args.found_inf, args.clip_coef,
               bool(args.stochastic), int(args.seed), int(args.index), ops.remainder)
    return native_step_int4


def _native_step_bf16():
    from zero_triton.native import ext as _ext
    native = _ext.load().adam_bf16_step

    def native_step_bf16(ops: Operands, args: StepArgs) -> None:
        exp_avg, exp_avg_sq, _ = ops.moments
        native(ops.param, ops.grad, exp_avg, exp_avg_sq, ops.param_lp, ops.step, ops.lr,
               *_native(args), bool(args.maximize), args.grad_scale, args.found_inf,
               args.clip_coef, int(args.seed), int(args.index), bool(args.stochastic),
               ops.remainder)
    return native_step_bf16


def _triton_step():
    from zero_triton.kernels.adam import adam_step
    return adam_step


def _triton_step_int8():
    from zero_triton.kernels.adam8 import adam8_step
    return adam8_step


def _triton_step_int4():
    from zero_triton.kernels.adam4 import adam4_step
    return adam4_step


def _triton_step_bf16():
    from zero_triton.kernels.adam_bf16 import adam_bf16_step
    return adam_bf16_step


def _triton_step_list():
    from zero_triton.kernels.adam import adam_step_list
    return adam_step_list


# The kernel registry: (concrete backend, moments format) -> (a loader of the step over
# one shard's operands, a loader of the step over lists in one launch or None). A moments
# format (``zero_triton.state.moments.FORMATS``) brings its kernels by adding its rows.
STEPS = {
    ("triton", "fp32"): (_triton_step, _triton_step_list),
    ("cpu", "fp32"): (_native_step, None),
    ("cuda", "fp32"): (_native_step, None),
    ("torch", "fp32"): (lambda: torch_step, None),
    ("triton", "int8"): (_triton_step_int8, None),
    ("cpu", "int8"): (_native_step_int8, None),
    ("cuda", "int8"): (_native_step_int8, None),
    ("torch", "int8"): (lambda: torch_step_int8, None),
    ("triton", "bf16"): (_triton_step_bf16, None),
    ("cpu", "bf16"): (_native_step_bf16, None),
    ("cuda", "bf16"): (_native_step_bf16, None),
    ("torch", "bf16"): (lambda: torch_step_bf16, None),
    # 4-bit moments: the C++ and Triton kernels; CUDA and torch: the backend's float32 step
    # between a decode and an encode in torch ops (zero_triton.kernels.quant4), the same bits
    ("triton", "int4"): (_triton_step_int4, None),
    ("cpu", "int4"): (_native_step_int4, None),
    ("cuda", "int4"): (lambda: _int4(_native_step()), None),
    ("torch", "int4"): (lambda: _int4(torch_step), None),
}


def _int4(fp32_step):
    from zero_triton.kernels import quant4
    return quant4.stepper(fp32_step)


def _entry(name: str, format: str):
    if name not in NAMES[1:]:
        raise ValueError(f"not a concrete backend: {name!r}")
    try:
        return STEPS[name, format]
    except KeyError:
        has = sorted(b for b, f in STEPS if f == format)
        raise ValueError(f"backend {name!r} has no kernel for {format!r} moments; "
                         f"backends that have one: {has}") from None


def step_function(name: str, format: str = "fp32"):
    """The step callable of a concrete backend name (see ``resolve``) for moments of
    ``format``: ``step(ops, args)`` (``zero_triton.kernels.args``)."""
    return _entry(name, format)[0]()


def list_step_function(name: str, format: str = "fp32"):
    """The step over a list of ``Operands`` in one launch, ``step_list(launches, args)``,
    for a concrete backend that has one (``"triton"``:
    ``zero_triton.kernels.adam.adam_step_list``), else None: the caller launches
    ``step_function(name)`` once per tensor."""
    loader = _entry(name, format)[1]
    return loader() if loader is not None else None


def availability() -> list[tuple[str, str, str | None]]:
    """(backend, device type, reason it is unusable or None) for every pairing."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    rows = []
    for device in devices:
        for name in NAMES[1:]:
            try:
                rows.append((name, device.type, why_not(name, device)))
            except Exception as exc:  # a broken install is a reason, not a crash of `info`
                rows.append((name, device.type, f"{type(exc).__name__}: {exc}"))
    return rows
