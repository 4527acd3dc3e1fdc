"""Low-bit state on FSDP2 across world sizes: FusedAdamW over ``fully_shard`` DTensors
at one world size against another, fed the same global gradients, and a DCP checkpoint
saved at one world size loaded at another (``--compact``: the compact form,
``zero_triton.compact_state_dicts``; the optimizer's checkpoint bytes on disk are printed).

    python bench/fsdp2_reshard.py                         # the formats at 2 -> 1, 3, 4 and 4 -> 2
    python bench/fsdp2_reshard.py --formats int8 --pairs 2:3 --hsdp

For each state format and each pair ``a:b`` of world sizes (gloo CPU ranks): both train
the same model (fp32 or bf16 parameters by format) for ``--steps`` steps, each step's
gradient a fixed global tensor per parameter handed to every rank as its shard (so the
mean gradient is the same bits at every world size); then the full parameters and state
(``get_optimizer_state_dict(full_state_dict=True)``) of ``b`` are compared with ``a``'s
("trained"), and ``a``'s DCP checkpoint is loaded at ``b`` and compared with what ``a``
saved ("resumed"). Prints, per format and pair, how many of the tensors are the same
bits and the worst difference relative to the tensor's largest magnitude. ``--hsdp``:
a (2, N/2) replicate x shard mesh at the sizes that allow one.
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

FORMATS = {  # name: (parameter dtype, FusedAdamW keywords)
    "int8": (torch.float32, {"moments": "int8"}),
    "bf16": (torch.float32, {"moments": "bf16"}),
    "remainder+int8": (torch.bfloat16, {"master_weights": "remainder", "moments": "int8"}),
    "remainder8+int8": (torch.bfloat16, {"master_weights": "remainder8", "moments": "int8"}),
    "stochastic+int8": (torch.bfloat16, {"master_weights": "stochastic", "moments": "int8"}),
    "int4": (torch.float32, {"moments": "int4"}),
    "remainder8+int4": (torch.bfloat16, {"master_weights": "remainder8", "moments": "int4"}),
}


def model(dtype, wide: int = 1):
    """Shapes a transformer has: rows of 256 and 512 elements (blockable; ``wide`` times
    as wide), a thin weight (rows of 24) and biases; the last layer's 2 rows leave a
    rank of 3 or more an empty local shard."""
    torch.manual_seed(0)
    h = 256 * wide
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, h),
                               torch.nn.Tanh(), torch.nn.Linear(h, 2 * h), torch.nn.Tanh(),
                               torch.nn.Linear(2 * h, 2)).to(dtype)


def _mesh(world: int, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    if hsdp and world >= 4 and world % 2 == 0:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _sharded(dtype, mesh, wide):
    from torch.distributed.fsdp import fully_shard
    m = model(dtype, wide)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _bytes(obj) -> bytes:
    """``obj`` through torch.save: tensors cross the rank's queue as bytes, not as shared
    memory that dies with the rank."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _full(model, opt) -> bytes:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"param {i}": p.full_tensor().detach().float().clone() for i, p in enumerate(model.parameters())}
    for key, entry in full["state"].items():
        for name, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"{key}.{name}"] = v.detach().float().clone()
    return _bytes(out)


def _placed(opt, compact: bool):
    """The state dicts DCP sees: the compact form (``compact_state_dicts``) or torch's."""
    import contextlib

    import zero_triton
    return zero_triton.compact_state_dicts(opt) if compact else contextlib.nullcontext()


def _train(rank, world, fmt, steps, hsdp, save, compact=False, wide=1):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import distribute_tensor

    import zero_triton
    dtype, kw = FORMATS[fmt]
    mesh = _mesh(world, hsdp)
    m = _sharded(dtype, mesh, wide)
    opt = zero_triton.FusedAdamW(m.parameters(), lr=1e-2, **kw)
    for t in range(steps):
        for i, p in enumerate(m.parameters()):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * t + i)).to(dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()
    if save:
        with _placed(opt, compact):
            msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd}, checkpoint_id=f"{save}/model")
        dcp.save({"optim": osd}, checkpoint_id=f"{save}/optim")  # its bytes on their own
    return _full(m, opt)


def _resume(rank, world, fmt, hsdp, path, compact=False, wide=1):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import zero_triton
    dtype, kw = FORMATS[fmt]
    m = _sharded(dtype, _mesh(world, hsdp), wide)
    opt = zero_triton.FusedAdamW(m.parameters(), lr=1e-2, **kw)
    dcp.load({"model": get_state_dict(m, opt)[0]}, checkpoint_id=f"{path}/model")
    start = time.perf_counter()
    with _placed(opt, compact):  # the template: what dcp.load reads into
        msd, osd = get_state_dict(m, opt)
    dcp.load({"optim": osd}, checkpoint_id=f"{path}/optim")
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    return _full(m, opt), time.perf_counter() - start


def compare(a: dict, b: dict) -> tuple:
    """(tensors the same bits, tensors, worst |a - b| / max |a| over them)."""
    same, worst = 0, 0.0
    for k, x in a.items():
        y = b.get(k)
        if y is None or y.shape != x.shape:
            worst = float("inf")
            continue
        same += torch.equal(x, y)
        scale = x.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return same, len(a), worst


def pair(fmt: str, a: int, b: int, *, steps: int = 4, hsdp: bool = False,
         compact: bool = False, wide: int = 1) -> dict:
    """One row: ``fmt`` trained at ``a`` and ``b`` ranks, and ``a``'s checkpoint resumed
    at ``b``."""
    from dist_utils import run_ranks
    with tempfile.TemporaryDirectory() as tmp:
        saved = run_ranks(_train, a, fmt, steps, hsdp, tmp, compact, wide, timeout=600)[0]
        other = run_ranks(_train, b, fmt, steps, hsdp, None, False, wide, timeout=600)[0]
        resumed, load_s = run_ranks(_resume, b, fmt, hsdp, tmp, compact, wide, timeout=600)[0]
        disk = sum(f.stat().st_size for f in Path(tmp, "optim").rglob("*") if f.is_file())
    saved, other, resumed = (torch.load(io.BytesIO(x)) for x in (saved, other, resumed))
    return {"trained": compare(saved, other), "resumed": compare(saved, resumed),
            "bytes": disk, "load_s": load_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--pairs", default="2:1,2:3,2:4,4:2", help="a:b world sizes")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hsdp", action="store_true")
    ap.add_argument("--compact", action="store_true",
                    help="checkpoint the compact form (zero_triton.compact_state_dicts)")
    ap.add_argument("--wide", type=int, default=1, help="the blockable layers this many times wider")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    bad = 0
    print(f"{'format':<16} {'a -> b':>7} {'trained: same / all':>20} {'worst':>9} "
          f"{'resumed: same / all':>20} {'worst':>9} {'optimizer bytes':>16} {'load s':>7}")
    for fmt in args.formats.split(","):
        for ab in args.pairs.split(","):
            a, b = (int(x) for x in ab.split(":"))
            row = pair(fmt, a, b, steps=args.steps, hsdp=args.hsdp, compact=args.compact,
                       wide=args.wide)
            (t_same, t_all, t_worst), (r_same, r_all, r_worst) = row["trained"], row["resumed"]
            bad += (t_same != t_all) + (r_same != r_all)
            print(f"{fmt:<16} {a:>3} -> {b:<2} {f'{t_same} / {t_all}':>20} {t_worst:>9.2e} "
                  f"{f'{r_same} / {r_all}':>20} {r_worst:>9.2e} {row['bytes']:>16} "
                  f"{row['load_s']:>7.3f}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
