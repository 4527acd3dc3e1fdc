"""The one reference implementation that tests and benchmarks share.

Two halves:

* A numpy model of the ZeRO-1 step (``adam_update``, ``shard_ranges``,
  ``init_states``, ``zero_step``). It follows the seed problem: shard ``i`` of ``n``
  parameters over ``N`` workers is ``np.array_split(np.arange(n), N)[i]``, and one
  ZeRO step must equal ordinary Adam on the mean gradient. Everything is float64.
* A torch reference step (``torch_adam_step_``) and an integer-only round-to-nearest-
  even cast (``rne_cast``) that every backend (triton, cuda, cpu, torch) is tested
  against. The step computes in float64 and rounds once on write-back: the "upcast
  reference".

Nothing here is fast, and nothing here imports the rest of the package: the oracle
must not depend on what it checks.

The seed's worked example: 5 parameters, 2 workers, lr 0.1. Worker 0 owns parameters
0-2, worker 1 owns 3-4; parameter 3's mean gradient is 0, so it does not move, and the
result is Adam on the full vector with the mean gradient:

    >>> import numpy as np
    >>> from zero_triton.reference import adam_update, init_states, zero_step
    >>> [tuple(m.shape) for m, v in init_states(5, 2)]
    [(3,), (2,)]
    >>> param = np.ones(5)
    >>> grads = [np.array([0.2, 0.4, 0.6, 0.8, 1.0]), np.array([0.4, 0.0, 0.2, -0.8, 3.0])]
    >>> new, states = zero_step(param, grads, init_states(5, 2), t=1, lr=0.1)
    >>> np.round(new, 6).tolist()
    [0.9, 0.9, 0.9, 1.0, 0.9]
    >>> full, _, _ = adam_update(param, np.mean(grads, axis=0), np.zeros(5), np.zeros(5), 1, lr=0.1)
    >>> bool(np.array_equal(new, full))
    True
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "adam_update",
    "shard_ranges",
    "init_states",
    "zero_step",
    "torch_adam_step_",
    "rne_cast",
]

Scalar = Union[float, int, torch.Tensor]


# --------------------------------------------------------------------------------------
# numpy seed API
# --------------------------------------------------------------------------------------


def _check_step(t) -> int:
    if isinstance(t, bool) or not isinstance(t, Integral) or t < 1:
        raise ValueError(
            f"step t must be an int >= 1 (the step number after incrementing: the first "
            f"step is t=1), got {t!r}"
        )
    return int(t)


def adam_update(param, grad, m, v, t, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8):
    """One Adam step on one array; returns new ``(param, m, v)`` (float64).

    Standard Adam with bias correction::

        m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
        p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    ``param``, ``grad``, ``m``, ``v``: arrays of one shape (any shape, 0 elements
    included). ``t``: the step number, starting at 1. Inputs are not modified.
    """
    t = _check_step(t)
    p = np.array(param, dtype=np.float64)
    g = np.asarray(grad, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    for name, a in (("grad", g), ("m", m), ("v", v)):
        if a.shape != p.shape:
            raise ValueError(
                f"adam_update: {name} has shape {a.shape} but param has shape {p.shape}; "
                f"pass arrays of one shape"
            )
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    mhat = m / (1.0 - beta1**t)
    vhat = v / (1.0 - beta2**t)
    p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p, m, v


def shard_ranges(n_params: int, n_workers: int) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]``, one per worker: the bounds of
    ``np.array_split(np.arange(n_params), n_workers)``.

    The first ``n_params % n_workers`` shards hold one element more than the rest;
    with more workers than parameters the last shards are empty.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, Integral) or n_params < 0:
        raise ValueError(f"n_params must be an int >= 0, got {n_params!r}")
    if isinstance(n_workers, bool) or not isinstance(n_workers, Integral) or n_workers < 1:
        raise ValueError(
            f"n_workers must be an int >= 1 (the number of ranks), got {n_workers!r}"
        )
    base, extra = divmod(int(n_params), int(n_workers))
    sizes = np.full(int(n_workers), base, dtype=np.int64)
    sizes[:extra] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def init_states(n_params: int, n_workers: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Zero Adam state for each worker: ``[(m_shard, v_shard), ...]`` (float64).

    Worker ``i`` holds only its shard: arrays of length ``stop - start`` from
    ``shard_ranges``. That is the ZeRO-1 memory saving.
    """
    return [
        (np.zeros(b - a, dtype=np.float64), np.zeros(b - a, dtype=np.float64))
        for a, b in shard_ranges(n_params, n_workers)
    ]


def _check_zero_inputs(param, grads: Sequence, states: Sequence) -> tuple:
    """``zero_step``'s inputs checked, each error naming the fix: the parameter vector
    and gradients as float64 arrays, and each worker's [a, b) shard range."""
    p = np.asarray(param, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(
            f"zero_step: param must be a 1-D vector, got shape {p.shape}; flatten it "
            f"first (np.ravel)"
        )
    n = p.shape[0]
    if len(grads) == 0:
        raise ValueError("zero_step: grads is empty; pass one gradient per worker")
    if len(grads) != len(states):
        raise ValueError(
            f"zero_step: got {len(grads)} gradients but {len(states)} worker states; "
            f"pass one gradient per worker and states from init_states(n, {len(grads)})"
        )
    grads = [np.asarray(g, dtype=np.float64) for g in grads]
    for i, g in enumerate(grads):
        if g.shape != (n,):
            raise ValueError(
                f"zero_step: grads[{i}] has shape {g.shape}, expected ({n},): every "
                f"worker's local gradient covers the full parameter vector"
            )
    ranges = shard_ranges(n, len(grads))
    for i, ((a, b), st) in enumerate(zip(ranges, states)):
        if len(st) != 2:
            raise ValueError(f"zero_step: states[{i}] must be a pair (m_shard, v_shard)")
        for name, arr in zip(("m", "v"), st):
            if np.shape(arr) != (b - a,):
                raise ValueError(
                    f"zero_step: worker {i} {name} shard has shape {np.shape(arr)}, "
                    f"expected ({b - a},) for parameters [{a}, {b}); build states with "
                    f"init_states({n}, {len(grads)})"
                )
    return p, grads, ranges


def zero_step(param, grads: Sequence, states: Sequence, t: int, lr: float = 1e-2):
    """One ZeRO-1 Adam step simulated for ``N = len(grads)`` workers.

    ``param``: the full 1-D parameter vector (identical on every worker), length n.
    ``grads``: the N workers' local gradients, each full length n.
    ``states``: N pairs ``(m_shard, v_shard)`` from ``init_states`` or a previous step.
    ``t``: the step number (>= 1).

    Returns ``(new_param, new_states)``: reduce-scatter of the mean gradient, Adam on
    each worker's shard with its own m/v, all-gather by concatenation. The result
    equals ``adam_update`` on the full vector with the mean gradient. Inputs are not
    modified.
    """
    t = _check_step(t)
    p, grads, ranges = _check_zero_inputs(param, grads, states)
    new_shards, new_states = [], []
    for (a, b), (m, v) in zip(ranges, states):  # a loop over workers, not parameters
        # Reduce-scatter (op=AVG): worker i receives only its slice of the mean. The
        # sum runs over workers in rank order, then divides by N, so the result is
        # bitwise sum(grads) / N whatever the slice (np.mean's order depends on the
        # memory layout and can differ by an ulp).
        g_shard = grads[0][a:b].copy()
        for g in grads[1:]:
            g_shard += g[a:b]
        g_shard /= len(grads)
        p_shard, m, v = adam_update(p[a:b], g_shard, m, v, t, lr=lr)
        new_shards.append(p_shard)
        new_states.append((m, v))
    return np.concatenate(new_shards), new_states  # all-gather


# --------------------------------------------------------------------------------------
# torch reference step
# --------------------------------------------------------------------------------------


def _as_float(x: Scalar, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape "
                             f"{tuple(x.shape)}")
        return float(x.detach().reshape(()).to("cpu", torch.float64))
    return float(x)


def _check_operands(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad: bool) -> None:
    """``torch_adam_step_``'s tensors: dtypes it steps, one shape."""
    if param.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"param must be float32 or float64, got {param.dtype}; for bf16/fp16 "
            f"parameters pass the fp32 master copy and round with rne_cast"
        )
    if not grad.is_floating_point():
        raise TypeError(f"grad must be a floating-point tensor, got {grad.dtype}")
    named = [("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs max_exp_avg_sq (a tensor shaped like "
                             "param, zeros before the first step)")
        named.append(("max_exp_avg_sq", max_exp_avg_sq))
    for name, x in named:
        if x.shape != param.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but param has shape "
                             f"{tuple(param.shape)}")


def torch_adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    step: int,
    *,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Optional[Scalar] = None,
    clip_coef: Optional[Scalar] = None,
    found_inf: Optional[Scalar] = None,
) -> None:
    """Reference Adam/AdamW step, in place, computed in float64 on copies.

    ``param`` (float32 or float64), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
    ``max_exp_avg_sq``: tensors of one shape, updated in place (each rounded once to
    its own dtype on write-back). ``grad``: any floating dtype, same shape, read only.
    ``step``: the already-incremented step number (1 on the first step).
    ``lr``, ``grad_scale``, ``clip_coef``, ``found_inf``: floats or 1-element tensors.

    Order of operations (the contract every backend follows): unscale by
    ``grad_scale``, multiply by ``clip_coef``, skip the whole step if ``found_inf`` is
    non-zero, negate for ``maximize``, weight decay (decoupled when ``adamw``, else
    L2 added to the gradient), moments, bias correction, amsgrad max, update.
    """
    step = _check_step(step)
    _check_operands(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else None, amsgrad)
    if found_inf is not None and _as_float(found_inf, "found_inf") != 0:
        return  # checked before any arithmetic so nothing changes, not even moments
    lr = _as_float(lr, "lr")

    d = torch.float64
    g = grad.detach().to(d, copy=True)
    if grad_scale is not None:
        g = g / _as_float(grad_scale, "grad_scale")
    if clip_coef is not None:
        g = g * _as_float(clip_coef, "clip_coef")
    if maximize:
        g = -g
    p = param.detach().to(d, copy=True)
    if weight_decay != 0:
        if adamw:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = beta1 * exp_avg.detach().to(d) + (1.0 - beta1) * g
    v = beta2 * exp_avg_sq.detach().to(d) + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    if amsgrad:
        vhat = torch.maximum(max_exp_avg_sq.detach().to(d), v)
        max_exp_avg_sq.detach().copy_(vhat)
    else:
        vhat = v
    p = p - (lr / bc1) * m / (vhat.sqrt() / math.sqrt(bc2) + eps)

    param.detach().copy_(p)
    exp_avg.detach().copy_(m)
    exp_avg_sq.detach().copy_(v)


# --------------------------------------------------------------------------------------
# round-to-nearest-even casts from fp32, in integer arithmetic
# --------------------------------------------------------------------------------------

_U32 = 0xFFFFFFFF


def _to_int16_bits(h: torch.Tensor) -> torch.Tensor:
    # h holds unsigned 16-bit patterns in int64; reinterpret as int16 two's complement.
    return torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16)


def _rne_bf16_bits(b: torch.Tensor) -> torch.Tensor:
    # Add 0x7FFF plus the lowest kept bit, then truncate: ties go to the even bf16.
    # Overflow of the largest finite values carries into the exponent and gives inf,
    # which is the correct RNE result. NaN would round into inf (or flip quiet bits)
    # so it is replaced by the canonical quiet NaN 0x7FC0 (what c10 produces).
    h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    is_nan = (b & 0x7FFFFFFF) > 0x7F800000
    return torch.where(is_nan, torch.full_like(h, 0x7FC0), h & 0xFFFF)


def _rne_fp16_bits(b: torch.Tensor) -> torch.Tensor:
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    exp = a >> 23

    # Normal fp16 range (|x| >= 2^-14): drop 13 mantissa bits with RNE, rebias the
    # exponent by 127 - 15 = 112. A carry out of the mantissa bumps the exponent.
    r = a + 0xFFF + ((a >> 13) & 1)
    normal = (r >> 13) - (112 << 10)

    # Subnormal fp16 (|x| < 2^-14): the result counts units of 2^-24. With the
    # implicit bit, |x| = mant * 2^(exp-150) = mant * 2^-24 >> (126 - exp). Below
    # exp 102 (|x| < 2^-25, half a unit) everything rounds to zero.
    mant = (a & 0x7FFFFF) | 0x800000
    shift = (126 - exp).clamp(1, 24)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(q.dtype)
    sub = torch.where(exp >= 102, q, torch.zeros_like(q))

    # 65520 (0x477FF000) is the tie between 65504 (odd mantissa) and 2^16: it and
    # everything above round to inf.
    mag = torch.where(a >= 0x38800000, normal, sub)
    mag = torch.where(a >= 0x477FF000, torch.full_like(mag, 0x7C00), mag)
    mag = torch.where(a > 0x7F800000, torch.full_like(mag, 0x7E00), mag)
    return sign | mag


def rne_cast(x_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 ``x_fp32`` to ``torch.bfloat16`` or ``torch.float16``, nearest even.

    Computed with integer operations on the bit patterns, so tests can check a
    backend's low-precision write-back bit for bit without trusting any backend's
    own cast. Subnormals are kept (no flush to zero), overflow gives inf of the
    input's sign, NaN stays NaN (canonical quiet NaN). Returns a new tensor, same
    shape and device.
    """
    if not isinstance(x_fp32, torch.Tensor) or x_fp32.dtype != torch.float32:
        got = x_fp32.dtype if isinstance(x_fp32, torch.Tensor) else type(x_fp32)
        raise TypeError(f"rne_cast: x_fp32 must be a float32 tensor, got {got}; "
                        f"call .float() first")
    b = x_fp32.detach().contiguous().view(torch.int32).to(torch.int64) & _U32
    if dtype == torch.bfloat16:
        h = _rne_bf16_bits(b)
    elif dtype == torch.float16:
        h = _rne_fp16_bits(b)
    else:
        raise ValueError(f"rne_cast: dtype must be torch.bfloat16 or torch.float16, "
                         f"got {dtype}")
    return _to_int16_bits(h).view(dtype)
