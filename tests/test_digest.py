"""A digest of a few steps, held across refactors: the same bits before and after.

Each case runs three steps of an optimizer on a model whose gradients are exact (every
parameter ``w`` enters the loss as ``(w * x).sum()``, so backward hands it ``x``: no
matrix product, whose bits depend on the CPU's instructions), through the path users
take (backward's hooks, the buckets, ``step``, ``overlap()``'s waits), and hashes the
parameters and the whole ``state_dict()`` after it. The digests below were recorded on
torch 2.13 and triton 3.9 (CPU) at the commit that added this file (ZeRO-1 and ZeRO-2,
with or without ``overlap()``, give the same bits); a change of the code's layout must
leave every one of them as it is. A change of the arithmetic (a new summation order, a
different rounding) changes them on purpose: record the new ones in the same commit and
say why.

``python tests/test_digest.py`` prints the digests of this checkout.

The ``triton`` backend runs under Triton's interpreter (numpy: the same bits on any
x86 CPU); the ``torch`` backend's vectorised loops may round differently on another
instruction set, so its digests are checked where they were recorded (AVX512) and
skipped, saying so, elsewhere.
"""
from __future__ import annotations

import hashlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402

RECORDED_ON = "AVX512"
STEPS = 3
# Shapes with odd sizes: the flat buffer pads them, buckets split between them.
SHAPES = [(7, 5), (33,), (4, 4, 3), (129,), (1,), (16, 9)]

DIGESTS = {
    "fused-fp32-triton": "f1e45d7444cc8c8956d75f13e07010c0",
    "fused-fp32-torch": "c7e38a537325918c730aeab6a1497688",
    "fused-bf16-master-triton": "efea2fbc33b24acadd6cf4aeb4cbf18f",
    "fused-bf16-master-torch": "b18e9b2bc14c085d53c84a781a2ef114",
    "zero-s1-buckets-triton": "3a448192b06b265e5ed54390202fcdd8",
    "zero-s2-buckets-torch": "76237ab68f5e152b24411168d4550b41",
    "zero-s1-overlap-torch": "76237ab68f5e152b24411168d4550b41",
}


class Leaf(torch.nn.Module):
    def __init__(self, shape, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))

    def forward(self, x):
        return (self.w * x).sum()


class Exact(torch.nn.Module):
    """Leaves whose gradients are their inputs, bit for bit."""

    def __init__(self, dtype):
        super().__init__()
        self.leaves = torch.nn.ModuleList(Leaf(s, dtype, i) for i, s in enumerate(SHAPES))

    def forward(self, xs):
        total = None
        for leaf, x in zip(self.leaves, xs):
            part = leaf(x).float()
            total = part if total is None else total + part
        return total


def _inputs(step, rank, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _digest(model, sd) -> str:
    h = hashlib.sha256()

    def feed(t):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        t = t.detach().contiguous().cpu().reshape(-1)
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    for p in model.parameters():
        feed(p)
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            v = sd["state"][i][k]
            feed(v) if torch.is_tensor(v) else h.update(repr((k, v)).encode())
    for group in sd["param_groups"]:
        h.update(repr(sorted((k, v) for k, v in group.items() if k != "params")).encode())
    return h.hexdigest()[:32]


def _train(model, opt, rank, dtype):
    for step in range(STEPS):  # under overlap() the forward's pre-hooks wait for the gathers
        model(_inputs(step, rank, dtype)).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_params"):
        opt.wait_params()


def fused_case(dtype, backend) -> str:
    from zero_triton import FusedAdamW
    model = Exact(dtype)
    opt = FusedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                     backend=backend)
    _train(model, opt, 0, dtype)
    return _digest(model, opt.state_dict())


def _zero_rank(rank, world_size, stage, overlap, backend):
    import zero_triton
    from zero_triton import ZeroAdamW
    model = Exact(torch.float32)
    # ~0.5 KiB buckets: several per model, a parameter split between two.
    opt = ZeroAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                    backend=backend, stage=stage, bucket_cap_mb=2**-11)
    if overlap:
        zero_triton.overlap(model, opt)
    _train(model, opt, rank, torch.float32)
    return _digest(model, opt.state_dict())


def zero_case(stage, overlap, backend) -> str:
    per_rank = run_ranks(_zero_rank, 2, stage, overlap, backend, timeout=240)
    assert per_rank[0] == per_rank[1], f"the ranks ended apart: {per_rank}"
    return per_rank[0]


CASES = {
    "fused-fp32-triton": lambda: fused_case(torch.float32, "triton"),
    "fused-fp32-torch": lambda: fused_case(torch.float32, "torch"),
    "fused-bf16-master-triton": lambda: fused_case(torch.bfloat16, "triton"),
    "fused-bf16-master-torch": lambda: fused_case(torch.bfloat16, "torch"),
    "zero-s1-buckets-triton": lambda: zero_case(1, False, "triton"),
    "zero-s2-buckets-torch": lambda: zero_case(2, False, "torch"),
    "zero-s1-overlap-torch": lambda: zero_case(1, True, "torch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_steps_keep_their_bits(case):
    if case.endswith("-torch") and torch.backends.cpu.get_cpu_capability() != RECORDED_ON:
        pytest.skip(f"the torch backend's digests were recorded on {RECORDED_ON}; this CPU "
                    f"runs {torch.backends.cpu.get_cpu_capability()} loops, which may round "
                    "differently")
    assert CASES[case]() == DIGESTS[case], (
        f"{case}: the bits of {STEPS} steps changed. A refactor must not change them; a "
        "deliberate change of the arithmetic records the new digest here and says why")


if __name__ == "__main__":
    for name, run in CASES.items():
        print(f'    "{name}": "{run()}",')
