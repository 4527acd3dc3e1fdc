"""A digest of a few steps, held across refactors: the same bits before and after.

Each case runs three steps of an optimizer on a model whose gradients are exact (every
parameter ``w`` enters the loss as ``(w * x).sum()``, so backward hands it ``x``: no
matrix product, whose bits depend on the CPU's instructions), through the path users
take (backward's hooks, the buckets, ``step``, ``overlap()``'s waits), and hashes the
parameters and the whole ``state_dict()`` after it. The inputs and the initial weights
are integers over 2**10, drawn as integers (``torch.randn``'s vectorised transforms give
other bits on other instruction sets). The digests below were recorded on torch 2.13 and
triton 3.9 (CPU); they were first taken from ``torch.randn`` inputs at the commit that
added this file, and re-recorded with these inputs where, on the machine recording them,
the old inputs gave the bits that first commit gives there (ZeRO-1 and ZeRO-2, with or
without ``overlap()``, give the same bits); a change of the code's layout must
leave every one of them as it is. A change of the arithmetic (a new summation order, a
different rounding) changes them on purpose: record the new ones in the same commit and
say why.

``python tests/test_digest.py`` prints the digests of this checkout.

The ``triton`` backend runs under Triton's interpreter (numpy: the same bits with
torch's AVX512, AVX2 and scalar loops). The ``torch`` backend's vectorised loops round
differently from one machine to another, and not only by instruction set: two AVX512
CPUs gave different bits. So its digests are kept per *arithmetic fingerprint*: the bits
of a frozen copy of the torch backend's ops (below, never imported from the library, so
a refactor cannot move it) on fixed inputs. A machine whose fingerprint has digests
recorded is checked against them; any other skips, printing its fingerprint (``python
tests/test_digest.py`` prints what to record).
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

STEPS = 3
# Shapes with odd sizes: the flat buffer pads them, buckets split between them.
SHAPES = [(7, 5), (33,), (4, 4, 3), (129,), (1,), (16, 9)]

DIGESTS = {
    "fused-fp32-triton": "6092a6d60dad8ac4fcbf43deaa1cb09f",
    "fused-bf16-master-triton": "a6d9e8c3af4f7cc09d72a021eb0d03f5",
    "zero-s1-buckets-triton": "d556872f2b7eaa4e77abcb3d11762d63",
}
# The torch backend's, by the arithmetic fingerprint of the machine they were recorded on:
# AVX2 and AVX512 loops on an AVX512 AMD EPYC (the same bits), and the scalar loops
# (ATEN_CPU_CAPABILITY=default) on the same machine.
TORCH_DIGESTS = {
    "adab098e6dc5c337e2f6012ba7550193": {
        "fused-fp32-torch": "f027698f96f65c6de08db2e73d292ed8",
        "fused-bf16-master-torch": "89554aa804910979c9f410a0ccaaa439",
        "zero-s2-buckets-torch": "8de85c21967d30252217ddc19adfaf94",
        "zero-s1-overlap-torch": "8de85c21967d30252217ddc19adfaf94",
    },
    "e7788373ad1357529e2cbec3e49867ad": {
        "fused-fp32-torch": "d47d2902277711bd58d6759f3bb127f1",
        "fused-bf16-master-torch": "0a8587bcf8ca56d0a96bccea9956cc38",
        "zero-s2-buckets-torch": "b63aa34f55475ed16a96bdaf5a041218",
        "zero-s1-overlap-torch": "b63aa34f55475ed16a96bdaf5a041218",
    },
}


def _exact(shape, generator) -> torch.Tensor:
    """Values in [-4, 4) on a grid of 2**-10, drawn as integers: the same bits on every
    machine (torch.randn's vectorised transforms are not)."""
    return torch.randint(-2**12, 2**12, shape, generator=generator).float() / 2**10


def arithmetic_fingerprint() -> str:
    """How this machine's torch rounds the torch backend's step: a frozen copy of its ops
    (as they were when the digests were recorded) over three steps, on lengths that take
    the vectorised loops and their tails, in fp32 with a bf16 copy out."""
    h = hashlib.sha256()
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 33, 129, 390, 1031):
        param = _exact((n,), g)
        m, v = torch.zeros(n), torch.zeros(n)
        for t in (1.0, 2.0, 3.0):
            grad = _exact((n,), g)
            param.mul_(1 - 1e-2 * 0.1)
            m.lerp_(grad, 1 - 0.9)
            v.mul_(0.95).addcmul_(grad, grad, value=1 - 0.95)
            denom = torch.sqrt(v).div_((1 - 0.95 ** t) ** 0.5).add_(1e-8)
            param.addcdiv_(m, denom, value=-1e-2 / (1 - 0.9 ** t))
            low = param.to(torch.bfloat16)
            for x in (param, m, v, low):
                h.update(x.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


class Leaf(torch.nn.Module):
    def __init__(self, shape, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(_exact(shape, g).to(dtype))

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
    return [_exact(s, g).to(dtype) for s in SHAPES]


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
    if case.endswith("-torch"):
        here = arithmetic_fingerprint()
        if here not in TORCH_DIGESTS:
            pytest.skip(f"the torch backend's digests were recorded on machines whose torch "
                        f"rounds its step as {sorted(TORCH_DIGESTS)}; this one rounds it as "
                        f"{here} ({torch.backends.cpu.get_cpu_capability()} loops): "
                        "`python tests/test_digest.py` prints the digests to record for it")
        expected = TORCH_DIGESTS[here][case]
    else:
        expected = DIGESTS[case]
    assert CASES[case]() == expected, (
        f"{case}: the bits of {STEPS} steps changed. A refactor must not change them; a "
        "deliberate change of the arithmetic records the new digest here and says why")


if __name__ == "__main__":
    print(f"arithmetic fingerprint {arithmetic_fingerprint()} "
          f"({torch.backends.cpu.get_cpu_capability()} loops)")
    for name, run in CASES.items():
        print(f'    "{name}": "{run()}",')
