"""Run a function on N gloo ranks in spawned CPU processes, with a hard timeout.

``run_ranks(fn, world_size, *args)`` returns the list of what ``fn(rank, world_size,
*args)`` returned on each rank (it must be picklable). An exception on any rank is
re-raised here with that rank's traceback; a rank that hangs past ``timeout`` fails the
test instead of hanging it.
"""
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue, pg_timeout_s):
    import datetime

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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout_s))
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
    for flats in opt._flats:
        for f in flats:
            def late(k, launch=f.gather_bucket):
                time.sleep(seconds)
                launch(k)
            f.gather_bucket = late
