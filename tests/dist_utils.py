"""Run a function on N gloo ranks in fresh CPU processes, with a hard timeout.

``run_ranks(fn, world_size, *args)`` returns the list of what ``fn(rank, world_size,
*args)`` returned on each rank (it must be picklable). An exception on any rank is
re-raised here with that rank's traceback; a rank that hangs past ``timeout`` fails the
test instead of hanging it.

The ranks are forked from a server process that imported torch (and torch._dynamo, which
building any torch optimizer imports) once, not spawned: a spawned rank spent ~3 s of
imports before its first line, times two ranks, times every multi-rank test. Each rank
starts with the caller's environment, working directory and sys.path, as a spawned one
would; what it imports or changes dies with it. ``ZT_TEST_SPAWN=1`` spawns them instead.
"""
import importlib.util
import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "triton")
_context = None


def _mp_context():
    global _context
    if _context is None:
        if os.environ.get("ZT_TEST_SPAWN", "") not in ("", "0") or \
                "forkserver" not in mp.get_all_start_methods():
            _context = mp.get_context("spawn")
        else:
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(
                [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
    return _context


def _ephemeral() -> tuple:
    """The range the system hands out for port 0 (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = map(int, fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, for a rendezvous this test makes next. Not one the system would
    hand out for port 0: every gloo listener and outgoing connection takes one of those,
    and one could take this port before the store binds it. Under pytest-xdist, only
    ports of this worker's residue class, so that tests on two workers never pick the
    same one (a rank once joined another test's group: "connectFullMesh failed")."""
    import random
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    index = int(worker) if worker.isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    low, high = _ephemeral()
    first, last = (10000, low - 1) if low - 10000 >= 4096 else (high + 1, 65535)
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(first, last + 1 - count)
        port += (index - port) % count
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free outside that range: any port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_caller(env, cwd, path) -> None:
    """In a process forked from the server: the caller's world, as spawn gives it (the
    server kept the environment, folder and sys.path of when it started)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path


def _entry(rank, world_size, port, fn, args, queue, pg_timeout_s, caller=None):
    import datetime

    if caller is not None:
        _as_caller(*caller)
    import torch
    import torch.distributed as dist
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            result = fn(rank, world_size, *args)
            queue.put((rank, "ok", result))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RankError(RuntimeError):
    def __init__(self, errors):
        self.errors = errors  # {rank: message}
        super().__init__("\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))


def run_ranks(fn, world_size, *args, timeout=120, pg_timeout_s=60, allow_errors=False):
    ctx = _mp_context()
    queue = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd(), list(sys.path)) \
        if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout_s, caller))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s "
                                   f"(errors so far: {errors})")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    missing = sorted(set(range(world_size)) - set(results) - set(errors))
                    if missing:
                        raise RuntimeError(f"ranks {missing} died without reporting "
                                           f"(exit codes {[p.exitcode for p in procs]})")
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors and not allow_errors:
        raise RankError(errors)
    if allow_errors:
        return results, errors
    return [results[r] for r in range(world_size)]


def delay_gathers(opt, seconds: float) -> None:
    """This rank starts each all-gather of ``opt`` ``seconds`` late: the other ranks'
    gathers land that long after their ``step()`` returned."""
    import time
    for flats in opt._shards.groups:
        for f in flats:
            def late(k, launch=f.gather_bucket):
                time.sleep(seconds)
                launch(k)
            f.gather_bucket = late


def delay_offload(opt, rng, most_s: float = 0.004) -> None:
    """This rank sleeps a random while (``rng``, up to ``most_s``) before each stage of
    ``opt``'s offload pipeline (each gradient copy to the host, host step, copy back) and
    before each all-gather."""
    import time

    def late(fn):
        def call(*args):
            time.sleep(rng.random() * most_s)
            return fn(*args)
        return call
    for flats in opt._shards.groups:
        for f in flats:
            for side in f.sides:  # a part offloaded: the device's side too
                for name in ("fetch", "grad", "done"):
                    setattr(side.place, name, late(getattr(side.place, name)))
            f.gather_bucket = late(f.gather_bucket)


def soak_run(fn, world_size, *args, timeout: float, what: str):
    """One run of a soak (``bench/*_soak.py``): ``("ok", results, seconds)``, or
    ``("hang" | "error", None, seconds)`` with the reason printed under ``what``."""
    import time
    start = time.monotonic()
    try:
        results = run_ranks(fn, world_size, *args, timeout=timeout, pg_timeout_s=timeout)
    except TimeoutError as exc:
        print(f"  {what}: {exc}", file=sys.stderr)
        return "hang", None, time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - counted and shown by the soak
        print(f"  {what}: {exc}", file=sys.stderr)
        return "error", None, time.monotonic() - start
    return "ok", results, time.monotonic() - start


def _python_entry(argv, caller, out_path, err_path):
    """``python ARGV`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT.py ...``) in a
    process forked from the server: the caller's environment and folder, the sys.path a
    new interpreter would have, stdout and stderr into files, and the exit status the
    interpreter would give (SystemExit's code; 1 and a traceback for an exception)."""
    env, cwd, path = caller
    first = {"-m": cwd, "-c": ""}.get(argv[0]) or os.path.dirname(os.path.abspath(argv[0]))
    _as_caller(env, cwd, [first, *path])  # sys.path[0] as the interpreter sets it
    for fd, name in ((1, out_path), (2, err_path)):
        target = os.open(name, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    import runpy
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")


_INTERPRETER_PATHS: dict = {}


def _interpreter_path(env) -> list:
    """sys.path of a new interpreter in ``env``, less its first entry (the script's
    folder, the working directory or '')."""
    import json
    import subprocess
    key = (env.get("PYTHONPATH", ""), env.get("PYTHONHOME", ""), env.get("PYTHONNOUSERSITE", ""))
    if key not in _INTERPRETER_PATHS:
        out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                             capture_output=True, text=True, env=env, check=True, timeout=60)
        _INTERPRETER_PATHS[key] = json.loads(out.stdout)
    return _INTERPRETER_PATHS[key]


def run_python(argv, *, env=None, cwd=None, timeout=120):
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``,
    in a process forked from the server that imported torch (the ~4 s each ``python -m
    zero_triton ...`` spends importing it), not a new interpreter: for tests of what a
    command prints and its exit status. Tests of how an interpreter ends (signals, exit
    at finalisation) or of what a process imports first run a real one. ``ZT_TEST_SPAWN=1``
    runs a real one here too."""
    import subprocess
    import tempfile
    argv = [str(a) for a in argv]
    ctx = _mp_context()
    if ctx.get_start_method() != "forkserver":
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)
    env = dict(os.environ if env is None else env)
    caller = (env, os.path.abspath(cwd or os.getcwd()), _interpreter_path(env))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for name in (out, err):
            open(name, "w").close()
        proc = ctx.Process(target=_python_entry, args=(argv, caller, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        with open(out) as fh_out, open(err) as fh_err:
            stdout, stderr = fh_out.read(), fh_err.read()
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, stdout, stderr)
