"""``import zero_triton`` never fails because a torch private moved (docs/install.md):
the privates the library uses are looked up in one place (``zero_triton.native.compat``)
without failing, and what cannot work without one says so when it is used, naming the
torch it needs."""
import subprocess
import sys

# A torch whose privates moved: ``torch._disable_dynamo`` gone, ``torch.utils._device``
# and ``torch.utils._pytree`` without the names we take from them, the torch function mode
# stack's accessors gone. Then the library is imported and used.
SCRIPT = r"""
import sys, types, torch, torch.utils._device, torch.utils._pytree
import torch._dynamo, torch.optim  # torch's own modules bind these before they "move"
del torch._disable_dynamo
sys.modules["torch.utils._device"] = types.ModuleType("torch.utils._device")
sys.modules["torch.utils._pytree"] = types.ModuleType("torch.utils._pytree")
for name in ("_pop_torch_function_stack", "_len_torch_function_stack"):
    delattr(torch._C, name)
import zero_triton
from zero_triton.native import compat
model = torch.nn.Linear(8, 4)
opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, backend="torch")
ref = torch.nn.Linear(8, 4)
ref.load_state_dict(model.state_dict())
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
for _ in range(3):
    for m, o in ((model, opt), (ref, ref_opt)):
        m(torch.ones(2, 8)).pow(2).sum().backward()
        o.step()
        o.zero_grad()
print("same", all(torch.allclose(a, b) for a, b in zip(model.parameters(), ref.parameters())))
print("leaves", compat.tree_leaves(((1, [2]), {"x": 3})))
try:
    from zero_triton.comm import pending_reads
    pending_reads.push(object())
except RuntimeError as exc:
    print("said:", exc)
"""


def test_import_and_a_step_survive_torch_privates_that_moved():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "same True" in out.stdout and "leaves [1, 2, 3]" in out.stdout, out.stdout
    assert "overlap()'s guard of parameter reads needs torch 2.4 or newer" in out.stdout, out.stdout


def test_the_tested_torch_range_is_setup_pys_bound_and_info_says_it():
    """setup.py's ``torch>=A,<B`` is exactly ``compat.TESTED_TORCH`` (the releases
    ``.ci/torch-matrix`` runs the suite on), and ``info`` says whether this torch is in it."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from zero_triton.native import compat
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    lo, hi = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', setup).groups()
    (a, b), (c, d) = compat.TESTED_TORCH
    assert (lo, hi) == (f"{a}.{b}", f"{c}.{d + 1}"), (lo, hi, compat.TESTED_TORCH)
    assert compat.torch_release("2.13.0+cpu") == (2, 13)
    assert compat.tested_torch("2.7.1+cu126") and compat.tested_torch("2.14.1")
    assert not compat.tested_torch("2.6.0") and not compat.tested_torch("2.15.0")
    out = subprocess.run([sys.executable, "-m", "zero_triton", "info"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"tested {a}.{b} to {c}.{d}" in out.stdout, out.stdout
