"""One rank of ``python -m zero_triton profile``: train the GPT under torch.profiler.

For each configuration (ZeroAdamW, then DDP + torch.optim.AdamW on the same model and
batches) every iteration runs as

    zero_triton.iteration
      zero_triton.forward     model(idx, targets) -> loss
      zero_triton.backward    loss.backward()
      zero_triton.optimizer   opt.step()          (ZeroAdam: reduce_scatter, adam_step, all_gather)
      opt.zero_grad()

(record_function ranges, NVTX ranges too on CUDA, where each range ends with a device
synchronize so that it holds its own device work). ``--warmup`` iterations run with
the profiler warming up and are not recorded, ``--steps`` are. Then, without the
profiler: one iteration with memory read around each phase, and for ZeroAdam the
Adam step's bandwidth against a copy and the collectives timed on its flat buffers.
"""
from __future__ import annotations

import contextlib
import gc
import gzip
import inspect
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_triton.comm.group import phase
from zero_triton.memory.model import stage_bytes
from zero_triton.memory.probe import MemoryProbe
from zero_triton.optim.interface import internals
from zero_triton.tools import outputs
from zero_triton.tools.gpt import GPTConfig, build_gpt, synthetic_batch
from zero_triton.tools.profiling import bandwidth, timeline, wire

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
N_BATCHES = 4  # distinct batches per rank, cycled


def zero_options(args) -> dict:
    """The ZeroAdam arguments of ``--stage``: only those its signature has. ``--overlap``
    is ``zero_triton.overlap(model, opt)``, applied in ``_build``."""
    from zero_triton import ZeroAdam
    accepted = inspect.signature(ZeroAdam.__init__).parameters
    return {"stage": args.stage} if "stage" in accepted else {}


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                     n_head=args.heads, n_embd=args.width)


def torch_adamw(params):
    """torch.optim.AdamW with fused=True where torch supports it here, else foreach;
    returns (optimizer, which)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                 fused=True), "fused=True"
    except (RuntimeError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                  foreach=True), f"foreach=True (fused=True: {why})")


# kineto prints 'USDT: ... profiler_start' and 'STAGE: ...' on stderr at each start
# and stop; everything else a profiler call prints gets through.
_KINETO_CHATTER = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d [^\]]*\.cpp:\d+\] ")


@contextlib.contextmanager
def _quiet_kineto():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not _KINETO_CHATTER.match(line):
                    sys.stderr.write(line)
            sys.stderr.flush()


def _build(name, args, device):
    """(bare model, model to call, optimizer, label) of configuration ``name``."""
    from zero_triton import ZeroAdamW
    dtype = DTYPES[args.dtype]
    model = build_gpt(model_config(args), device=device, dtype=dtype, seed=0)
    if name == "zero":
        wire_options = {k: v for k, v in (("reduce_dtype", getattr(args, "reduce_dtype", None)),
                                          ("gather_dtype", getattr(args, "gather_dtype", None))) if v}
        mesh = getattr(args, "mesh", None)
        if mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh
            wire_options["device_mesh"] = init_device_mesh(device.type, tuple(mesh),
                                                           mesh_dim_names=("replicate", "shard"))
        opt = ZeroAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                        backend=args.backend, **zero_options(args), **wire_options)
        backend = opt.backend
        extra = "".join(f", {k}={v!r}" for k, v in wire_options.items() if k != "device_mesh")
        if mesh is not None:
            extra += f", mesh {mesh[0]} x {mesh[1]}"
        if args.overlap:
            import zero_triton
            zero_triton.overlap(model, opt)
        return model, model, opt, (f"ZeroAdamW (ZeRO-{args.stage}{', overlap' if args.overlap else ''}"
                                   f"{extra}, backend {backend})")
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    opt, how = torch_adamw(model.parameters())
    state = "" if dtype == torch.float32 else f", state in {args.dtype}, no fp32 master"
    return model, ddp, opt, f"DDP + torch.optim.AdamW({how}{state})"


def _trace_path(args, name: str, rank: int) -> Path:
    folder = Path(args.out) if name == "zero" else Path(args.out) / name
    return folder / f"trace_rank{rank}.json{'.gz' if args.gzip else ''}"


def _finish_trace(raw: Path, final: Path, splits) -> None:
    """Add the analysis rows to the exported trace and write it where it belongs."""
    with open(raw) as fh:
        trace = json.load(fh)
    timeline.annotate(trace, splits)
    final.parent.mkdir(parents=True, exist_ok=True)
    with outputs.replacing(final, "wb") as raw_fh:
        with (gzip.open(raw_fh, "wt") if final.suffix == ".gz" else io.TextIOWrapper(raw_fh)) as fh:
            json.dump(trace, fh)


def _model_states(name, model, opt, world: int) -> dict:
    """Bytes of params, grads and optimizer state: the memory model's prediction
    (zero_triton.memory.model) and what this rank holds."""
    params = sum(p.numel() for p in model.parameters())
    size = next(model.parameters()).element_size()
    if name == "zero":  # fp32 moments, and an fp32 master for 16-bit parameters
        per = dict(master_bytes=0 if size == 4 else 4, moment_bytes=8)
    else:  # torch's AdamW keeps its moments in the parameters' dtype, no master
        per = dict(master_bytes=0, moment_bytes=2 * size)
    stage = f"zero{opt.stage}" if name == "zero" else "ddp"
    rows = stage_bytes(params, world, param_bytes=size, grad_bytes=size, **per)
    row = next(r for r in rows if r["stage"] == stage)
    predicted = {"params": row["params_bytes"], "grads": row["grads_bytes"],
                 "optimizer_state": row["optimizer_bytes"], "total": row["bytes_per_rank"]}
    if name == "zero":
        report = opt.memory_report()
        measured = {"params": report["params"], "grads": report["grads"],
                    "optimizer_state": report["optimizer_state"], "padding": report["padding"]}
    else:
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
        measured = {"params": size(model.parameters()),
                    "grads": size(p.grad for p in model.parameters()),
                    "optimizer_state": size(v for s in opt.state.values() for v in s.values())}
    measured["total"] = sum(v for k, v in measured.items() if k != "padding")
    return {"stage": stage, "params": params, "predicted": predicted, "measured": measured}


def _iteration_fn(net, opt, batches, device):
    """One training iteration in the harness's ranges; returns the loss."""
    cuda = device.type == "cuda"

    def sync():  # each range holds its own device work
        if cuda:
            torch.cuda.synchronize(device)

    def iteration(i: int):
        idx, targets = batches[i % len(batches)]
        with phase(timeline.ITERATION, cuda):
            with phase(timeline.FORWARD, cuda):
                _, loss = net(idx, targets)
                sync()
            with phase(timeline.BACKWARD, cuda):
                loss.backward()
                sync()
            with phase(timeline.OPTIMIZER, cuda):
                opt.step()
                sync()
            opt.zero_grad()
        return loss
    return iteration, sync


def _profiled(iteration, sync, args, trace: Path, device, wait_params=None):
    """Run the warm-up and profiled iterations under torch.profiler, write ``trace``
    with the analysis rows added; returns (IterationSplit per profiled iteration, wall
    clock ms of each, measured around it apart from the profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace.parent.mkdir(parents=True, exist_ok=True)
    raw = Path(outputs.new_temporary(trace.with_name(f"raw_{trace.name.split('.')[0]}"), ".json"))
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=0, warmup=args.warmup, active=args.steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(raw)))
    walls = []
    try:
        with _quiet_kineto():
            prof.start()
        try:
            for i in range(args.warmup + args.steps):
                sync()
                t0 = time.perf_counter()
                iteration(i)
                sync()
                walls.append((time.perf_counter() - t0) * 1e3)
                if i == args.warmup + args.steps - 1 and wait_params is not None:
                    # overlap(): the last step's all-gathers end inside the recorded
                    # window (a gloo collective outliving it crashed ranks, torch 2.13).
                    wait_params()
                with _quiet_kineto():
                    prof.step()
        finally:
            with _quiet_kineto():
                prof.stop()
        if not raw.exists():
            raise RuntimeError(f"torch.profiler wrote no trace to {raw}")
        with open(raw) as fh:
            splits = timeline.split_iterations(json.load(fh)["traceEvents"])
        if len(splits) != args.steps:
            raise RuntimeError(f"the trace holds {len(splits)} iterations, {args.steps} were profiled")
        _finish_trace(raw, trace, splits)
    finally:
        raw.unlink(missing_ok=True)
    return splits, walls[args.warmup:]


def _memory_iteration(name, model, net, opt, batch, world, device):
    """One more iteration, no profiler: memory around each phase, and the model states
    (read after the step, before zero_grad frees DDP's gradients)."""
    probe = MemoryProbe(device)
    idx, targets = batch
    comm = internals(opt).comm if name == "zero" else None
    if comm is not None:  # the bytes this rank sends over the iteration, per collective
        comm.reset_wire()
    probe.phases["before"] = {"current": probe.snapshot()["current"], "peak": None}
    with probe.phase("forward"):
        _, loss = net(idx, targets)
    with probe.phase("backward"):
        loss.backward()
    with probe.phase("optimizer"):
        opt.step()
    opt.wait_params() if comm is not None else None
    sent = dict(comm.wire) if comm is not None else None
    states = _model_states(name, model, opt, opt.world_size if name == "zero" else world)
    with probe.phase("zero_grad"):
        opt.zero_grad()
    return {"how": probe.how, "phases": probe.phases, "sent": sent}, states, float(loss.detach().float())


def _zero_figures(opt, splits, world, device, args) -> dict:
    """ZeroAdam only: the Adam step against a copy, and the wire table on its buffers."""
    shard = sum(f.layout.shard_numel for _, f in internals(opt).shards())
    dist.barrier()  # every rank copies at once, as every rank steps at once
    copy_s = bandwidth.copy_seconds(device, bandwidth.BYTES_PER_PARAM * shard // 2)
    adam = bandwidth.adam_figures(splits, shard, device, opt.backend, copy_s)
    buffers = wire.buffers_of(opt)
    table = wire.formula(buffers, world, dist.get_backend())
    return {"adam": adam, "wire": {**wire.achieved(table, wire.measure(buffers, device, args.repeats)),
                                   "buffers": buffers}}


def _run_config(name, args, rank, world, device, say) -> dict:
    model, net, opt, label = _build(name, args, device)
    cfg = model_config(args)
    batches = [synthetic_batch(cfg, args.batch, args.seq, seed=10_000 * rank + i, device=device)
               for i in range(N_BATCHES)]
    iteration, sync = _iteration_fn(net, opt, batches, device)
    say(f"{label}: {args.warmup} warm-up + {args.steps} profiled iterations")
    trace = _trace_path(args, name, rank)
    splits, walls = _profiled(iteration, sync, args, trace, device, getattr(opt, "wait_params", None))
    memory, states, loss = _memory_iteration(name, model, net, opt, batches[0], world, device)
    result = {
        "label": label, "trace": str(trace), "loss": loss,
        "iterations": [{"iteration_ms": s.iteration_ms, "wall_ms": w, "rows": s.rows,
                        "hidden": s.hidden, "in_flight": s.in_flight} for s, w in zip(splits, walls)],
        "mean": {**timeline.mean_split(splits), "wall_ms": sum(walls) / len(walls)},
        "memory": memory, "model_states": states,
    }
    if name == "zero":
        result.update(_zero_figures(opt, splits, world, device, args))
    del model, net, opt, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_rank(args, rank: int, world: int, device) -> dict:
    """Everything this rank measured: {"rank", "configs": {"zero": ..., "ddp": ...}}."""
    def say(text):
        if rank == 0:
            print(f"zero_triton profile: {text}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    out = {"rank": rank, "configs": {}}
    for name in ("zero", "ddp") if args.ddp else ("zero",):
        out["configs"][name] = _run_config(name, args, rank, world, device, say)
    return out


def collectives_rank(args, rank: int, world: int, device) -> dict:
    """``--collectives-only``: the wire table on a synthetic flat buffer of ``--size``
    elements of ``--dtype``."""
    buffers = wire.synthetic_buffers(args.size, DTYPES[args.dtype], world)
    table = wire.formula(buffers, world, dist.get_backend())
    return {"rank": rank, "wire": {**wire.achieved(table, wire.measure(buffers, device, args.repeats)),
                                   "buffers": buffers}}


def remove_stale_outputs(args, world: int) -> None:
    """Delete what an earlier run left in ``--out`` that this run would not overwrite
    and a reader would take for this run's: traces of ranks beyond this world size or
    in the other format, DDP traces when the baseline is off, error tracebacks. Only
    files of our own names are touched."""
    out = Path(args.out)
    for folder, keep in ((out, True), (out / "ddp", args.ddp)):
        for path in folder.glob("trace_rank*.json*"):
            m = re.fullmatch(r"trace_rank(\d+)\.json(\.gz)?", path.name)
            if m is None or path.is_dir():
                continue
            if not keep or int(m.group(1)) >= world or bool(m.group(2)) != args.gzip:
                path.unlink()
    for path in out.glob("error_rank*.txt"):
        if re.fullmatch(r"error_rank\d+\.txt", path.name) and not path.is_dir():
            path.unlink()
