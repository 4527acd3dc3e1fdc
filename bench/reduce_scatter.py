#!/usr/bin/env python
"""ZeroAdam's two collectives against torch's, side by side, on gloo.

ZeroAdam averages a bucket by moving each chunk to its owner (on gloo a send and a
receive per peer) and summing in rank order
(``zero_triton.comm.group.GroupComm.reduce_scatter_avg``): the same bits for any bucket size;
and on gloo it gathers a bucket's updated parameters pairwise in place, a send to and a
receive from each peer (``GroupComm.all_gather``), where gloo's all-gather receives into a
temporary of the bucket's size and copies it out. This times each against torch's
(``reduce_scatter_tensor(..., op=AVG)``, ``all_gather_into_tensor``) on the same buffer,
interleaved, on gloo CPU ranks (one thread each), and prints the median ms of each and
their ratio per world size. The gather is also timed against the one it replaced, one
in-place broadcast per rank (faster on some sizes, but a survivor of a dead peer could
wait in it for the process group's timeout: ``bench/kill_soak.py``).

    python bench/reduce_scatter.py                 # 2 and 4 ranks, 26 MB of fp32
    python bench/reduce_scatter.py --ranks 2,3 --mb 8 --repeats 9
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from zero_triton.comm.group import GroupComm, _all_gather, _reduce_scatter
from zero_triton.tools.profiling import launch
from zero_triton.tools.units import positive_number, whole_number


PAIRS = [(("torch reduce_scatter_tensor (AVG)", "average"),
          ("zero_triton pairwise + ordered sum", "average")),
         (("torch all_gather_into_tensor", "gather"),
          ("zero_triton pairwise gather", "gather")),
         (("broadcast per rank (the former gather)", "broadcast"),
          ("zero_triton pairwise gather", "gather"))]


def _broadcasts(full, shard, rank, world):
    """The former gloo gather: one in-place broadcast per rank into its chunk."""
    chunks = full.view(world, -1)
    chunks[rank].copy_(shard)
    for w in [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(chunks)]:
        w.wait()


def _rank(args, rank, world, device):
    n = int(args.mb * 2**20) // 4 // (16 * world) * 16 * world  # a whole number of shards
    grad = torch.randn(n)
    comm = GroupComm()
    out, recv = torch.empty(n // world), torch.empty(comm.recv_numel(n))
    full = torch.randn(n)
    shard = full.view(world, -1)[rank]
    ops = {}
    for (theirs, torch_op), (ours, our_op) in PAIRS:
        ops[theirs] = {"average": lambda: _reduce_scatter(out, grad, op=dist.ReduceOp.AVG),
                       "gather": lambda: _all_gather(full, shard),
                       "broadcast": lambda: _broadcasts(full, shard, rank, world)}[torch_op]
        ops[ours] = {"average": lambda: comm.reduce_scatter_avg(out, grad, recv),
                     "gather": lambda: comm.all_gather(full, shard)}[our_op]
    ms = {k: [] for k in ops}
    for i in range(args.repeats + 1):  # the first round warms the connections up
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            if i:
                ms[name].append((time.perf_counter() - t0) * 1e3)
    return {"numel": n, "ms": ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=lambda s: [whole_number(2, "2")(x) for x in s.split(",")],
                    default=[2, 4], help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--mb", type=positive_number(), default=25.0,
                    help="MiB of fp32 gradients per call (default 25, DDP's bucket size)")
    ap.add_argument("--repeats", type=whole_number(1), default=7, help="timed calls (default 7)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    for world in args.ranks:
        ranks = launch.spawn(_rank, args, world, "cpu", 300.0)
        # a call takes as long as its slowest rank
        per_call = {k: [max(r["ms"][k][i] for r in ranks) for i in range(args.repeats)]
                    for k in ranks[0]["ms"]}
        med = {k: statistics.median(v) for k, v in per_call.items()}
        print(f"world size {world}, gloo, {ranks[0]['numel'] * 4 / 2**20:.1f} MiB fp32, "
              f"median of {args.repeats}:")
        for (theirs, what), (ours, _) in PAIRS:
            for k in (theirs, ours):
                print(f"  {k:<40} {med[k]:8.2f} ms  (min-max {min(per_call[k]):.2f}-{max(per_call[k]):.2f})")
            print(f"  {what}: {theirs.split(' (')[0]} / {ours}: {med[theirs] / med[ours]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
