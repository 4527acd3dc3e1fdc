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
