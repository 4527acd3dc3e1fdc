"""A step benchmark's table, its files (CSV, JSON, with the machine and the commit) and
its command line: ``python -m zero_triton bench``."""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import platform
import sys
from pathlib import Path

import torch

from zero_triton.tools import outputs
from zero_triton.tools.bench.cases import (ALL_CASES, BYTES_PER_PARAM, GUARD_LP_RTOL, GUARD_RTOL,
                                           GUARD_STEPS, LEGEND, LR, PROVIDER_IDS, build_cases,
                                           parse_many, positive_float, size_list)
from zero_triton.tools.bench.providers import load_cpu_limit
from zero_triton.tools.bench.run import run_case
from zero_triton.tools.machine import cpu_model, git_commit
from zero_triton.tools.units import SUFFIXES, positive_number, whole_number

# -- output -----------------------------------------------------------------------------

COLUMNS = ["case", "provider", "dtype", "numel", "n_tensors", "sets", "bytes_per_step",
           "median_ms", "p20_ms", "p80_ms", "gbps", "x_baseline", "baseline", "pct_limit",
           "pct_copy", "guard", "guard_max_rel", "calls_per_sample", "status", "note"]


def format_table(rows, cuda: bool) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    head = (f"{'case':<22} {'provider':<16} {'median ms':>10} {'p20':>9} {'p80':>9} {'GB/s':>7} "
            f"{'x base':>7} {'% limit':>8}" + (f" {'% copy':>7}" if cuda else "") + "  guard")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['case']:<22} {r['provider']:<16} ERROR: {r['note']}")
            continue
        lines.append(
            f"{r['case']:<22} {r['provider']:<16} {f(r['median_ms'], '10.3f')} {f(r['p20_ms'], '9.3f')} "
            f"{f(r['p80_ms'], '9.3f')} {f(r['gbps'], '7.1f')} {f(r['x_baseline'], '7.2f')} "
            f"{f(r['pct_limit'], '7.1f')}%" + (f" {f(r['pct_copy'], '6.1f')}%" if cuda else "")
            + f"  {r['guard'] or ''}")
    return "\n".join(lines)


def metadata(device, args, notes) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_model": cpu_model(), "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": commit, "git_dirty": dirty,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "bytes_per_param": BYTES_PER_PARAM, "repeats": args.repeats, "lr": LR,
        "guard": {"steps": GUARD_STEPS, "rtol": GUARD_RTOL, "bf16_params_rtol": GUARD_LP_RTOL},
        "argv": args.argv, "notes": notes, "legend": LEGEND,
    }
    return meta


def write_outputs(rows, meta, out: Path, device, say) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"step_{device.type}"
    paths = {"csv": out / f"{stem}.csv", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    with outputs.replacing(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    with outputs.replacing(paths["json"], "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("PNG skipped: matplotlib is not installed (pip install 'zero_triton[bench]')")
        paths.pop("png")
        return paths
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.6 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        ok = [r for r in rows if r["case"] == case and r["gbps"] is not None and r["provider"] != "copy"]
        names = [r["provider"] for r in ok]
        colors = ["tab:green" if n.startswith("zt-") else "tab:gray" if n == "limit" else "tab:blue"
                  for n in names]
        ax.barh(names, [r["gbps"] for r in ok], color=colors)
        for r in rows:
            if r["case"] == case and r["provider"] == "copy" and r["gbps"]:
                ax.axvline(r["gbps"], color="tab:red", linestyle="--", label="d2d copy")
                ax.legend(loc="lower right", fontsize=7)
        ax.invert_yaxis()
        ax.set_title(case, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel(f"GB/s at {BYTES_PER_PARAM} B/param (median)")
    fig.suptitle(f"optimizer step, {meta['device']}, torch {meta['torch']}", fontsize=9)
    fig.tight_layout()
    with outputs.replacing(paths["png"], "wb") as fh:
        fig.savefig(fh, dpi=110, format="png")
    plt.close(fig)
    return paths


# -- entry point ------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m zero_triton bench",
        description="Time one optimizer step (zero_triton, torch, a memory-kernel limit), "
                    "interleaved in one process; medians, p20/p80, GB/s at 28 B/param.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cases", default=",".join(ALL_CASES),
                    help=f"comma list of {','.join(ALL_CASES)} (default: all)")
    ap.add_argument("--sizes", type=size_list, default=None,
                    help="params per flat buffer for the fp32 and bf16 cases, e.g. "
                         f"64Mi,256Mi,1Gi ({SUFFIXES}; default: fp32 16Mi,64Mi and bf16 64Mi)")
    ap.add_argument("--scale", type=positive_float, default=None,
                    help="GPT-2 small element count scale (default 0.25 on cpu, 1 on cuda)")
    ap.add_argument("--many", type=parse_many, default="8192x4096",
                    help="COUNTxSIZE for the many-tensors case")
    ap.add_argument("--providers", default=None,
                    help=f"comma list to keep (the case baseline and the limit always stay): "
                         f"{','.join(PROVIDER_IDS)}")
    ap.add_argument("--repeats", type=whole_number(1, "15"), default=None,
                    help="interleaved rounds (default 15 on cpu, 50 on cuda)")
    ap.add_argument("--min-time", type=positive_number("number of seconds", "0.02"), default=None,
                    help="seconds per sample: steps are repeated to last this long "
                         "(default 0.02 on cpu, 0.005 on cuda)")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="folder for step_<device>.csv/.json/.png (default bench/results)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny smoke run: every case at ~16-32K params, 3 rounds")
    return ap


def parse_args(argv):
    ap = _parser()
    args = ap.parse_args([str(a) for a in argv])
    args.argv = [str(a) for a in argv]
    cuda = args.device == "cuda"
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in ALL_CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {','.join(ALL_CASES)}")
    if args.providers:
        args.providers = [p.strip() for p in args.providers.split(",") if p.strip()]
        bad = [p for p in args.providers if p not in PROVIDER_IDS]
        if bad:
            ap.error(f"unknown provider(s) {bad}; choose from {','.join(PROVIDER_IDS)}")
    if args.quick:
        sizes = [16 << 10]
        args.sizes, args.bf16_sizes = sizes, sizes
        args.scale = args.scale or 1 / 4096
        args.many = (32, 512)
        args.repeats = args.repeats or 3
        args.min_time = args.min_time if args.min_time is not None else 0.0
        args.max_sets = 2  # exercises the rotation without timing caches honestly
    else:
        if args.sizes:
            args.bf16_sizes = args.sizes
        else:
            args.sizes, args.bf16_sizes = [16 << 20, 64 << 20], [64 << 20]
        args.scale = args.scale or (1.0 if cuda else 0.25)
        args.repeats = args.repeats or (50 if cuda else 15)
        if args.min_time is None:
            args.min_time = 0.005 if cuda else 0.02
        args.max_sets = 8
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    """Run the benchmark; 0 when every provider passed its guard and ran, else 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    notes = []

    def say(text):
        print(text, flush=True)
        if text.strip().startswith(("skipped", "PNG", "limit")):
            notes.append(text.strip())

    say(f"zero_triton step benchmark on {device.type}: "
        + (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model())
        + f", torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} rounds")
    cpu_limit = (None, "")
    if device.type == "cpu":
        cpu_limit = load_cpu_limit()
        say(f"limit kernel: {cpu_limit[1]}" if cpu_limit[0] is not None else
            f"limit kernel: torch ops approximating the access pattern (no C++ compiler: {cpu_limit[1]})")
    else:
        say("limit kernel: Triton kernel with the step's access pattern; plus d2d copy_")
    rows = []
    for case in build_cases(args):
        try:
            rows += run_case(case, device, args, cpu_limit, say)
        except Exception as exc:  # one case (an OOM at 1B, say) must not lose the others
            say(f"  case {case.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({**{c: None for c in COLUMNS}, "case": case.name, "provider": "-",
                         "status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print(format_table(rows, device.type == "cuda"))
    print("x base: baseline median / provider median (baseline: torch-fused; torch-composite "
          "for bf16+master). % limit: limit median / provider median.")
    for key, text in LEGEND.items():
        print(f"  {key:<16} {text}")
    meta = metadata(device, args, notes)
    paths = write_outputs(rows, meta, Path(args.out), device, say)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} provider(s) failed: " + "; ".join(f"{r['case']}/{r['provider']}" for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    from zero_triton.tools.console import run
    sys.exit(run(main))
