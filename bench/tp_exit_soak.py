"""FSDP2 + tensor parallel, load and step, then exit: how each run ends.

    python bench/tp_exit_soak.py --runs 40
    python bench/tp_exit_soak.py --runs 40 --no-destroy     # end without destroy_process_group
    python bench/tp_exit_soak.py --runs 40 --control        # torch.optim.AdamW, no zero_triton

Each run starts 4 plain processes (``env://``, gloo, CPU) on the model and layout of
``bench/tp_layouts.py`` (2x2: dp x tp), each building FusedAdamW (int8 moments), loading a
DCP checkpoint saved once before the runs (compact form) and stepping twice; then the
script ends (with ``destroy_process_group()``, or without). ``--control`` runs the same
script with ``torch.optim.AdamW`` (torch's state dict format) and never imports
zero_triton: what FSDP2, DTensor and DCP do at the end by themselves. Prints the exit statuses seen
(a negative status is a signal: -6 is SIGABRT) and, for each run that did not end 0, the
last lines of the stderr of its ranks that did not. Exit status 1 when any run ended
otherwise.
"""
from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {bench!r})
    import tp_layouts as bench
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    mode, path, destroy, control = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
    dist.init_process_group("gloo")
    net = bench.build("2x2", torch.float32)
    if control:  # torch's optimizer and state dicts: zero_triton is never imported
        from torch.distributed.checkpoint.state_dict import get_state_dict
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        bench._state_dicts = lambda net, opt, kind: get_state_dict(net, opt)
    else:
        opt = bench._optimizer(net, "int8")
    if mode == "save":
        for t in range(2):
            bench._grads(net, t, torch.float32)
            opt.step()
            opt.zero_grad()
        msd, osd = bench._state_dicts(net, opt, "compact")
        dcp.save({{"model": msd, "optim": osd}}, checkpoint_id=path)
    else:
        msd, osd = bench._state_dicts(net, opt, "compact")
        sd = {{"model": msd, "optim": osd}}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for t in range(2, 4):
            bench._grads(net, t, torch.float32)
            opt.step()
            opt.zero_grad()
    if destroy:
        dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, mode: str, path: str, destroy: bool, timeout: float, control: bool) -> list:
    """One run of 4 ranks: (exit status, stderr tail) per rank."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, mode, path, "1" if destroy else "0",
                               "1" if control else "0"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(4)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(killed: past the timeout)"
        out.append((p.returncode, err[-800:]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--no-destroy", action="store_true", help="end without destroy_process_group()")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--control", action="store_true",
                    help="torch.optim.AdamW instead of FusedAdamW: zero_triton never imported")
    args = ap.parse_args(argv)
    statuses, bad = collections.Counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "run.py")
        Path(script).write_text(SCRIPT.format(bench=str(BENCH)))
        saved = run(script, "save", f"{tmp}/ckpt", True, args.timeout, args.control)
        if any(code for code, _ in saved):
            print("the checkpoint could not be saved:", *[e for _, e in saved], sep="\n")
            return 1
        for i in range(args.runs):
            ranks = run(script, "load", f"{tmp}/ckpt", not args.no_destroy, args.timeout, args.control)
            for code, _ in ranks:
                statuses[code] += 1
            if any(code for code, _ in ranks):
                bad.append((i, ranks))
                print(f"run {i}: statuses {[c for c, _ in ranks]}", flush=True)
                for r, (code, err) in enumerate(ranks):
                    if code:
                        print(f"  rank {r} ({code}): ...{err[-400:]}", flush=True)
    print(f"{args.runs} runs x 4 ranks ({'no destroy' if args.no_destroy else 'destroy'}"
          f"{', control: torch.optim.AdamW' if args.control else ''}): "
          f"statuses {dict(statuses)}; runs with a rank that did not end 0: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
