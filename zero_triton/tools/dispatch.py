"""What a call dispatches, op by op: the check that a step can be captured in a CUDA
graph, made on any machine.

A CUDA graph replays the kernels its capture recorded, on the addresses they read then;
so a step that is captured must, once warmed up:

- allocate nothing (a tensor made during capture lives in the graph's private pool and
  is the same memory at every replay: a step that hands it out, or expects it fresh,
  is wrong; one that frees it mid-capture fails);
- read no device value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
  ``nonzero``: a host sync, which capture refuses, and a branch the replay cannot take
  again);
- run the same ops, on the same addresses, at every step.

``record(fn)`` runs ``fn()`` under a ``TorchDispatchMode`` (every ATen op: its name,
the addresses of its tensor arguments, whether an output is new memory) and a
``TorchFunctionMode`` (the tensor methods that read a value on the host, which a CPU
tensor answers without dispatching an op). ``Recording.problems`` names each op that
breaks a rule, and the first difference from another recording. Kernels that do not
dispatch through ATen (the C++ extension's, Triton's) are not seen: they allocate
nothing and read their scalars on the device (``zero_triton.kernels.args``).

On CPU ranks the collectives are gloo's and nothing is captured, but the step runs the
same Python and the same ATen ops as on a GPU: what it dispatches here is what a
capture would record there (``tests/test_capture.py``; ``python -m zero_triton.tools.dispatch``
prints it for a configuration).
"""
from __future__ import annotations

import dataclasses
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that read a tensor's value on the host (a sync on a GPU).
HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero",
                 "aten::nonzero_static", "aten::equal"}
# Tensor methods that read values on the host without an op on a CPU tensor (``cpu``: a
# copy to the host, a sync on a GPU).
HOST_READ_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__",
                     "__index__", "__complex__"}
# Ops that make a tensor from host data (``torch.tensor(...)``): an allocation whose value
# a replay would not see change.
FROM_HOST = {"aten::lift_fresh", "aten::scalar_tensor"}
# Records of the profiler's ranges: no tensor work.
IGNORED = ("profiler::",)


@dataclasses.dataclass
class Op:
    """One op: its name, the addresses of its tensor arguments (None for a tensor with no
    storage), the bytes of new memory it returned, whether it read a value on the host,
    and where in zero_triton it was called from (for the report)."""
    name: str
    addresses: tuple
    allocated: int = 0
    host_read: bool = False
    where: str = ""

    def key(self, addresses: bool) -> tuple:
        return (self.name, self.addresses) if addresses else (self.name,)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "zero_triton" in f.filename and not f.filename.endswith("dispatch.py")]
    return " < ".join(f"{f.filename.rsplit('zero_triton', 1)[-1].lstrip('/')}:{f.lineno}"
                      for f in reversed(frames[-3:]))


def _address(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake)
        return None


class _Ops(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if name.startswith(IGNORED):
            return out
        storages = set()
        for t in ins:
            try:
                storages.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = 0
        for t in outs:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if name in FROM_HOST or (storage.nbytes() and storage.data_ptr() not in storages):
                new += storage.nbytes()
        read = name in HOST_READ_OPS
        self.ops.append(Op(name, tuple(_address(t) for t in ins), new, read,
                           _caller() if new or read else ""))
        return out


class _Reads(TorchFunctionMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.ops.append(Op(f"Tensor.{name}", (), 0, True, _caller()))
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class Recording:
    """The ops one call dispatched, in order."""
    ops: list

    @property
    def allocations(self) -> list:
        return [op for op in self.ops if op.allocated]

    @property
    def host_reads(self) -> list:
        return [op for op in self.ops if op.host_read]

    def allocated_bytes(self) -> int:
        return sum(op.allocated for op in self.ops)

    def first_difference(self, other: "Recording", addresses: bool = True):
        """The first op where the two recordings differ (by name, and by the addresses
        of the tensors it reads and writes with ``addresses``), as text; None if none."""
        for i, (a, b) in enumerate(zip(self.ops, other.ops)):
            if a.key(addresses) != b.key(addresses):
                what = "op" if a.name != b.name else "addresses"
                return f"op {i}: {a.name} then {b.name} ({what} differ)"
        if len(self.ops) != len(other.ops):
            return f"{len(self.ops)} ops then {len(other.ops)}"
        return None

    def problems(self, other: "Recording | None" = None, addresses: bool = True) -> list:
        """What stops a capture: each allocation and host read (with where it was
        called from), and the first difference from ``other`` (the next step's)."""
        out = [f"allocates {op.allocated} bytes: {op.name} at {op.where}" for op in self.allocations]
        out += [f"reads a value on the host: {op.name} at {op.where}" for op in self.host_reads]
        if other is not None:
            differ = self.first_difference(other, addresses)
            if differ is not None:
                out.append(f"steps differ: {differ}")
        return out


def record(fn) -> Recording:
    """``fn()`` run with every op it dispatches recorded (``Recording``)."""
    ops: list = []
    with _Reads(ops), _Ops(ops):
        fn()
    return Recording(ops)


def main(argv=None) -> int:
    """Print what a FusedAdamW step on one process dispatches (``--clip``, ``--moments``)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m zero_triton.tools.dispatch",
                                     description="What a warmed-up FusedAdamW step dispatches, "
                                                 "and what would stop a CUDA graph capturing it")
    parser.add_argument("--moments", default="fp32")
    parser.add_argument("--clip", type=float, default=None, help="max_grad_norm")
    parser.add_argument("--capturable", action="store_true")
    args = parser.parse_args(argv)
    from zero_triton import FusedAdamW
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    opt = FusedAdamW(params, lr=1e-3, moments=args.moments, max_grad_norm=args.clip,
                     capturable=args.capturable)
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(3):
        opt.step()
    first, second = record(opt.step), record(opt.step)
    print(f"{len(first.ops)} ops, {len(first.allocations)} allocating "
          f"({first.allocated_bytes()} bytes), {len(first.host_reads)} host reads")
    for line in first.problems(second):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
