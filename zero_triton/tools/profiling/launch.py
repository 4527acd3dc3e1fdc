"""Run one function on every rank: spawned gloo/NCCL ranks, or the ranks torchrun started.

``launch(fn, args, world_size, device_type, timeout_s)`` calls ``fn(args, rank,
world_size, device)`` on every rank inside an initialised process group and returns
the list of every rank's result, on rank 0 (None on the other ranks, which only exist
under torchrun). Nothing hangs: the process group and the wait for the ranks have a
timeout, and a rank that raises or dies is reported in one line (``RankFailure``).
A spawned rank's stdout goes to stderr, so that the caller's stdout carries only what
the caller prints (``--json``).
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from zero_triton.tools import outputs


class RankFailure(RuntimeError):
    """One line saying which rank failed and how."""


class _RankAborted(RankFailure):
    """A rank killed by SIGABRT: an abort inside torch or gloo, not a Python error."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _device(device_type: str, local_rank: int):
    import torch
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _run_and_gather(fn, args, device):
    """``fn`` on this rank, then every rank's result gathered on rank 0."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = fn(args, rank, world, device)
    every = [None] * world
    dist.all_gather_object(every, mine)
    return every if rank == 0 else None


def _write_traceback(out_dir, rank: int) -> str:
    """The full traceback in OUT/error_rank<r>.txt (the one-line error points there)."""
    try:
        path = Path(out_dir) / f"error_rank{rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with outputs.replacing(path, "w") as fh:
            fh.write(traceback.format_exc())
        return f" (traceback in {path})"
    except OSError:
        return ""


# On CPUs the ranks are forked from a server process that imported these once: a spawned
# rank spends ~4 s of a core importing torch before its first line, and a demo starts four.
_PRELOAD = ["torch", "torch.distributed"]
START_ENV = "ZERO_TRITON_RANK_START"


def start_context(device_type: str, fresh: bool = False):
    """(the multiprocessing context for ranks on ``device_type``, what a rank started from
    it needs of the caller: environment, working directory, sys.path; None when spawned).

    CPU ranks fork from a forkserver that preloaded torch, and start as a spawned rank
    would (the caller's environment and folder, its ``__main__`` imported afresh) without
    importing torch again. ``fresh`` ranks are spawned: those whose resident set is
    measured from their start (``bench/e2e.py``'s, ``memory --measure``'s), since a forked
    rank faults in again the library pages its server touched while importing (~15 MB of
    rise on a tiny model, the same for every configuration). CUDA ranks are spawned (no
    CUDA context crosses a fork), as they are where forkserver is missing.
    ``ZERO_TRITON_RANK_START=spawn|forkserver`` overrides the choice for CPU ranks."""
    import torch.multiprocessing as mp
    problem = start_env_problem()
    if problem:
        raise ValueError(problem)
    method = os.environ.get(START_ENV, "")
    if not method:
        method = "spawn" if fresh else "forkserver"
    if device_type != "cpu" or "forkserver" not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "spawn":
        return ctx, None
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx, (dict(os.environ), os.getcwd(), list(sys.path))


def start_env_problem() -> str | None:
    """What is wrong with ``ZERO_TRITON_RANK_START``, for a command's argument check
    (``ap.error``) before it starts anything; None when it is unset or valid."""
    method = os.environ.get(START_ENV, "")
    if method in ("", "spawn", "forkserver"):
        return None
    return f"{START_ENV}={method!r} is not a way to start ranks: set spawn or forkserver, or unset it"


def as_the_caller(caller) -> None:
    """In a rank forked from the server: the caller's environment, folder and sys.path,
    as a spawned rank would have them (the server kept those of when it started)."""
    if caller is None:
        return
    env, cwd, path = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path


def _spawned_rank(rank, world_size, port, fn, args, device_type, timeout_s, results,
                  caller=None):
    as_the_caller(caller)
    import torch
    import torch.distributed as dist
    os.dup2(2, 1)  # this rank prints nothing on the caller's stdout
    status = 1
    try:
        if device_type == "cpu":
            torch.set_num_threads(1)  # ranks share the cores: one thread each
        device = _device(device_type, rank)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            every = _run_and_gather(fn, args, device)
            results.put((rank, "ok", every))
            dist.barrier()  # nobody tears gloo down under a peer's last collective
        finally:
            dist.destroy_process_group()
        status = 0
    except BaseException as exc:  # report, never hang the parent
        results.put((rank, "error", _one_line(exc) + _write_traceback(getattr(args, "out", "."), rank)))
    # Leave without interpreter finalisation (gloo's threads can still hold tensors and
    # abort the process there), once the queue has handed our result over.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# What a rank says when a peer went away first: the peer's own message is the cause.
_CONSEQUENCES = ("failed on rank", "Connection closed", "Connection reset", "Broken pipe")


def _is_consequence(message: str) -> bool:
    return any(text in message for text in _CONSEQUENCES)


def _exit_text(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def spawn(fn, args, world_size: int, device_type: str, timeout_s: float,
          run_timeout_s: float | None = None, fresh: bool = False):
    """``fn`` on ``world_size`` new ranks; rank 0's gathered list of results.
    ``timeout_s`` bounds each collective's wait, ``run_timeout_s`` (default: the same)
    the whole run beyond starting up. ``fresh``: spawned, not forked (``start_context``).

    A rank that dies of SIGABRT (seen once in five full test runs on 2 loaded cores, DDP
    under torch.profiler on gloo, with no Python error) is run again once, saying so on
    stderr; a second abort, any other death and any Python error are reported."""
    try:
        return _spawn_once(fn, args, world_size, device_type, timeout_s, run_timeout_s, fresh)
    except _RankAborted as exc:
        print(f"zero_triton: {exc}; running the ranks again once", file=sys.stderr, flush=True)
    try:
        return _spawn_once(fn, args, world_size, device_type, timeout_s, run_timeout_s, fresh)
    except _RankAborted as exc:
        raise RankFailure(f"{exc} (twice)") from None


def _spawn_once(fn, args, world_size: int, device_type: str, timeout_s: float,
                run_timeout_s: float | None, fresh: bool):
    ctx, caller = start_context(device_type, fresh)
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_spawned_rank, daemon=True,
                         args=(r, world_size, port, fn, args, device_type, timeout_s, results,
                               caller))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reported, errors, gathered = set(), {}, None
    # Starting (imports, a first-use build of the CPU kernels) counts against the limit too.
    run_s = timeout_s if run_timeout_s is None else run_timeout_s
    deadline = time.monotonic() + run_s + 60
    try:
        while len(reported) < world_size:
            left = deadline - time.monotonic()
            if left <= 0 and errors:  # the others stayed silent after a rank failed
                break
            if left <= 0:
                missing = sorted(set(range(world_size)) - reported)
                raise RankFailure(f"rank(s) {missing} did not finish within {run_s:.0f} s; "
                                  "raise --timeout for a larger run")
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in reported and not p.is_alive() and p.exitcode != 0]
                if dead and results.empty():
                    r = dead[0]
                    then = f"; rank {min(errors)} then: {errors[min(errors)][:160]}" if errors else ""
                    aborted = procs[r].exitcode == -signal.SIGABRT
                    raise (_RankAborted if aborted else RankFailure)(
                        f"rank {r} died without a word ({_exit_text(procs[r].exitcode)}){then}")
                continue
            reported.add(rank)
            if status == "ok":
                if rank == 0:
                    gathered = payload
            else:
                errors[rank] = payload
                # The others fail within seconds once a peer is gone; give a rank that
                # died outright the chance to show up as the cause.
                deadline = min(deadline, time.monotonic() + 10)
        if errors:
            r = min(errors, key=lambda k: (_is_consequence(errors[k]), k))  # the cause first
            raise RankFailure(f"rank {r} failed: {errors[r]}")
        return gathered
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def from_torchrun(fn, args, device_type: str, timeout_s: float):
    """``fn`` on this rank of a torchrun job; the gathered list on rank 0, else None."""
    import torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(device_type, local_rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        every = _run_and_gather(fn, args, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return every
