"""``python -m zero_triton profile``: the options, their checks, and the run."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from zero_triton.tools import outputs
from zero_triton.tools.units import SUFFIXES, parse_count, positive_number, rank_count, whole_number

# Defaults that profile a step on 2 CPU cores in well under a minute.
MODEL_DEFAULTS = {"layers": 2, "width": 128, "heads": 4, "vocab": 2048, "seq": 64, "batch": 8}
MAX_SPAWNED_RANKS = 64


_positive_int = whole_number(1)
_seconds = positive_number("number of seconds", "300")


def _mesh(text: str) -> tuple:
    try:
        r, s = (int(t) for t in str(text).split(","))
    except ValueError:
        r = s = 0
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass the mesh as R,S (replicas, shards), e.g. 2,2")
    return (r, s)


def _stage(text: str) -> int:
    if str(text).strip() not in ("1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage; pass 1 or 2")
    return int(text)


def _size(text: str) -> int:
    return parse_count(text, "64Mi")


def build_parser() -> argparse.ArgumentParser:
    from zero_triton.native.backends import NAMES
    ap = argparse.ArgumentParser(
        prog="python -m zero_triton profile",
        usage="%(prog)s [options]   (--help lists them)",
        description="Profile training steps of a small GPT with ZeroAdamW and with DDP + "
                    "torch.optim.AdamW under torch.profiler: a Chrome/Perfetto trace per rank, "
                    "forward/backward/communication/Adam-step times with exposed and hidden "
                    "communication, bytes on the wire, the Adam kernel's bandwidth and memory "
                    "per phase. Ranks: spawned (gloo on CPU, NCCL on GPUs) or torchrun's.")
    run = ap.add_argument_group("run")
    run.add_argument("--world-size", type=rank_count("2"), default=None,
                     help="ranks to spawn (default: 2 on cpu, every GPU on cuda; under torchrun, "
                          "torchrun's --nproc_per_node)")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                     help="parameter and gradient dtype (bf16: ZeroAdam keeps an fp32 master)")
    run.add_argument("--steps", type=_positive_int, default=5, help="profiled iterations (default 5)")
    run.add_argument("--warmup", type=_positive_int, default=3,
                     help="iterations before them, not recorded (default 3)")
    run.add_argument("--backend", choices=NAMES, default="auto", help="ZeroAdam's kernel backend")
    run.add_argument("--stage", type=_stage, default=1,
                     help="ZeRO stage: 1 (optimizer state sharded, default) or 2 (gradients too)")
    run.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                     help="zero_triton.overlap(model, opt), as users train: parameter "
                          "all-gathers waited by the next forward (default; --no-overlap waits "
                          "in step(); the reduce-scatters overlap backward in any case)")
    run.add_argument("--mesh", type=_mesh, default=None, metavar="R,S",
                     help="ZeroAdamW over a 2-D (replicate, shard) mesh of R x S ranks: hybrid "
                          "sharding (default: flat over every rank)")
    run.add_argument("--reduce-dtype", choices=("int8",), default=None,
                     help="ZeroAdamW's gradients averaged as int8 blocks (error feedback on)")
    run.add_argument("--gather-dtype", choices=("int8",), default=None,
                     help="ZeroAdamW's parameters all-gathered as int8 blocks (--dtype bf16)")
    run.add_argument("--no-ddp", dest="ddp", action="store_false",
                     help="skip the DDP + torch.optim.AdamW baseline")
    run.add_argument("--timeout", type=_seconds, default=300.0,
                     help="seconds a rank may wait in a collective, and the run may take "
                          "beyond starting up (default 300)")
    _model_and_output_arguments(ap)
    return ap


def _model_and_output_arguments(ap: argparse.ArgumentParser) -> None:
    """The model's, the collectives-only run's and the output's options."""
    model = ap.add_argument_group("model (a GPT: zero_triton.tools.gpt)")
    model.add_argument("--layers", type=_positive_int, default=None, help="transformer blocks (2)")
    model.add_argument("--width", type=_positive_int, default=None, help="embedding width (128)")
    model.add_argument("--heads", type=_positive_int, default=None, help="attention heads (4)")
    model.add_argument("--vocab", type=_positive_int, default=None, help="vocabulary size (2048)")
    model.add_argument("--seq", type=_positive_int, default=None, help="tokens per sequence (64)")
    model.add_argument("--batch", type=_positive_int, default=None, help="sequences per rank (8)")
    coll = ap.add_argument_group("collectives only")
    coll.add_argument("--collectives-only", action="store_true",
                      help="time all-reduce, reduce-scatter and all-gather on a synthetic flat "
                           "buffer of --size elements instead of training")
    coll.add_argument("--size", type=_size, default=None,
                      help=f"elements of that buffer, e.g. 64Mi ({SUFFIXES}; default 16Mi)")
    coll.add_argument("--repeats", type=_positive_int, default=5,
                      help="timed calls of each collective (median; default 5)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", default=os.path.join("bench", "results", "profile"),
                     help="folder for trace_rank<r>.json, ddp/trace_rank<r>.json, profile.json "
                          "and profile.png (default bench/results/profile)")
    out.add_argument("--gzip", action="store_true", help="write the traces as .json.gz")
    out.add_argument("--json", action="store_true",
                     help="print the whole report as one JSON document on stdout")


def parse_args(argv) -> argparse.Namespace:
    """Parsed and checked options; a bad one exits with status 2 and one line naming
    the fix (argparse's usage line first, as every command here)."""
    from zero_triton.tools.profiling import launch
    ap = build_parser()
    args = ap.parse_args([str(a) for a in argv])
    args.argv = [str(a) for a in argv]
    if launch.start_env_problem():
        ap.error(launch.start_env_problem())
    model_flags = [k for k in MODEL_DEFAULTS if getattr(args, k) is not None]
    if args.collectives_only:
        if model_flags:
            ap.error(f"--{model_flags[0]} does not apply to --collectives-only, which times "
                     "a synthetic buffer of --size elements; drop it")
        args.size = args.size or 16 << 20
    elif args.size is not None:
        ap.error("--size applies to --collectives-only; to profile a bigger model pass "
                 "--layers/--width/--vocab, or add --collectives-only")
    for key, value in MODEL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}; each head "
                 f"gets width / heads channels: pass e.g. --width {args.heads * max(1, round(args.width / args.heads))}")
    _check_stage_and_overlap(ap, args)
    _check_device(ap, args, launch.under_torchrun())
    if args.mesh is not None and args.mesh[0] * args.mesh[1] != args.world_size:
        ap.error(f"--mesh {args.mesh[0]},{args.mesh[1]} holds {args.mesh[0] * args.mesh[1]} ranks, "
                 f"the run {args.world_size}: pass --world-size {args.mesh[0] * args.mesh[1]}")
    if args.gather_dtype and args.dtype != "bf16":
        ap.error("--gather-dtype int8 sends bf16 parameters beside their fp32 master: pass "
                 "--dtype bf16 (fp32 parameters are their own master)")
    check_out_dir(ap, args)
    return args


def _check_stage_and_overlap(ap, args) -> None:
    from zero_triton.tools.profiling.harness import zero_options
    supported = zero_options(argparse.Namespace(stage=args.stage, overlap=args.overlap))
    if args.stage == 3 or (args.stage != 1 and "stage" not in supported):
        ap.error(f"--stage {args.stage} is not available: ZeroAdam implements ZeRO stages 1 "
                 "and 2 (parameters are not sharded); pass --stage 1 or 2")


def _check_device(ap, args, torchrun: bool) -> None:
    import torch
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                     "use --device cpu")
        gpus = torch.cuda.device_count()
        if not torchrun:
            args.world_size = args.world_size or gpus
            if args.world_size > gpus:
                ap.error(f"--world-size {args.world_size} needs {args.world_size} GPUs, this machine "
                         f"has {gpus} (NCCL runs one rank per GPU); pass --world-size {gpus} or less")
    if args.backend != "auto":
        from zero_triton.native import backends
        try:
            backends.resolve(args.backend, torch.device(args.device))
        except (RuntimeError, ValueError) as exc:
            ap.error(f"--backend {args.backend}: {str(exc).splitlines()[0]}")
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world:
            ap.error(f"--world-size {args.world_size} but torchrun started {world} ranks; under "
                     "torchrun the ranks are torchrun's (--nproc_per_node): leave --world-size out")
        args.world_size = world
    else:
        args.world_size = args.world_size or 2
        if args.device == "cpu" and args.world_size > MAX_SPAWNED_RANKS:
            ap.error(f"--world-size {args.world_size}: at most {MAX_SPAWNED_RANKS} spawned CPU ranks; "
                     "launch larger jobs with torchrun")


def check_out_dir(ap, args) -> None:
    """``--out`` is a folder that exists (created if missing) and can be written, or
    ``ap.error`` says why."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {args.out} is a file; pass a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot create it ({exc.strerror or exc}); pass a writable folder")
    if not os.access(out, os.W_OK | os.X_OK):
        ap.error(f"--out {args.out} is not writable; pass a writable folder")


def _meta(args) -> dict:
    import torch

    from zero_triton import __version__
    from zero_triton.tools.machine import cpu_model, git_commit
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "zero_triton": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": git_commit()[0],
            "device": args.device,
            "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_model(),
            "world_size": args.world_size, "dist_backend": "nccl" if args.device == "cuda" else "gloo",
            "dtype": args.dtype, "argv": args.argv}
    if args.collectives_only:
        meta.update(size=args.size, repeats=args.repeats)
        return meta
    from zero_triton.tools.gpt import GPT
    from zero_triton.tools.profiling.harness import model_config
    config = model_config(args)
    with torch.device("meta"):
        params = GPT(config).num_params()
    meta.update(model={"n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                       "vocab_size": config.vocab_size, "block_size": config.block_size,
                       "params": params},
                batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
                stage=args.stage, overlap=args.overlap, backend=args.backend,
                threads_per_rank=1 if args.device == "cpu" else None)
    return meta


def _say(text: str) -> None:
    print(f"zero_triton profile: {text}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Run the profile; 0 on success, 1 when a rank failed (one line on stderr), 2 for
    a bad option."""
    from zero_triton.tools.profiling import harness, launch, report
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torchrun = launch.under_torchrun()
    fn = harness.collectives_rank if args.collectives_only else harness.profile_rank
    meta = _meta(args)
    if not args.collectives_only and (not torchrun or os.environ.get("RANK") == "0"):
        # before any rank can write (the others wait for rank 0 in the rendezvous)
        harness.remove_stale_outputs(args, args.world_size)
    try:
        if torchrun:
            every = launch.from_torchrun(fn, args, args.device, args.timeout)
        else:
            _say(f"spawning {args.world_size} {meta['dist_backend']} rank(s) on {args.device}")
            every = launch.spawn(fn, args, args.world_size, args.device, args.timeout)
    except launch.RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _leave(1, torchrun)
    except KeyboardInterrupt:  # the ranks were stopped on the way out (launch.spawn)
        print("error: interrupted", file=sys.stderr)
        return _leave(130, torchrun)
    except Exception as exc:
        if not torchrun:
            raise
        rank = os.environ.get("RANK", "?")
        print(f"error: rank {rank} failed: {launch._one_line(exc)}", file=sys.stderr)
        return _leave(1, torchrun)
    if every is None:  # a torchrun rank other than 0: rank 0 reports
        return _leave(0, torchrun)
    out = Path(args.out)
    if args.collectives_only:
        result = {"meta": meta, "wire": report._wire_over_ranks([r["wire"] for r in every])}
        path = out / "collectives.json"
        text = report.wire_text(result["wire"])
    else:
        result = report.build(every, meta)
        path = out / "profile.json"
        png = out / "profile.png"
        why = report.write_png(result, png)
        result["png"] = None if why else str(png)
        if why:
            _say(f"PNG skipped: {why}")
        text = report.format_text(result)
    result["report"] = str(path)
    with outputs.replacing(path, "w") as fh:
        json.dump(result, fh, indent=1)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(text)
        print(f"\nwrote {path}" + (f" and {result['png']}" if result.get("png") else ""))
    return _leave(0, torchrun)


def _leave(code: int, torchrun: bool) -> int:
    """Under torchrun, leave without interpreter finalisation, as the demo does (gloo's
    threads aborted a rank there now and then); spawned ranks already did."""
    if torchrun:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
