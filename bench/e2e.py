#!/usr/bin/env python
"""Training iterations end to end, as users run them: DDP + AdamW vs torch's ZeRO vs
ZeroAdamW.

The baseline for hiding ZeroAdam's communication: every configuration trains the same
GPT (``zero_triton.tools.gpt``, same weights, same batches) -- forward, backward, optimizer
step, zero_grad -- and we report per world size:

* median ms per iteration (min-max) over ``--steps`` rounds after ``--warmup``; each
  round runs every configuration once, in an order rotated round by round. A
  configuration's window starts after a barrier, runs ``--iters`` iterations back to back
  (the next forward waits for the last step's all-gathers, as in training) and ends once
  the last step's parameters are usable (``wait_params()`` for ZeroAdamW); its time per
  iteration is the window over ``--iters``, the slowest rank's. ``--iters 1`` times
  single iterations, its gathers still inside the window;
* the ratio to DDP (configuration median / DDP median: above 1 is slower);
* exposed communication as a share of the iteration, from three more iterations recorded
  by torch.profiler (per rank the median iteration by that share; mean over ranks) and cut by ``zero_triton.tools.profiling.timeline`` (the same reading as
  ``python -m zero_triton profile``: time the training thread waits for a collective);
* peak memory per rank over one iteration (on CPU the process's resident set size,
  VmHWM after a reset through /proc/self/clear_refs; on a GPU max_memory_allocated), and on
  CPU with glibc the bytes malloc had handed out at most ("in use", sampled every ms): the
  RSS peak less that is freed memory the allocator kept.

Profile and memory run in a fresh set of ranks per configuration, which holds that
configuration alone; the timed rounds hold all of them in one set of ranks, so that
they are interleaved. Configurations:

  ddp         DDP + torch.optim.AdamW (fused=True where torch has it, else foreach)
  torch_zero  torch's ZeroRedundancyOptimizer(AdamW, the same flag) + DDP
  zero_s1            ZeroAdamW, one bucket: reduce-scatter and all-gather inside step()
  zero_s1_buckets    ZeroAdamW, 25 MiB buckets: reduce-scatters start during backward
  zero_s1_overlap    the same with zero_triton.overlap(model, opt): all-gathers waited by
                     the next forward, module by module

  zero_s1_int8       the buckets' configuration with moments="int8" (8-bit Adam state)
  zero_s1_hsdp       the buckets' configuration sharded over a (2, N/2) (replicate, shard)
                     mesh: hybrid sharding (device_mesh=); at 2 ranks the mesh is (1, 2)
  zero_s1_q          the buckets' configuration with int8 collectives: reduce_dtype="int8"
                     (error feedback on), and gather_dtype="int8" with --dtype bf16/fp16
  zero_s1_hsdp_q     the 2-D mesh with int8 collectives (both hops of the average)
  zero_s1_offload    the buckets' configuration with offload="cpu" (the state in host
                     memory, stepped there bucket by bucket; on CPU ranks the copies are
                     host to host: what it shows is the pipeline's own cost)
  zero_s1_offload_half  the same with offload_fraction=0.5: each rank's shard half on
                     the device, half in host memory, both stepped at once

and the same seven for ZeRO-2 (``stage=2``: zero_s2, zero_s2_buckets, zero_s2_overlap,
zero_s2_int8, zero_s2_hsdp, zero_s2_offload, zero_s2_offload_half), and

  zero_s2_release    ZeRO-2's overlap configuration with grad_release=True: each bucket's
                     shard stepped in backward as its average lands, the average let go
The peers a user would pick instead:

  fsdp2              torch's FSDP2 (fully_shard per block and the root, reshard after
                     forward) + torch.optim.AdamW on the DTensors
  fsdp2_keep         the same without resharding after forward (ZeRO-2-like)
  fsdp2_hsdp         FSDP2 over the same (2, N/2) mesh: HSDP
  ds_z1, ds_z2       DeepSpeed ZeRO-1 / ZeRO-2 (its AdamW, no clipping), and with
  ds_z1_overlap ...  overlap_comm; when deepspeed is installed (pip install -e '.[peers]')
  ds_z3, ds_z3_hpz   DeepSpeed ZeRO-3, and ZeRO++'s hpZ (a secondary copy of the weights
                     over N/2 ranks). ZeRO++'s qwZ and qgZ do not run on CPU: DeepSpeed
                     0.19.8 raises "This op had not been implemented on CPU backend" (its
                     quantizer op) at the first step
  torchao_offload    torchao's CPUOffloadOptimizer(AdamW, fused) + DDP: the optimizer state
                     in host memory (CUDA only; when torchao is installed)

and the limit beside them:

  compute            forward, backward and 1/N of the step (this rank's shard, our kernel)
                     with no communication: what an iteration would take if communication
                     were free; "over compute" = 1 - compute / configuration.

``--configs`` picks a subset (ddp always runs: the ratios are to it).

    python bench/e2e.py                          # 2 and 4 gloo ranks on CPU, one thread each
    python bench/e2e.py --ranks 2 --steps 20 --dtype bf16
    python bench/e2e.py --device cuda --layers 12 --width 768 --heads 12 --vocab 50304 \
        --seq 1024 --batch 8                     # NCCL, one rank per local GPU

Writes e2e_<device>.csv, .json and .png to ``--out`` (bench/results/e2e).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_triton.tools.bench.providers import deepspeed_without_shm
from zero_triton.tools.gpt import GPT, build_gpt, synthetic_batch
from zero_triton.tools.profiling import launch, timeline
from zero_triton.tools.profiling.harness import (BETAS, DTYPES, LR, WEIGHT_DECAY, model_config,
                                           torch_adamw)
from zero_triton.tools.profiling.cli import check_out_dir
from zero_triton.memory.probe import MemoryProbe
from zero_triton.tools.units import positive_number, whole_number

PROFILED = 3  # profiled iterations per configuration and rank
DEFAULT_MINUTES = "about 20 minutes"  # python bench/e2e.py, every peer (DeepSpeed installed), 2 quiet cores
N_BATCHES = 4  # distinct batches per rank, cycled; every configuration sees the same
MAX_CPU_RANKS = 64
COLUMNS = ["world_size", "config", "label", "rounds", "median_ms", "min_ms", "max_ms", "x_ddp",
           "x_ddp_paired", "x_ddp_low", "x_ddp_high",
           "over_compute_pct", "exposed_comm_pct", "exposed_comm_ms", "hidden_comm_ms", "profiled_ms",
           "wire_mb", "across_mb", "peak_mb", "start_mb", "in_use_peak_mb", "in_use_start_mb", "kept_free_mb", "loss",
           "status", "note"]


# -- configurations ------------------------------------------------------------------------

def zero_variants(bucket_cap_mb):
    """The variants to run, [(key, ZeroAdamW kwargs, label, overlap?)]. Per ZeRO stage:
    one bucket (everything communicated inside step(), as before buckets), buckets
    (reduce-scatters started during backward, all-gathers waited in step()), and buckets
    with ``zero_triton.overlap`` (all-gathers waited by the next forward)."""
    cap = bucket_cap_mb or 25
    variants = []
    for s in (1, 2):
        st = {"stage": s}
        variants += [
            (f"zero_s{s}", {**st, "bucket_cap_mb": None}, f"ZeroAdamW (ZeRO-{s}, one bucket)", False),
            (f"zero_s{s}_buckets", {**st, "bucket_cap_mb": cap},
             f"ZeroAdamW (ZeRO-{s}, {cap:g} MiB buckets)", False),
            (f"zero_s{s}_overlap", {**st, "bucket_cap_mb": cap},
             f"ZeroAdamW (ZeRO-{s}, buckets + overlap())", True),
            (f"zero_s{s}_int8", {**st, "bucket_cap_mb": cap, "moments": "int8"},
             f"ZeroAdamW (ZeRO-{s}, buckets, int8 moments)", False),
            (f"zero_s{s}_hsdp", {**st, "bucket_cap_mb": cap, "device_mesh": HSDP},
             f"ZeroAdamW (ZeRO-{s}, buckets, 2-D mesh)", False),
            (f"zero_s{s}_offload", {**st, "bucket_cap_mb": cap, "offload": "cpu"},
             f"ZeroAdamW (ZeRO-{s}, buckets, offload='cpu')", False),
            (f"zero_s{s}_offload_half", {**st, "bucket_cap_mb": cap, "offload": "cpu",
                                         "offload_fraction": 0.5},
             f"ZeroAdamW (ZeRO-{s}, buckets, offload_fraction=0.5)", False)]
    # Gradient release: each bucket's shard stepped in backward as its average lands.
    variants.append(("zero_s2_release", {"stage": 2, "bucket_cap_mb": cap, "grad_release": True},
                     "ZeroAdamW (ZeRO-2, buckets + overlap(), grad_release)", True))
    quantized = {"stage": 1, "bucket_cap_mb": cap, "reduce_dtype": "int8", "gather_dtype": GATHER}
    variants += [
        ("zero_s1_q", quantized, "ZeroAdamW (ZeRO-1, buckets, int8 wire)", False),
        ("zero_s1_hsdp_q", {**quantized, "device_mesh": HSDP},
         "ZeroAdamW (ZeRO-1, buckets, 2-D mesh, int8 wire)", False)]
    return variants


GATHER = "int8 where it applies"  # gather_dtype="int8" for fp16/bf16 parameters only


HSDP = "hsdp"  # a variant's device_mesh: the (replicate, shard) mesh of ``hsdp_shape``


def hsdp_shape(world: int) -> tuple:
    """The hybrid configurations' mesh: two replicas where the ranks split in two pairs
    or more, else one."""
    return (2, world // 2) if world >= 4 and world % 2 == 0 else (1, world)


def hsdp_mesh(device):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, hsdp_shape(dist.get_world_size()),
                            mesh_dim_names=("replicate", "shard"))


PEERS = [("fsdp2", "FSDP2 (reshard after forward) + AdamW"),
         ("fsdp2_keep", "FSDP2 (no reshard after forward) + AdamW"),
         ("fsdp2_hsdp", "FSDP2 HSDP (2-D mesh) + AdamW")]
DEEPSPEED = [(f"ds_z{s}{'_overlap' if o else ''}", f"DeepSpeed ZeRO-{s}{', overlap_comm' if o else ''}")
             for s in (1, 2) for o in (False, True)] + [
    ("ds_z3", "DeepSpeed ZeRO-3"), ("ds_z3_hpz", "DeepSpeed ZeRO++ hpZ (ZeRO-3, weights over N/2)")]
COMPUTE = ("compute", "compute alone (fwd, bwd, 1/N of the step; no comm)")
TORCHAO = [("torchao_offload", "torchao CPUOffloadOptimizer(AdamW) + DDP")]


def torchao_missing(device: str) -> str | None:
    """Why torchao's CPU offload cannot run here, or None (it steps CUDA parameters)."""
    import importlib.util
    if device != "cuda":
        return "torchao's CPUOffloadOptimizer offloads CUDA parameters only"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    return None


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed peers cannot run here, or None."""
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install -e '.[peers]')"
    return None


def configurations(args):
    """[(key, label)] in table order; ``args.variants`` holds ZeroAdamW's kwargs."""
    every = [("ddp", "DDP + AdamW"), ("torch_zero", "ZeroRedundancyOptimizer(AdamW) + DDP")] + \
        [(key, label) for key, _, label, _ in args.variants] + PEERS + \
        ([] if deepspeed_missing() else DEEPSPEED) + \
        ([] if torchao_missing(getattr(args, "device", "cpu")) else TORCHAO) + [COMPUTE]
    wanted = getattr(args, "configs", None)
    return [(k, label) for k, label in every if wanted is None or k in wanted or k == "ddp"]


class _DeepSpeed:
    """A DeepSpeed engine as the loop drives an optimizer: its own backward and step
    (which zeroes the gradients)."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def zero_grad(self):
        pass


class _ComputeAlone:
    """The step of 1/N of the parameters on a buffer of its own (our fused kernel, as
    ZeroAdamW steps a rank's shard), and the model's gradients dropped."""

    def __init__(self, model, world, device):
        import zero_triton
        self.model = model
        n = -(-sum(p.numel() for p in model.parameters()) // world)
        dtype = next(model.parameters()).dtype
        self.shard = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        self.shard.grad = torch.zeros_like(self.shard)
        self.opt = zero_triton.FusedAdamW([self.shard], lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)


def _fsdp2(model, reshard, mesh=None):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
    fully_shard(model, reshard_after_forward=reshard, mesh=mesh)


def _deepspeed(key, model, args):
    import logging
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_SIZE", str(dist.get_world_size()))
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if args.no_deepspeed_shm:
        deepspeed_without_shm()
    bucket = int((args.bucket_cap_mb or 25) * 2**20) // DTYPES[args.dtype].itemsize
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
              "steps_per_print": 2**62, "bf16": {"enabled": args.dtype == "bf16"},
              "zero_optimization": {"stage": int(key[4]), "overlap_comm": key.endswith("overlap"),
                                    "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                    "contiguous_gradients": True,
                                    **({"zero_hpz_partition_size": hsdp_shape(dist.get_world_size())[1]}
                                       if key.endswith("_hpz") else {})},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                        "weight_decay": WEIGHT_DECAY,
                                                        "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine, _DeepSpeed(engine)


def build(key, args, device):
    """(model to call, optimizer, label with the optimizer's flags). The optimizer may
    carry its own ``backward(loss)`` (DeepSpeed's engine)."""
    model = build_gpt(model_config(args), device=device, dtype=DTYPES[args.dtype], seed=0)
    zero = {k: (kw, label, o) for k, kw, label, o in args.variants}
    if key in zero:
        import zero_triton
        kwargs, label, overlap = zero[key]
        if kwargs.get("gather_dtype") == GATHER:
            kwargs = dict(kwargs)
            if DTYPES[args.dtype] in (torch.float16, torch.bfloat16):
                kwargs["gather_dtype"] = "int8"
            else:  # fp32 parameters are their own master: gathered in full
                del kwargs["gather_dtype"]
                label = label.replace("int8 wire", "int8 average")
        if kwargs.get("device_mesh") == HSDP:
            kwargs = {**kwargs, "device_mesh": hsdp_mesh(device)}
            label = label.replace("2-D mesh", "mesh {} x {}".format(*hsdp_shape(dist.get_world_size())))
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=LR, betas=BETAS,
                                    weight_decay=WEIGHT_DECAY, **kwargs)
        if overlap:
            zero_triton.overlap(model, opt)
        return model, opt, f"{label}, backend {opt.backend}"
    labels = dict(PEERS + DEEPSPEED + [COMPUTE])
    if key.startswith("fsdp2"):
        _fsdp2(model, reshard=key != "fsdp2_keep",
               mesh=hsdp_mesh(device) if key == "fsdp2_hsdp" else None)
        opt, how = torch_adamw(model.parameters())
        return model, opt, labels[key].replace("AdamW", f"AdamW({how.split(' ')[0]})")
    if key.startswith("ds_"):
        engine, opt = _deepspeed(key, model, args)
        return engine, opt, labels[key]
    if key == "compute":
        return model, _ComputeAlone(model, dist.get_world_size(), device), labels[key]
    ddp_kwargs = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {}
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    opt, how = torch_adamw(model.parameters())
    if key == "torchao_offload":
        from torchao.optim import CPUOffloadOptimizer
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY, fused=True)
        return net, opt, "torchao CPUOffloadOptimizer(AdamW(fused=True)) + DDP"
    if key == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        flag = {"fused": True} if how.startswith("fused") else {"foreach": True}
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **flag)
        return net, opt, f"ZeroRedundancyOptimizer(AdamW({how.split(' ')[0]})) + DDP"
    return net, opt, f"DDP + AdamW({how})"


def iteration(net, opt, batch, sync_ranges=None, after_backward=None):
    """One training iteration inside the ranges ``timeline`` cuts; returns the loss.
    ``sync_ranges``: a device synchronize that ends each range (profiled GPU runs, so
    that each range holds its own kernels); ``after_backward``: called between backward
    and the step."""
    record = torch.profiler.record_function
    end = sync_ranges or (lambda: None)
    idx, targets = batch
    with record(timeline.ITERATION):
        with record(timeline.FORWARD):
            _, loss = net(idx, targets)
            end()
        with record(timeline.BACKWARD):
            getattr(opt, "backward", torch.Tensor.backward)(loss)
            end()
        if after_backward is not None:
            after_backward()
        with record(timeline.OPTIMIZER):
            opt.step()
            end()
        opt.zero_grad()
    return loss


def _batches(args, rank, device):
    cfg = model_config(args)
    return [synthetic_batch(cfg, args.batch, args.seq, seed=10_000 * rank + i, device=device)
            for i in range(N_BATCHES)]


def _sync(device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


# -- what each rank runs -----------------------------------------------------------------------

def timed_rank(args, rank, world, device) -> dict:
    """Every configuration, interleaved: {"ms": {key: [per timed round]}, "loss", "label"};
    ms per iteration of a window of ``args.iters`` back-to-back iterations."""
    torch.manual_seed(0)
    sync, batches = _sync(device), _batches(args, rank, device)
    runs = [(key, *build(key, args, device)) for key, _ in configurations(args)]
    ms = {key: [] for key, *_ in runs}
    loss = {}
    started = time.perf_counter()
    for r in range(args.warmup + args.steps):
        if rank == 0 and r:
            print(f"e2e: world size {world}: round {r}/{args.warmup + args.steps} done, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        k = r % len(runs)
        for key, net, opt, _ in runs[k:] + runs[:k]:  # rotated: no configuration always first
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.iters):
                out = iteration(net, opt, batches[(r * args.iters + i) % N_BATCHES])
            getattr(opt, "wait_params", lambda: None)()  # the last step's parameters are usable
            sync()
            if r >= args.warmup:
                ms[key].append((time.perf_counter() - t0) * 1e3 / args.iters)
            loss[key] = float(out.detach().float())
    return {"ms": ms, "loss": loss, "label": {key: label for key, _, _, label in runs}}


def detail_rank(args, rank, world, device) -> dict:
    """``args.config`` alone: peak memory over one iteration, then PROFILED profiled
    iterations cut into exposed and hidden communication; returns the median one by its
    exposed share (one iteration on a shared machine is one sample of noise)."""
    from zero_triton.tools.profiling.harness import _quiet_kineto  # drops kineto's start/stop lines
    torch.manual_seed(0)
    start = MemoryProbe(device).snapshot()
    sync, batches = _sync(device), _batches(args, rank, device)
    net, opt, _ = build(args.config, args, device)
    iteration(net, opt, batches[0])  # optimizer state and DDP buckets exist from here on
    probe = MemoryProbe(device)
    states = []  # ZeroAdamW's bytes where it holds the most: averaged, not yet stepped
    report = (lambda: states.append(opt.memory_report())) if hasattr(opt, "memory_report") else None
    from zero_triton.optim.interface import internals
    view = internals(opt)  # ZeroAdamW's communicator counts the bytes it sends
    if view is not None:
        view.comm.reset_wire()
    with probe.phase("iteration"):
        iteration(net, opt, batches[1], after_backward=report)
    wire = dict(view.comm.wire) if view is not None else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof = torch.profiler.profile(  # one iteration to warm the profiler up, then recorded
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=PROFILED, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(raw)))
        with _quiet_kineto():
            prof.start()
        last = 2 + PROFILED
        for i in range(2, last + 1):
            sync()
            dist.barrier()
            iteration(net, opt, batches[i % N_BATCHES], sync if device.type == "cuda" else None)
            if i == last:
                # zero_triton.overlap leaves the step's all-gathers in flight for the next
                # forward; a gloo collective that starts inside the profiler's recorded
                # window and ends after it closes crashed a rank (SIGSEGV, torch 2.13, in
                # one run of six), so the recorded iteration's own gathers end inside the
                # window, outside the iteration's range. (The previous iteration's gathers
                # are the ones the recorded forward waits for, as in training.)
                getattr(opt, "wait_params", lambda: None)()
            with _quiet_kineto():
                prof.step()
        with _quiet_kineto():
            prof.stop()
        with open(raw) as fh:
            splits = timeline.split_iterations(json.load(fh)["traceEvents"])
    if len(splits) != PROFILED:
        raise RuntimeError(f"the trace holds {len(splits)} iterations, {PROFILED} were profiled")
    share = [sum(s.rows[k] for k in timeline.KINDS) / s.iteration_ms for s in splits]
    s = splits[sorted(range(PROFILED), key=share.__getitem__)[PROFILED // 2]]
    states = states[0] if states else None
    memory = probe.phases["iteration"]
    return {"start": start["current"], "peak": memory["peak"], "memory_how": probe.how,
            "in_use_start": start.get("in_use"), "in_use_peak": memory.get("in_use_peak"),
            "kept_free": memory.get("kept_free"),
            "states": states, "wire": wire, "iteration_ms": s.iteration_ms, "rows": s.rows, "hidden": s.hidden,
            "exposed_ms": sum(s.rows[k] for k in timeline.KINDS),
            "hidden_ms": sum(s.hidden.values())}


# -- the run, the table, the files ---------------------------------------------------------------

def _mb(x):
    return None if x is None else round(x / 2**20, 1)


def median_interval(values, confidence: float = 0.95) -> tuple:
    """A distribution-free interval for the median of ``values``: the order statistics
    x(k) and x(n+1-k) with the largest k whose coverage, P(k <= B <= n-k) for B ~
    Binomial(n, 1/2), is at least ``confidence`` (min and max when n is too small)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None, None
    pmf = [math.comb(n, i) / 2**n for i in range(n + 1)]
    k = 1
    while k + 1 <= n // 2 and sum(pmf[k + 1:n - k]) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k]


def measure(world, args, say) -> list:
    """The rows of one world size (an error row per configuration when its ranks failed)."""
    configs = configurations(args)
    rows = {key: {**dict.fromkeys(COLUMNS), "world_size": world, "config": key, "label": label,
                  "status": "ok", "note": ""} for key, label in configs}
    say(f"world size {world}: {args.warmup} warm-up + {args.steps} timed rounds of "
        f"{len(configs)} configurations")
    try:
        # Every round may take --timeout: 15 configurations at 4 ranks take ~45 s a round
        # on 2 cores, 13 rounds ~10 minutes.
        every = launch.spawn(timed_rank, args, world, args.device, args.timeout,
                             run_timeout_s=args.timeout * (args.warmup + args.steps))
    except launch.RankFailure as exc:
        say(f"error: world size {world}, timed rounds: {exc}")
        for row in rows.values():
            row.update(status="error", note=str(exc)[:300])
        return list(rows.values())
    per_round = {key: [max(r["ms"][key][i] for r in every) for i in range(args.steps)]
                 for key in rows}
    for key, row in rows.items():
        ms = per_round[key]
        row.update(label=every[0]["label"][key], rounds=args.steps,
                   median_ms=statistics.median(ms), min_ms=min(ms),
                   max_ms=max(ms), loss=statistics.fmean(r["loss"][key] for r in every))
    for key, row in rows.items():
        row["x_ddp"] = row["median_ms"] / rows["ddp"]["median_ms"]
        # Paired by round (the same minutes of the machine): DDP's time in a round against
        # this configuration's, and an interval for their median over the rounds.
        ratios = [a / b for a, b in zip(per_round[key], per_round["ddp"])]
        row["x_ddp_paired"] = statistics.median(ratios)
        row["x_ddp_low"], row["x_ddp_high"] = median_interval(ratios)
        if "compute" in rows and key != "compute":
            row["over_compute_pct"] = 100 * (1 - rows["compute"]["median_ms"] / row["median_ms"])
        say(f"world size {world}: profiled iteration and peak memory of {key}, on its own ranks")
        try:
            ranks = launch.spawn(detail_rank, argparse.Namespace(**vars(args), config=key),
                                 world, args.device, args.timeout, fresh=True)  # RSS measured
        except launch.RankFailure as exc:
            say(f"error: world size {world}, {key} profile/memory: {exc}")
            row.update(status="error", note=str(exc)[:300])
            continue
        exposed = statistics.fmean(r["exposed_ms"] for r in ranks)
        profiled = statistics.fmean(r["iteration_ms"] for r in ranks)
        row.update(exposed_comm_ms=exposed, exposed_comm_pct=100 * exposed / profiled,
                   hidden_comm_ms=statistics.fmean(r["hidden_ms"] for r in ranks),
                   profiled_ms=profiled, peak_mb=_mb(max(r["peak"] or 0 for r in ranks) or None),
                   start_mb=_mb(max(r["start"] or 0 for r in ranks) or None),
                   in_use_peak_mb=_mb(max(r["in_use_peak"] or 0 for r in ranks) or None),
                   in_use_start_mb=_mb(max(r["in_use_start"] or 0 for r in ranks) or None),
                   kept_free_mb=_mb(max(r["kept_free"] or 0 for r in ranks) or None))
        wires = [r["wire"] for r in ranks if r.get("wire") is not None]
        if wires:  # the rank that sent the most
            wire = max(wires, key=lambda w: sum(w.values()))
            row.update(wire_mb=_mb(sum(wire.values())),
                       across_mb=_mb(sum(v for k, v in wire.items() if k.startswith("replicas."))))
        row["ranks"] = ranks
    return list(rows.values())


def _f(x, spec, empty="-"):
    return empty if x is None else format(x, spec)


def _ratio(r) -> str:
    if r.get("x_ddp_paired") is None:
        return _f(r["x_ddp"], ".2f") + "x"
    return f"{r['x_ddp_paired']:.2f}x ({r['x_ddp_low']:.2f}-{r['x_ddp_high']:.2f})"


def format_table(rows, world, args) -> str:
    cuda = args.device == "cuda"
    head = (f"{'configuration':<52} {'median ms':>10} {'min-max ms':>17} {'x DDP (95% CI)':>18} "
            f"{'over compute':>12} {'exposed comm':>19} {'peak MB/rank':>14}"
            + ("" if cuda else f" {'in use MB':>12}"))
    lines = [f"world size {world} ({'NCCL' if cuda else 'gloo, 1 thread per rank'})", head,
             "-" * len(head)]
    if all(r["median_ms"] is None for r in rows):
        return "\n".join(lines[:1] + [f"error: {rows[0]['note']}"])
    for r in rows:
        if r["median_ms"] is None:
            lines.append(f"{r['label']:<52} error: {r['note'][:120]}")
            continue
        exposed = ("-" if r["exposed_comm_pct"] is None else
                   f"{r['exposed_comm_pct']:.1f}% of {r['profiled_ms']:.0f} ms")
        peak = _f(r["peak_mb"], ".0f")
        if r["peak_mb"] is not None and r["start_mb"] is not None and not cuda:
            peak += f" (+{r['peak_mb'] - r['start_mb']:.0f})"
        over = _f(r["over_compute_pct"], ".1f") + ("%" if r["over_compute_pct"] is not None else "")
        in_use = ""
        if not cuda:
            in_use = " " + format(_f(r["in_use_peak_mb"], ".0f") + (
                f" (+{r['in_use_peak_mb'] - r['in_use_start_mb']:.0f})"
                if r["in_use_peak_mb"] is not None and r["in_use_start_mb"] is not None else ""), ">12")
        lines.append(f"{r['label'][:52]:<52} {r['median_ms']:>10.1f} "
                     f"{_f(r['min_ms'], '.1f') + '-' + _f(r['max_ms'], '.1f'):>17} "
                     f"{_ratio(r):>18} {over:>12} {exposed:>19} {peak:>14}{in_use}")
    return "\n".join(lines)


_SHORT = {"reduce_scatter": "red-scat", "all_reduce": "all-red", "adam_step": "Adam",
          "all_gather": "all-gath", "other_collective": "oth.coll"}


def format_phases(rows, world) -> str:
    """Where each configuration's profiled iteration goes: the timeline's rows (ms, mean
    of ranks; each rank's median iteration by its exposed share), communication exposed
    per kind and, after them, how much of it ran hidden under compute."""
    ran = [r for r in rows if r.get("ranks")]
    if not ran:
        return ""
    names = list(timeline.ROWS)
    width = 10
    head = f"{'configuration':<40}" + "".join(f"{_SHORT.get(k, k):>{width}}" for k in names) \
        + f"{'hidden':>{width}}"
    lines = [f"world size {world}: where the profiled iteration goes (ms, mean of ranks; "
             "communication exposed by kind, then what ran hidden under compute)", head,
             "-" * len(head)]
    for r in ran:
        cells = [statistics.fmean(rank["rows"][k] for rank in r["ranks"]) for k in names]
        hidden = statistics.fmean(sum(rank["hidden"].values()) for rank in r["ranks"])
        lines.append(f"{r['label'][:39]:<40}" + "".join(f"{c:>{width}.1f}" for c in cells)
                     + f"{hidden:>{width}.1f}")
    return "\n".join(lines)


def format_wire(rows, world) -> str:
    """ZeroAdamW's bytes on the wire per rank over one iteration, per collective, as its
    communicator counted them (``replicas.``: between the copies of a 2-D mesh's shards,
    across nodes); the largest rank."""
    ours = [r for r in rows if r.get("ranks") and r["ranks"][0].get("wire") is not None]
    if not ours:
        return ""
    lines = [f"bytes sent per rank per iteration (MiB; world size {world}), counted by ZeroAdamW's "
             "communicator; 'replicas.': between the mesh's replicas (across nodes)"]
    for r in ours:
        wire = max((x["wire"] for x in r["ranks"]), key=lambda w: sum(w.values()))
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(wire.items()) if v)
        lines.append(f"  {r['config']:<16} total {sum(wire.values()) / 2**20:7.2f}  ({parts})")
    return "\n".join(lines)


def format_states(rows, world, args) -> str:
    """ZeroAdamW's own bytes per rank (its ``memory_report()`` between backward and the
    step, where it holds its averaged shard too; largest rank) beside
    ``python -m zero_triton memory``'s formula for the same parameters, world size and
    stage: what it holds for the model states, and what it holds besides (the buckets'
    receive and staging buffers)."""
    from zero_triton.memory.model import memory_table
    zero = [r for r in rows if r["config"].startswith("zero") and r.get("ranks")
            and r["ranks"][0].get("states")]
    if not zero:
        return ""
    with torch.device("meta"):
        params = GPT(model_config(args)).num_params()
    master = "none" if args.dtype == "fp32" else "fp32"
    # The hybrid rows shard over the mesh's shard dim: the formula at that world size.
    formulas = {(m, w): {row["stage"]: row for row in memory_table(params, w, master, m)["stages"]}
                for m in ("fp32", "int8") for w in {world, hsdp_shape(world)[1]}}
    mib = 2**20
    lines = [f"ZeroAdamW's bytes per rank (memory_report() after backward, MiB) against `python -m zero_triton "
             f"memory --params {params} --world-size {world}"
             + ("" if args.dtype != "fp32" else " --master-dtype none") + "`"]
    for r in zero:
        states = max((x["states"] for x in r["ranks"]), key=lambda st: sum(
            v for k, v in st.items() if k != "optimizer_state"))
        shards = hsdp_shape(world)[1] if "_hsdp" in r["config"] else world
        f = formulas["int8" if r["config"].endswith("_int8") else "fp32", shards][
            f"zero{2 if '_s2' in r['config'] else 1}"]
        held = states["params"] + states["grads"] + states["master"] + states["moments"]
        lines.append(
            f"  {r['config']:<16} params {states['params'] / mib:6.1f}  grads {states['grads'] / mib:6.1f}"
            f"  master+moments {(states['master'] + states['moments']) / mib:6.1f}"
            f"  = {held / mib:6.1f} (formula {f['bytes_per_rank'] / mib:6.1f}: params "
            f"{f['params_bytes'] / mib:.1f}, grads {f['grads_bytes'] / mib:.1f}, state "
            f"{f['optimizer_bytes'] / mib:.1f}); buckets {states['buckets'] / mib:.1f}, "
            f"padding {states['padding'] / mib:.1f}")
    return "\n".join(lines)


def write_png(rows, meta, path) -> str | None:
    """Bars of median ms (min-max whiskers) per configuration, grouped by world size;
    returns why it was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'zero_triton[bench]')"
    if not any(r["median_ms"] is not None for r in rows):
        return "no configuration was timed"
    worlds = sorted({r["world_size"] for r in rows})
    keys = list(dict.fromkeys(r["config"] for r in rows))
    width = 0.8 / len(keys)
    colors = plt.get_cmap("tab20").colors  # one colour per configuration, up to 20
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 3.0 + 0.35 * len(worlds) * len(keys))), 4.5))
    top = 0.0
    for j, key in enumerate(keys):
        ok = [(i, r) for i, w in enumerate(worlds) for r in rows
              if r["world_size"] == w and r["config"] == key and r["median_ms"] is not None]
        if not ok:
            continue
        med = [r["median_ms"] for _, r in ok]
        ax.bar([i + (j - (len(keys) - 1) / 2) * width for i, _ in ok], med, width,
               label=ok[0][1]["label"], capsize=3, color=colors[j % len(colors)],
               yerr=[[m - r["min_ms"] for m, (_, r) in zip(med, ok)],
                     [r["max_ms"] - m for m, (_, r) in zip(med, ok)]])
        top = max([top] + [r["max_ms"] for _, r in ok])
    ax.set_ylim(0, 1.1 * top or 1)
    ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
    ax.set_ylabel("ms per iteration (median, min-max)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    ax.set_title(f"training iterations, {meta.get('iters', 1)} back to back per window, GPT "
                 f"{meta['model']['params']:,} params, "
                 f"{meta['dtype']}\n{meta['dist_backend']} on {meta['device_name']}", fontsize=8)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _deepspeed_version():
    if deepspeed_missing():
        return None
    from importlib.metadata import version
    return version("deepspeed")


def metadata(args) -> dict:
    from zero_triton import __version__
    from zero_triton.tools.machine import cpu_model, git_commit
    cfg = model_config(args)
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "zero_triton": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": git_commit()[0],
            "device": args.device, "device_name": (torch.cuda.get_device_name(0) if args.device == "cuda"
                                                   else cpu_model()),
            "dist_backend": "nccl" if args.device == "cuda" else "gloo",
            "threads_per_rank": 1 if args.device == "cpu" else None,
            "dtype": args.dtype, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "ranks": args.ranks, "bucket_cap_mb": args.bucket_cap_mb,
            "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                      "vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "params": params},
            "argv": args.argv,
            "configs": [k for k, _ in configurations(args)],
            "deepspeed": _deepspeed_version(), "deepspeed_skipped": deepspeed_missing(),
            "iters": args.iters,
            "time": f"slowest rank's wall clock over {args.iters} back-to-back iterations after a "
                    "barrier, up to the last step's parameters usable (wait_params), per "
                    "iteration; median (min-max) over rounds",
            "exposed_comm": f"{PROFILED} torch.profiler iterations per configuration, "
                            "zero_triton.tools.profiling.timeline's split; per rank the median "
                            "iteration by exposed share, mean over ranks",
            "peak_mb": "max over ranks; " + ("torch.cuda.max_memory_allocated over one iteration"
                                             if args.device == "cuda" else
                                             "VmHWM over one iteration after /proc/self/clear_refs; "
                                             "start_mb: VmRSS before the model was built"),
            "in_use_peak_mb": "CPU, glibc: max over ranks of the bytes malloc had handed out "
                              "(mallinfo2 heap in use + mmapped), sampled every ms over the same "
                              "iteration; in_use_start_mb before the model was built; kept_free_mb: "
                              "freed heap memory glibc held at the sampled RSS peak. peak_mb less "
                              "in_use_peak_mb is what the allocator keeps beyond what the process holds"}


# -- options -------------------------------------------------------------------------------------

def _ranks(text):
    try:
        ranks = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of world sizes; pass e.g. 2,4")
    return list(dict.fromkeys(ranks))


ALL_KEYS = ["ddp", "torch_zero"] + [k for k, *_ in zero_variants(None)] + \
    [k for k, _ in PEERS + DEEPSPEED + TORCHAO] + [COMPUTE[0]]


def _configs(text):
    keys = [t.strip() for t in str(text).split(",") if t.strip()]
    unknown = [k for k in keys if k not in ALL_KEYS]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or repr(text)}: not a configuration; pick from {', '.join(ALL_KEYS)}")
    return keys


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/e2e.py", usage="%(prog)s [options]   (--help lists them)",
        description="Time training iterations of a GPT in steady state: DDP + AdamW, ZeroRedundancyOptimizer"
                    " + DDP and ZeroAdamW, interleaved, per world size; exposed communication"
                    " and peak memory per rank. CSV, JSON and PNG in --out.")
    ap.add_argument("--ranks", type=_ranks, default=None,
                    help="world sizes, e.g. 2,4 (default 2,4 on cpu; the local GPU count on cuda)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                    help="parameters and gradients (bf16: ZeroAdamW keeps an fp32 master, "
                         "torch's AdamW does not)")
    ap.add_argument("--layers", type=whole_number(1), default=4, help="transformer blocks (4)")
    ap.add_argument("--width", type=whole_number(1), default=384, help="embedding width (384)")
    ap.add_argument("--heads", type=whole_number(1), default=6, help="attention heads (6)")
    ap.add_argument("--vocab", type=whole_number(1), default=8192, help="vocabulary size (8192)")
    ap.add_argument("--seq", type=whole_number(1), default=64, help="tokens per sequence (64)")
    ap.add_argument("--batch", type=whole_number(1), default=4, help="sequences per rank (4)")
    ap.add_argument("--steps", type=whole_number(1), default=10, help="timed rounds (10)")
    ap.add_argument("--iters", type=whole_number(1), default=5,
                    help="iterations back to back per configuration and round (5); 1 times "
                         "single iterations")
    ap.add_argument("--warmup", type=whole_number(0), default=3, help="untimed rounds first (3)")
    ap.add_argument("--bucket-cap-mb", type=positive_number(), default=None,
                    help="DDP's and ZeroAdamW's bucket size in MiB (default: 25, both's own)")
    ap.add_argument("--configs", type=_configs, default=None,
                    help="comma list of configurations to run (default: all; ddp always runs): "
                         + ", ".join(ALL_KEYS))
    ap.add_argument("--timeout", type=positive_number(), default=300.0,
                    help="seconds a rank may wait in a collective, one round of the timed "
                         "configurations may take, and one configuration's profiled run (300)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "e2e"),
                    help="folder for e2e_<device>.csv/.json/.png (bench/results/e2e)")
    ap.add_argument("--no-deepspeed-shm", action="store_true",
                    help="DeepSpeed on CPUs without its shared-memory all-reduce op, which it "
                         "compiles on first use in each new environment (about a minute of a "
                         "core): the test suite's runs; timed runs keep it, as users run")
    args = ap.parse_args([str(a) for a in argv])
    args.argv = [str(a) for a in argv]
    if launch.start_env_problem():
        ap.error(launch.start_env_problem())
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        args.ranks = args.ranks or [gpus]
        if max(args.ranks) > gpus:
            ap.error(f"--ranks {max(args.ranks)} needs as many GPUs, this machine has {gpus}")
    else:
        args.ranks = args.ranks or [2, 4]
        if max(args.ranks) > MAX_CPU_RANKS:
            ap.error(f"--ranks {max(args.ranks)}: at most {MAX_CPU_RANKS} CPU ranks")
    if args.configs and any(k.startswith("ds_") for k in args.configs) and deepspeed_missing():
        ap.error(f"--configs {','.join(args.configs)}: {deepspeed_missing()}")
    if args.configs and "torchao_offload" in args.configs and torchao_missing(args.device):
        ap.error(f"--configs {','.join(args.configs)}: {torchao_missing(args.device)}")
    check_out_dir(ap, args)
    return args


def main(argv=None) -> int:
    """0 when every configuration ran at every world size, else 1; 2 for a bad option."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.variants = zero_variants(args.bucket_cap_mb)

    def say(text):
        print(f"e2e: {text}", file=sys.stderr, flush=True)
    out = Path(args.out)
    for stale in out.glob("error_rank*.txt"):
        stale.unlink()
    meta = metadata(args)
    m = meta["model"]
    print(f"GPT {m['n_layer']} x {m['n_embd']}, {m['params']:,} parameters, {args.dtype}, batch "
          f"{args.batch} x {args.seq} tokens per rank; {args.steps} timed rounds after {args.warmup}, "
          f"on {meta['device_name']}", flush=True)
    configs = configurations(args)
    say(f"{len(configs)} configurations ({', '.join(k for k, _ in configs)}) at world sizes "
        f"{', '.join(map(str, args.ranks))}: {args.warmup + args.steps} rounds of {args.iters} "
        f"iterations each, then one profiled run per configuration (the defaults took "
        f"{DEFAULT_MINUTES} on 2 cores)")
    if not args.configs and deepspeed_missing():
        say(f"DeepSpeed peers skipped: {deepspeed_missing()}")
    rows = []
    try:
        for world in args.ranks:
            got = measure(world, args, say)
            rows += got
            print("\n" + format_table(got, world, args), flush=True)
            breakdown = format_states(got, world, args)
            if breakdown:
                print(breakdown, flush=True)
            wire = format_wire(got, world)
            if wire:
                print(wire, flush=True)
            phases = format_phases(got, world)
            if phases:
                print("\n" + phases, flush=True)
    except KeyboardInterrupt:  # launch.spawn stopped the ranks on the way out
        print("error: interrupted", file=sys.stderr)
        return 130
    print(f"\nx DDP: the median over rounds of this configuration's time / DDP's in the same "
          f"round, with a 95% distribution-free interval for that median (order statistics); "
          f"a difference stands out of the noise where the interval leaves 1.00. Over compute: 1 - compute alone / median, the "
          f"share of the iteration that communication (and waiting for it) costs. Exposed comm: share of a profiled iteration (run on "
          f"the configuration's own ranks, under torch.profiler) the training thread waited for "
          f"collectives: per rank the median of {PROFILED} iterations by that share, mean of "
          f"ranks. Peak: "
          + ("max_memory_allocated" if args.device == "cuda" else
             "VmHWM of the whole process (+ above its VmRSS before the model was built)")
          + " over one iteration, largest rank.")
    paths = {"csv": out / f"e2e_{args.device}.csv", "json": out / f"e2e_{args.device}.json"}
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with open(paths["json"], "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    png = out / f"e2e_{args.device}.png"
    why = write_png(rows, meta, png)
    if why:
        png.unlink(missing_ok=True)  # not an earlier run's figure next to this run's numbers
        print(f"PNG skipped: {why}")
    else:
        paths["png"] = png
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    from zero_triton.tools.console import run
    sys.exit(run(main, sys.argv[1:]))
