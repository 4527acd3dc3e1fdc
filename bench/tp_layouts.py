"""Low-bit state at every FSDP2 + tensor-parallel layout: the same bits, and checkpoints
that load across layouts.

    python bench/tp_layouts.py                                  # every layout, format and pair
    python bench/tp_layouts.py --layouts 2x2,1x4 --formats int8 --kinds compact

A model with the shapes tensor parallelism makes hard (``Net``): a ColwiseParallel weight
whose rows are 256 long (under ``fully_shard`` over tensor parallelism its placements are
a ``_StridedShard``), a RowwiseParallel weight (``Shard(1)``) whose part of each row is 256
elements at tp=2 and 128 at tp=4 (its int8 blocks straddle two ranks at tp=4), another
whose rows of 384 are cut into 192 and 96 (its int4 blocks of 128 straddle ranks at both
tp sizes; for int8 its rows are not whole blocks: fp32 moments), a 300-row layer, 1-row
layers (empty local shards at dp >= 2) and biases. The layouts: ``DxT`` a 2-D
(dp, tp) mesh, tensor parallel over tp and ``fully_shard`` over dp; ``dpN`` a 1-D mesh of N
ranks, ``fully_shard`` only (``dp1``: one rank). FusedAdamW in each format, fed the same
global gradients (a fixed tensor per parameter and step, handed to each rank as its shard).

Two phases, gloo CPU ranks:

1. **trained**: every layout trains ``--steps`` steps; its full parameters and state
   (``get_optimizer_state_dict(full_state_dict=True)``) are compared with the first
   layout's; a DCP checkpoint is saved, in the compact form
   (``zero_triton.compact_state_dicts``) and in torch's.
2. **loaded**: every layout loads every layout's checkpoint of each kind; the state it
   then holds is compared with what was saved, and after two more steps with the first
   layout's own two more steps.

Prints, per format, the tensors that are the same bits out of the total at each step
and rank 0's median ``step()`` time at each layout (after the first; a small model on
shared cores: where the rows path's cost shows, not a benchmark), and every pair that
loaded otherwise; exit status 1 where any differ.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

FORMATS = {  # name: (parameter dtype, FusedAdamW keywords)
    "int8": (torch.float32, {"moments": "int8"}),
    "remainder+int8": (torch.bfloat16, {"master_weights": "remainder", "moments": "int8"}),
    "remainder8+int8": (torch.bfloat16, {"master_weights": "remainder8", "moments": "int8"}),
    "stochastic+int8": (torch.bfloat16, {"master_weights": "stochastic", "moments": "int8"}),
    "bf16": (torch.float32, {"moments": "bf16"}),
    "stochastic+bf16": (torch.bfloat16, {"master_weights": "stochastic", "moments": "bf16"}),
    "int8 offloaded": (torch.float32, {"moments": "int8", "offload": "cpu"}),
    "int4": (torch.float32, {"moments": "int4"}),
    "remainder8+int4": (torch.bfloat16, {"master_weights": "remainder8", "moments": "int4"}),
}
LAYOUTS = ("2x2", "1x4", "4x1", "dp4", "dp2", "dp3", "dp1")
KINDS = ("compact", "torch")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 512)     # ColwiseParallel: rows of 256, strided under FSDP
        self.down = torch.nn.Linear(512, 512)   # RowwiseParallel: 256 of a row per rank at tp=2, 128 at tp=4
        self.mid = torch.nn.Linear(512, 300)    # 300 rows
        self.gate = torch.nn.Linear(512, 1)     # one row: empty local shards
        self.head = torch.nn.Linear(300, 1)     # one row of 300 (not a multiple of 256)
        self.side = torch.nn.Linear(384, 64)    # RowwiseParallel: 192 of a row per rank at tp=2, 96 at tp=4


def world_of(layout: str) -> int:
    if layout.startswith("dp"):
        return int(layout[2:])
    d, t = layout.split("x")
    return int(d) * int(t)


_MESHES: dict = {}


def build(layout: str, dtype):
    """``Net`` in ``dtype`` sharded at ``layout`` (every rank of the group calls it)."""
    import logging
    from torch.distributed.device_mesh import init_device_mesh
    # DTensor's note that a 2-D mesh gathers in two steps, once per full state read
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = Net().to(dtype)
    if layout not in _MESHES:  # one mesh per layout and process: its groups made once
        if layout.startswith("dp"):
            _MESHES[layout] = init_device_mesh("cpu", (world_of(layout),))
        else:
            d, t = (int(x) for x in layout.split("x"))
            _MESHES[layout] = init_device_mesh("cpu", (d, t), mesh_dim_names=("dp", "tp"))
    mesh = _MESHES[layout]
    if layout.startswith("dp"):
        dp = mesh
    else:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                             "side": RowwiseParallel()})
        dp = mesh["dp"]
    for layer in net.children():
        fully_shard(layer, mesh=dp)
    fully_shard(net, mesh=dp)
    return net


def _grads(net, step: int, dtype) -> None:
    """The same global gradient per parameter and step at every layout, each rank given
    its shard of it."""
    from torch.distributed.tensor import distribute_tensor
    for i, (name, p) in enumerate(sorted(net.named_parameters())):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i)).to(dtype)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _full(net, opt) -> dict:
    """Every parameter and state tensor, whole, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    full = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"param {n}": p.full_tensor().detach().clone() for n, p in net.named_parameters()}
    for key, entry in full["state"].items():
        for name, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"{key}.{name}"] = v.detach().clone()
    return out


def _optimizer(net, fmt):
    import zero_triton
    return zero_triton.FusedAdamW(net.parameters(), lr=1e-2, **FORMATS[fmt][1])


def _state_dicts(net, opt, kind):
    import contextlib

    import zero_triton
    from torch.distributed.checkpoint.state_dict import get_state_dict
    with zero_triton.compact_state_dicts(opt) if kind == "compact" else contextlib.nullcontext():
        return get_state_dict(net, opt)


def _train(rank, world, layouts, formats, steps, root):
    """Phase 1 at one world size: each of ``layouts`` trains each format and saves."""
    import torch.distributed.checkpoint as dcp
    out = {}
    for layout in layouts:
        for fmt in formats:
            dtype = FORMATS[fmt][0]
            net = build(layout, dtype)
            opt = _optimizer(net, fmt)
            took = []
            for t in range(steps):
                _grads(net, t, dtype)
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                took.append(time.perf_counter() - start)
                opt.zero_grad()
            for kind in KINDS:
                msd, osd = _state_dicts(net, opt, kind)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{layout}/{fmt}/{kind}")
            full = _full(net, opt)
            for t in range(steps, steps + 2):  # the continuation every load is held to
                _grads(net, t, dtype)
                opt.step()
                opt.zero_grad()
            out[layout, fmt] = _bytes((full, _full(net, opt), statistics.median(took[1:] or took)))
    return out if rank == 0 else None


def _load(rank, world, layouts, sources, formats, kinds, steps, root):
    """Phase 2 at one world size: each of ``layouts`` loads every source's checkpoints."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    out = {}
    for layout in layouts:
        for fmt in formats:
            dtype = FORMATS[fmt][0]
            for source in sources:
                for kind in kinds:
                    try:
                        net = build(layout, dtype)
                        opt = _optimizer(net, fmt)
                        msd, osd = _state_dicts(net, opt, kind)  # the template dcp.load fills
                        sd = {"model": msd, "optim": osd}
                        dcp.load(sd, checkpoint_id=f"{root}/{source}/{fmt}/{kind}")
                        set_state_dict(net, opt, model_state_dict=sd["model"],
                                       optim_state_dict=sd["optim"])
                        loaded = _full(net, opt)
                        for t in range(steps, steps + 2):
                            _grads(net, t, dtype)
                            opt.step()
                            opt.zero_grad()
                        out[layout, fmt, source, kind] = _bytes((loaded, _full(net, opt)))
                    except BaseException as exc:  # a pair that does not load is a row (DCP raises
                        # CheckpointException, a BaseException), not the end
                        out[layout, fmt, source, kind] = f"{type(exc).__name__}: {_reason(exc)}"
    return out if rank == 0 else None


def _reason(exc: BaseException) -> str:
    """The first line that says what went wrong (DCP's exception wraps every rank's)."""
    import re
    found = re.findall(r"(?:RuntimeError|ValueError|KeyError): ([^\n]*)", str(exc))
    return (found[0] if found else str(exc).splitlines()[0] if str(exc) else "")[:160]


def compare(a: dict, b: dict) -> tuple:
    """(tensors the same bits, tensors, names that differ)."""
    differ = [k for k, x in a.items()
              if k not in b or b[k].shape != x.shape or not torch.equal(x, b[k])]
    return len(a) - len(differ), len(a), differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-load", action="store_true", help="phase 1 only")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_utils import run_ranks
    layouts, formats, kinds = (s.split(",") for s in (args.layouts, args.formats, args.kinds))
    by_world: dict = {}
    for layout in layouts:
        by_world.setdefault(world_of(layout), []).append(layout)
    bad = 0
    with tempfile.TemporaryDirectory() as root:
        trained = {}
        for world, group in by_world.items():
            got = run_ranks(_train, world, group, formats, args.steps, root, timeout=1800)[0]
            trained.update({k: torch.load(io.BytesIO(v)) for k, v in got.items()})
        ref = layouts[0]
        print(f"trained ({args.steps} steps, then 2 more), against {ref}: tensors the same bits")
        for fmt in formats:
            cells = []
            for layout in layouts:
                s1, n1, d1 = compare(trained[ref, fmt][0], trained[layout, fmt][0])
                s2, n2, d2 = compare(trained[ref, fmt][1], trained[layout, fmt][1])
                bad += (s1 != n1) + (s2 != n2)
                cells.append(f"{layout} {s1}/{n1} {s2}/{n2}")
                if d1 or d2:
                    print(f"  {fmt} {layout}: differ {sorted(set(d1) | set(d2))[:8]}")
            print(f"  {fmt:<16} " + "  ".join(cells), flush=True)
            print(f"  {'step ms, rank 0':<16} " + "  ".join(
                f"{layout} {trained[layout, fmt][2] * 1e3:.1f}" for layout in layouts), flush=True)
        if args.no_load:
            return 1 if bad else 0
        loaded = {}
        for world, group in by_world.items():
            got = run_ranks(_load, world, group, layouts, formats, kinds, args.steps, root,
                            timeout=3600)[0]
            loaded.update(got)
    print("loaded (saved at a, loaded at b): pairs whose state is the same bits as saved, "
          "and after two more steps as the first layout's")
    for fmt in formats:
        for kind in kinds:
            ok = total = 0
            failures = []
            for a in layouts:
                for b in layouts:
                    total += 1
                    got = loaded[b, fmt, a, kind]
                    if isinstance(got, str):
                        failures.append(f"{a}->{b}: {got}")
                        continue
                    got = torch.load(io.BytesIO(got))
                    s1, n1, d1 = compare(trained[a, fmt][0], got[0])
                    s2, n2, d2 = compare(trained[ref, fmt][1], got[1])
                    if s1 == n1 and s2 == n2:
                        ok += 1
                    else:
                        failures.append(f"{a}->{b}: {s1}/{n1} loaded, {s2}/{n2} stepped "
                                        f"(differ {sorted(set(d1) | set(d2))[:4]})")
            bad += total - ok
            print(f"  {fmt:<16} {kind:<8} {ok}/{total} pairs", flush=True)
            for f in failures[:6]:
                print(f"      {f}")
            if len(failures) > 6:
                print(f"      ... {len(failures) - 6} more")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
