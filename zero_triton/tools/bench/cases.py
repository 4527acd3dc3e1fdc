"""The cases a step benchmark times: sizes, shapes (a GPT-2 small's tensors, many small
ones), dtypes, and the constants every part shares."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from zero_triton.tools.units import format_count, parse_count, positive_number

BYTES_PER_PARAM = 28
LR = 1e-2           # large enough that a missing update shows in the guard (see _guard)
BETAS = (0.9, 0.999)
EPS = 1e-8
GUARD_STEPS = 2     # step 2 exercises the bias correction, step 1 cancels it
GUARD_RTOL = 1e-4   # max|a - b| / max|b| over params (or master), exp_avg, exp_avg_sq
GUARD_LP_RTOL = 1e-2  # bf16 params: a master on a rounding boundary may flip one ulp
REF_SLICE = 1 << 16   # elements of tensor 0 checked against the float64 reference
INTERPRET_MAX_NUMEL = 1 << 20  # the Triton interpreter is ~1000x slower than compiled

ALL_CASES = ("fp32", "gpt2", "many", "bf16")
PROVIDER_IDS = ("zt-cpu", "zt-cuda", "zt-triton", "zt-torch", "torch-loop", "torch-foreach",
                "torch-fused", "torch-composite", "ds-cpuadam", "apex-fused", "limit", "copy")
LEGEND = {
    "zt-<b>": "zero_triton FusedAdam, backend=<b>",
    "torch-loop": "torch.optim.Adam(foreach=False)",
    "torch-foreach": "torch.optim.Adam(foreach=True)",
    "torch-fused": "torch.optim.Adam(fused=True)",
    "torch-composite": "bf16 grads -> fp32 buffer, Adam(fused=True) on fp32 master, copy -> bf16",
    "ds-cpuadam": "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "apex-fused": "apex.optimizers.FusedAdam",
    "limit": "plain memory kernel, the step's access pattern",
    "copy": "device-to-device copy_ (GB/s of its own read+write bytes)",
}


# -- sizes and cases ------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'16Mi' -> 16 * 2**20, '16M' -> 16 * 10**6: a positive integer with an optional
    suffix (``zero_triton.tools.units``). Anything else raises argparse.ArgumentTypeError."""
    return parse_count(text, "64Mi")


def size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",")]


def parse_many(text: str) -> tuple[int, int]:
    count, x, size = text.lower().partition("x")
    if not x:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNTxSIZE; pass e.g. 8192x4096")
    return parse_size(count), parse_size(size)


positive_float = positive_number("number", "0.25")


def format_size(n: int) -> str:
    return format_count(n)


def gpt2_small_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124,439,808 params at scale 1).

    ``scale`` shrinks the element count about ``scale``-fold by multiplying the big
    dimensions (vocabulary, context, width) by sqrt(scale); the number of tensors and
    the layer structure stay."""
    r = math.sqrt(scale)
    vocab, ctx, d = (max(1, round(x * r)) for x in (50257, 1024, 768))
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,),                  # ln_1 weight, bias
                   (d, 3 * d), (3 * d,),        # attn.c_attn
                   (d, d), (d,),                # attn.c_proj
                   (d,), (d,),                  # ln_2
                   (d, 4 * d), (4 * d,),        # mlp.c_fc
                   (4 * d, d), (d,)]            # mlp.c_proj
    shapes += [(d,), (d,)]                      # ln_f
    return shapes


@dataclass
class Case:
    name: str
    shapes: list
    dtype: torch.dtype          # parameter and gradient dtype; bf16 keeps an fp32 master

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def baseline(self) -> str:
        return "torch-composite" if self.mixed else "torch-fused"


def build_cases(args) -> list[Case]:
    cases = []
    for kind in args.cases:
        if kind == "fp32":
            cases += [Case(f"fp32 {format_size(n)}", [(n,)], torch.float32) for n in args.sizes]
        elif kind == "gpt2":
            shapes = gpt2_small_shapes(args.scale)
            inverse = 1 / args.scale
            label = ("gpt2-small" if args.scale == 1 else f"gpt2-small x1/{inverse:.0f}"
                     if abs(inverse - round(inverse)) < 1e-9 else f"gpt2-small x{args.scale:.3g}")
            cases.append(Case(label, shapes, torch.float32))
        elif kind == "many":
            count, size = args.many
            cases.append(Case(f"{count}x{size}", [(size,)] * count, torch.float32))
        elif kind == "bf16":
            cases += [Case(f"bf16+master {format_size(n)}", [(n,)], torch.bfloat16)
                      for n in args.bf16_sizes]
    return cases
