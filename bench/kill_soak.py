#!/usr/bin/env python
"""Kill-point soak: a rank SIGKILLed at a collective of ``step()`` fails every survivor
within seconds, naming what failed, and every survivor exits.

    python bench/kill_soak.py --runs 24                      # 2 to 8 ranks, every config
    python bench/kill_soak.py --runs 6 --worlds 3 --seed 100 # one world size

Each run starts ``world`` plain processes (``env://``, gloo, CPU, no launcher that would
kill the others when one dies; the process group's timeout ``--pg-timeout``, 60 s) on a
small training script with ``ZeroAdamW``, its configuration drawn by the seed: stage 1
or 2, offloaded (``offload="cpu"``) or not, a flat group or a 2-D (replicate x shard)
mesh where the world size allows, clipping on, one bucket or many (``--release``: every run
stage 2 with ``grad_release=True``, not offloaded, without clipping). The last rank wraps
``torch.distributed``'s collectives (every one a step calls: the agreement's all-reduce,
each bucket's sends and receives, each gather, clipping's all-reduce) and counts the
calls of its second ``step()``; in its third ``step()`` it SIGKILLs itself at the call
the seed draws (a phase drawn among the phases the second step called, the innermost
``zero_triton`` functions on the stack, then one of that phase's calls), after writing
the time and the phase. Each survivor writes the time and the
message of the exception it raised.

``--phase serve`` kills the last rank instead while its shard server answers a
``state_dict()`` that rank 0 calls alone before the third step (the served state), at
the answer's send the seed draws (its header or one of its first two chunks).

Prints the runs, the phases hit (how many kills at each), the survivors that raised
within ``--bar`` seconds of the kill (10), the slowest survivor's raise and exit after the
kill, and every run that broke the bar (a survivor that raised late, never raised, did not
exit, or whose message names no phase). Exit status 1 when any did.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent(r"""
    import json, os, signal, sys, threading, time, traceback
    import torch, torch.distributed as dist
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = os.path.join(cfg["dir"], f"rank{rank}.json")
    victim = rank == world - 1
    calls = {"count": 0, "armed": None, "record": None}

    def phase():
        # the zero_triton functions on the stack, innermost first, less the helpers
        # every collective passes through: the collective's phase
        f, names = sys._getframe(2), []
        while f is not None and len(names) < 3:
            name, fn = f.f_code.co_filename, f.f_code.co_name
            if ("zero_triton" in name and "kill_soak" not in name and not fn.startswith("<")
                    and fn not in ("_swap_rows", "_collective", "settled", "__exit__", "__enter__")):
                names.append(f"{os.path.basename(name)[:-3]}.{fn}")
            f = f.f_back
        return " < ".join(names) or "?"

    def wrap(name):
        inner = getattr(dist, name)
        def wrapped(*a, **k):
            calls["count"] += 1
            if calls["record"] is not None:
                calls["record"].append(f"{phase()} ({name})")
            if calls["armed"] is not None and calls["count"] == calls["armed"]:
                with open(out, "w") as fh:
                    json.dump({"killed": time.time(), "collective": name, "phase": phase(),
                               "index": calls["armed"]}, fh)
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(*a, **k)
        setattr(dist, name, wrapped)

    if victim:  # before zero_triton is imported: its modules may keep references
        for name in ("all_reduce", "broadcast", "isend", "irecv", "send", "recv",
                     "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
                     "all_to_all_single", "all_gather_object", "barrier", "gather"):
            wrap(name)
        # the agreement's all-gather on the side group is the group's own method
        dist._zt_side = dist.ProcessGroupGloo._allgather_base
        wrap("_zt_side")
        dist.ProcessGroupGloo._allgather_base = lambda self, *a, **k: dist._zt_side(self, *a, **k)
        # the served state: a shard server's answer is a send on the side group
        side_send = dist.ProcessGroupGloo.send
        def send(self, *a, **k):
            # the answer's send the seed draws (its header, or a chunk): the server thread's
            # sends only (the step's gathers may send on the same group)
            if cfg["serve"] and threading.current_thread().name.startswith("zero_triton shard server"):
                calls["sends"] = calls.get("sends", -1) + 1
                if calls["sends"] == cfg["draw"] % 3:
                    with open(out, "w") as fh:
                        json.dump({"killed": time.time(), "collective": f"send {calls['sends']}",
                                   "phase": phase() + " (the served state)", "index": 0}, fh)
                    os.kill(os.getpid(), signal.SIGKILL)
            return side_send(self, *a, **k)
        dist.ProcessGroupGloo.send = send
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
    from zero_triton import ZeroAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(4)])
    kw = {"stage": cfg["stage"], "bucket_cap_mb": cfg["bucket_cap_mb"], "max_grad_norm": 1.0}
    if cfg["offload"]:
        kw["offload"] = "cpu"
    if cfg["release"]:  # each bucket stepped in backward as its average lands; no clipping
        kw.update(grad_release=True, max_grad_norm=None)
    if cfg["mesh"]:
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", tuple(cfg["mesh"]), mesh_dim_names=("replicate", "shard"))
    try:
        opt = ZeroAdamW(model.parameters(), lr=1e-3, **kw)
        for step in range(4):
            x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step * 100 + rank))
            if cfg["serve"] and step == 2:
                # rank 0 alone asks for the whole state; the victim dies answering it
                if rank == 0:
                    opt.state_dict()
            model(x).pow(2).mean().backward()
            if victim and step == 1:
                calls["record"] = []
            if victim and step == 2 and not cfg["serve"]:
                # a phase drawn among those step 2 called, then one of its calls
                seen = calls["record"]
                phases = sorted(set(seen))
                with open(out + ".phases", "w") as fh:
                    json.dump(phases, fh)
                pick = phases[cfg["draw"] % len(phases)]
                if cfg.get("phase"):  # asked for: the first phase that names it
                    pick = next(ph for ph in phases if cfg["phase"] in ph)
                hits = [i for i, ph in enumerate(seen) if ph == pick]
                calls["armed"] = calls["count"] + 1 + hits[(cfg["draw"] // len(phases)) % len(hits)]
                calls["record"] = None
            opt.step()
            opt.zero_grad()
        with open(out, "w") as fh:
            json.dump({"finished": time.time()}, fh)
    except Exception as exc:
        with open(out, "w") as fh:
            json.dump({"raised": time.time(), "message": f"{type(exc).__name__}: {exc}"}, fh)
        raise
""")


def draw(seed: int, world: int) -> dict:
    rng = random.Random(seed)
    meshes = [None] + [[r, world // r] for r in (2,) if world % r == 0 and world // r >= 2]
    return {"stage": rng.choice([1, 2]), "offload": rng.random() < 0.5,
            "mesh": rng.choice(meshes), "bucket_cap_mb": rng.choice([0.004, 0.02, 25]),
            "draw": rng.randrange(1 << 30), "release": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(seed: int, world: int, pg_timeout: float, limit: float, phase: str | None = None,
            **overrides) -> dict:
    """One run: ``seed``'s configuration (``overrides`` replace its keys) at ``world``
    ranks, killed at a call of the phase the seed draws (``phase``: the first phase whose
    name holds it)."""
    cfg = {**draw(seed, world), **overrides, "phase": phase, "serve": phase == "serve"}
    with tempfile.TemporaryDirectory() as d:
        cfg["dir"], cfg["pg_timeout"] = d, pg_timeout
        script = os.path.join(d, "train.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, script, json.dumps(cfg)],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        start, exits = time.time(), {}
        while len(exits) < world and time.time() - start < limit:
            for r, p in enumerate(procs):
                if r not in exits and p.poll() is not None:
                    exits[r] = (time.time(), p.returncode)
            time.sleep(0.01)
        for r, p in enumerate(procs):
            if r not in exits:
                p.kill()
                p.wait()
        reports = {}
        for r in range(world):
            try:
                with open(os.path.join(d, f"rank{r}.json")) as fh:
                    reports[r] = json.load(fh)
            except (OSError, ValueError):
                reports[r] = {}
        stderr = {r: p.stderr.read()[-2000:] for r, p in enumerate(procs)}
        try:
            with open(os.path.join(d, f"rank{world - 1}.json.phases")) as fh:
                offered = json.load(fh)
        except (OSError, ValueError):
            offered = []
    victim = reports[world - 1]
    result = {"seed": seed, "world": world,
              "cfg": {k: cfg[k] for k in ("stage", "offload", "mesh", "bucket_cap_mb", "release")},
              "phase": victim.get("phase"), "collective": victim.get("collective"),
              "raise": [], "exit": [], "bad": [], "offered": offered, "messages": []}
    if "killed" not in victim:
        result["bad"].append(f"the victim did not die at a collective: {victim} {stderr[world - 1][-600:]}")
        return result
    t0 = victim["killed"]
    for r in range(world - 1):
        rep = reports[r]
        if "raised" not in rep:
            result["bad"].append(f"rank {r} did not raise: {rep} {stderr[r][-300:]}")
            continue
        result["raise"].append(rep["raised"] - t0)
        msg = rep["message"]
        if "failed on rank" not in msg and "zero_triton" not in msg:
            result["bad"].append(f"rank {r} raised without naming the phase: {msg[:300]}")
        if r not in exits:
            result["bad"].append(f"rank {r} did not exit within {limit:.0f} s")
        else:
            result["exit"].append(exits[r][0] - t0)
    result["messages"] = sorted({reports[r].get("message", "")[:160] for r in range(world - 1)})
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=24, help="runs per world size (default 24)")
    ap.add_argument("--worlds", default="2,3,4,5,6,8", help="world sizes (default 2,3,4,5,6,8)")
    ap.add_argument("--seed", type=int, default=0, help="the first run's seed (default 0)")
    ap.add_argument("--pg-timeout", type=float, default=60.0, help="the process group's timeout, s")
    ap.add_argument("--bar", type=float, default=10.0, help="seconds a survivor may take to raise")
    ap.add_argument("--phase", default=None,
                    help="kill at the first phase whose name holds this instead of a drawn one; "
                         "'serve': rank 0 alone calls state_dict() before the third step and the "
                         "last rank dies answering it (flat groups: every rank is asked)")
    ap.add_argument("--release", action="store_true",
                    help="every run ZeroAdamW(stage=2, grad_release=True) (not offloaded, no "
                         "clipping): the kills fall in the releasing backward and in step()")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    results, phases, late = [], collections.Counter(), []
    seed = args.seed
    for world in worlds:
        for _ in range(args.runs):
            extra = {"mesh": None} if args.phase == "serve" else {}
            if args.release:
                extra.update(release=True, stage=2, offload=False)
            res = run_one(seed, world, args.pg_timeout, args.pg_timeout + 30, args.phase, **extra)
            seed += 1
            if res["raise"] and max(res["raise"]) > args.bar:
                res["bad"].append(f"slowest raise {max(res['raise']):.1f} s > {args.bar} s")
            results.append(res)
            phases[f"{res['phase']} ({res['collective']})"] += 1
            tag = "BAD" if res["bad"] else "ok"
            print(f"[{tag}] seed {res['seed']} world {world} {res['cfg']} killed at {res['phase']} "
                  f"({res['collective']}): raise max {max(res['raise'], default=float('nan')):.2f} s, "
                  f"exit max {max(res['exit'], default=float('nan')):.2f} s", flush=True)
            for b in res["bad"]:
                print("      " + b, flush=True)
            if res["bad"]:
                late.append(res)
    raises = [t for r in results for t in r["raise"]]
    exits = [t for r in results for t in r["exit"]]
    survivors = sum(r["world"] - 1 for r in results)
    print(f"\n{len(results)} runs at world sizes {worlds}; {survivors} survivors; "
          f"{sum(t <= args.bar for t in raises)} raised within {args.bar:.0f} s")
    print(f"slowest raise {max(raises, default=float('nan')):.2f} s, slowest exit "
          f"{max(exits, default=float('nan')):.2f} s after the kill")
    print("phases hit:")
    for k, n in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {k}")
    print(f"runs that broke the bar: {len(late)}")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
