"""Where the time of one training iteration goes, read from a Chrome trace.

The harness wraps every iteration in ``zero_triton.iteration`` and its parts in
``zero_triton.forward`` / ``zero_triton.backward`` / ``zero_triton.optimizer``
(record_function ranges on the training thread); ZeroAdam adds
``zero_triton.reduce_scatter`` / ``zero_triton.adam_step`` / ``zero_triton.all_gather``
inside its step. ``split_iterations`` cuts each iteration's wall time into disjoint
pieces, so that the rows add up to the iteration exactly:

exposed communication, per kind (reduce-scatter, all-reduce, all-gather, other)
    time the training thread waits for a collective: inside a ZeroAdam communication
    range; inside a collective call (``c10d::*``, ``record_param_comms``, ``nccl:*``,
    ``gloo:*`` on the training thread); or while a collective is in flight and nothing
    computes (on CPU: the training thread runs no operator, e.g. it sits in
    ``work.wait()``, which records no event; on a GPU: no compute kernel runs).
forward, backward, Adam step
    the harness ranges minus exposed communication inside them.
other
    the rest of the iteration (zero_grad, the profiler's own bookkeeping).

A collective is *in flight* while its backend works on it: the ``gloo:*`` events on
gloo's worker threads on CPU (and its point-to-point ``gloo:send``/``gloo:recv``,
recorded from the post to the end of the transfer on the posting thread), the NCCL
kernels on a GPU; it counts in the iteration
that started it. Hidden communication is in-flight time that is not exposed: the
training thread computed meanwhile (backward while DDP's buckets are all-reduced, or
ZeroAdam's once its communication overlaps). On CPU the training thread computes
while it runs an operator; a hole between operators shorter than ``GLUE_US`` is the
autograd engine or Python between two of them, a longer one with a collective in
flight is a wait.
A gloo range is of the kind of the call that queued it: the last call of the same
collective before it started (ZeroAdam launches its all-gathers and its reduce-scatters, on gloo
a send and a receive per peer each, inside ``zero_triton.all_gather`` /
``zero_triton.reduce_scatter`` ranges; its agreement's all-gather on a side group
inside ``zero_triton.comm.agreement``, an other collective).
Nothing here knows which optimizer ran: the same reading serves ZeroAdam with or
without ``overlap()`` and DDP.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ITERATION = "zero_triton.iteration"
FORWARD = "zero_triton.forward"
BACKWARD = "zero_triton.backward"
OPTIMIZER = "zero_triton.optimizer"
ADAM_STEP = "zero_triton.adam_step"
COMM_RANGES = {"zero_triton.reduce_scatter": "reduce_scatter",
               "zero_triton.all_gather": "all_gather",
               "zero_triton.agreement": "other_collective"}
# ZeroAdam's agreement (zero_triton.comm.agreement) exchanges one row per rank with an
# all-gather on a side group; that call records no collective event of its own.
_RANGE_OPS = {"zero_triton.agreement": "allgather"}

KINDS = ("reduce_scatter", "all_reduce", "all_gather", "other_collective")
# Table order: what the training thread does, in the order of an iteration.
ROWS = ("forward", "backward", "reduce_scatter", "all_reduce", "adam_step", "all_gather",
        "other_collective", "other")
LABELS = {"forward": "forward", "backward": "backward", "reduce_scatter": "reduce-scatter",
          "all_reduce": "all-reduce", "adam_step": "Adam step", "all_gather": "all-gather",
          "other_collective": "other collectives", "other": "other"}

# Between two operators the training thread spends a few microseconds in the autograd
# engine or in Python: a hole shorter than this is compute, a longer one with a
# collective in flight is a wait (work.wait() records no event of its own).
GLUE_US = 50.0

_HOST_COMM_PREFIXES = ("c10d::", "record_param_comms", "nccl:", "gloo:")
_P2P = ("gloo:send", "gloo:recv")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


# -- interval arithmetic on sorted, disjoint [start, end) lists ------------------------

def merge(spans) -> list:
    """Sorted, disjoint spans covering the same points as ``spans``."""
    out = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersect(a: list, b: list) -> list:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list, b: list) -> list:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def length(a: list) -> float:
    return sum(e - s for s, e in a)


# -- reading the trace -------------------------------------------------------------------

def comm_kind(name: str) -> str:
    """The kind of a collective from its name: ``c10d::_reduce_scatter_base_``,
    ``gloo:all_gather``, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` ..."""
    n = name.lower().replace("_", "")
    # ZeroAdam's reduce-scatter is an all-to-all and a sum (zero_triton.comm.group); nothing
    # else that these benchmarks run uses one.
    for needle, kind in (("reducescatter", "reduce_scatter"), ("alltoall", "reduce_scatter"),
                         ("allgather", "all_gather"), ("allreduce", "all_reduce")):
        if needle in n:
            return kind
    return "other_collective"


_OPS = ("reducescatter", "alltoall", "allgather", "allreduce", "broadcast", "send", "recv")
# gloo runs reduce_scatter_tensor as an all-reduce.
_QUEUED_BY = {"allreduce": ("allreduce", "reducescatter")}


def _op(name: str) -> str:
    """The collective a call or a gloo range runs (``c10d::alltoall_base_`` and
    ``gloo:all_to_all`` -> "alltoall"), whatever it is used for."""
    n = name.lower().replace("_", "")
    return next((op for op in _OPS if op in n), n)


def _span(e) -> tuple:
    return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))


def _is_host_comm(e) -> bool:
    return e["name"].startswith(_HOST_COMM_PREFIXES) and not _is_p2p(e)


def _is_p2p(e) -> bool:
    """gloo's point-to-point transfers (ZeroAdam's gradient averages): recorded on the
    thread that posts them, from the post until the transfer ends: in flight, not a
    call (the thread goes on)."""
    return e["name"] in _P2P


def _host_comm_kind(e, comm_ranges) -> str:
    """A collective call inside a ZeroAdam communication range is of that range's kind
    (gloo runs reduce_scatter_tensor as an all-reduce: its name would mislead)."""
    s, _ = _span(e)
    for (rs, re_), kind in comm_ranges:
        if rs <= s < re_:
            return kind
    args = e.get("args") or {}
    return comm_kind(str(args.get("Collective name") or e["name"]))


@dataclass
class IterationSplit:
    """One iteration cut into ``ROWS`` (ms; they sum to ``iteration_ms``), with the
    hidden and in-flight communication per kind (ms), and the Adam step's own figures:
    the host range (ms) and, on a GPU, the device kernels launched inside it."""
    start_us: float
    iteration_ms: float
    rows: dict
    hidden: dict
    in_flight: dict
    adam_step_ms: float
    adam_kernels: list = field(default_factory=list)   # [(name, ms)]
    spans: dict = field(default_factory=dict, repr=False)  # row or "hidden:<kind>" -> us spans


def split_iterations(events: list) -> list:
    """``IterationSplit`` per ``zero_triton.iteration`` range in ``events`` (a Chrome
    trace's ``traceEvents``), in order. Raises ValueError when there is none."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    iters = _iterations(xs)
    pid, main = iters[0]["pid"], iters[0]["tid"]
    on_main = [e for e in xs if e.get("pid") == pid and e.get("tid") == main]

    def ranges(name):
        return merge(_span(e) for e in on_main if e["name"] == name)

    forward, backward, optimizer, adam = (ranges(n) for n in (FORWARD, BACKWARD, OPTIMIZER, ADAM_STEP))
    comm_ranges = [(_span(e), COMM_RANGES[e["name"]]) for e in on_main if e["name"] in COMM_RANGES]
    calls = sorted((_span(e), _host_comm_kind(e, comm_ranges)) for e in on_main if _is_host_comm(e))
    device = [e for e in xs if e.get("cat") in _DEVICE_CATS]
    flight, compute = (_on_device(device) if device else
                       _on_cpu(xs, pid, main, on_main, calls, comm_ranges))
    launches = _launch_times(xs) if device else {}

    out = []
    for it in iters:
        window = [_span(it)]
        lo, hi = window[0]
        # A collective counts in the iteration that started it (every loop here waits for
        # its collectives before the next iteration): a range that gloo's thread closes
        # late, once the cores let it run again, does not leak into the next forward.
        mine = [(s, k) for s, k in flight if lo <= s[0] < hi]
        # Exposed: in a communication range or call, or in flight while nothing computes;
        # kinds in KINDS order, so that no instant counts twice.
        taken, spans = [], {}
        for kind in KINDS:
            waiting = merge([s for s, k in comm_ranges if k == kind] + [s for s, k in calls if k == kind]
                            + subtract(merge(s for s, k in mine if k == kind), compute))
            spans[kind] = subtract(intersect(waiting, window), taken)
            taken = merge(taken + spans[kind])
        for row, r in (("forward", forward), ("backward", backward), ("adam_step", optimizer)):
            spans[row] = subtract(intersect(r, window), taken)
        spans["other"] = subtract(window, merge(s for v in spans.values() for s in v))
        rows = {row: length(spans[row]) / 1e3 for row in ROWS}
        hidden, in_flight = {}, {}
        for kind in KINDS:
            busy = intersect(merge(s for s, k in mine if k == kind), window)
            in_flight[kind] = length(busy) / 1e3
            spans["hidden:" + kind] = subtract(busy, taken)
            hidden[kind] = length(spans["hidden:" + kind]) / 1e3
        adam_in = intersect(adam, window)
        kernels = [(e["name"], float(e["dur"]) / 1e3) for e in device
                   if not _is_nccl(e) and _inside(launches.get(_corr(e)), adam_in)]
        out.append(IterationSplit(float(it["ts"]), float(it["dur"]) / 1e3, rows, hidden, in_flight,
                                  length(adam_in) / 1e3, kernels, spans))
    return out


def _iterations(xs) -> list:
    """The harness's iteration ranges on the host (kineto repeats record_function ranges
    on the GPU's rows as ``gpu_user_annotation``: those are not ours to cut)."""
    iters = sorted((e for e in xs if e.get("name") == ITERATION and e.get("cat") != "gpu_user_annotation"),
                   key=lambda e: float(e["ts"]))
    if not iters:
        raise ValueError(f"the trace has no {ITERATION!r} range: it was not recorded by "
                         "`python -m zero_triton profile`")
    return iters


def _is_nccl(e) -> bool:
    return "nccl" in e["name"].lower()


def _on_device(device: list):
    """(in-flight collectives, compute) on a GPU: NCCL kernels, and every other kernel,
    copy and memset."""
    flight = [(_span(e), comm_kind(e["name"])) for e in device if _is_nccl(e)]
    return flight, merge(_span(e) for e in device if not _is_nccl(e))


def _on_cpu(xs, pid, main, on_main, calls, comm_ranges):
    """(in-flight collectives, compute) on CPU: gloo's ranges on its own threads, and the
    training thread's operators (holes under GLUE_US filled) outside collective calls."""
    # The calls that queue gloo's work, by the collective they run: ZeroAdam's all-gather
    # and its reduce-scatter are a send and a receive per peer on gloo (told apart by
    # the range they are queued in),
    # its agreement an all-gather that records no call (its range stands in for it).
    queued = {}
    for e in on_main:
        if e["name"] in _RANGE_OPS:
            queued.setdefault(_RANGE_OPS[e["name"]], []).append((_span(e)[0], COMM_RANGES[e["name"]]))
        elif _is_host_comm(e):
            queued.setdefault(_op(e["name"]), []).append((_span(e)[0], _host_comm_kind(e, comm_ranges)))
    by_op = {}
    starts = [s for (s, _), _ in calls]
    flight = []
    for e in xs:
        if e.get("pid") == pid and (e.get("tid") != main and e["name"].startswith("gloo:") or _is_p2p(e)):
            span = _span(e)
            # Of the kind of the last call of the same collective made before it started
            # (the call that queued it), else of the last call of any, else as its own
            # name says.
            o = _op(e["name"])
            if o not in by_op:
                by_op[o] = sorted(c for q in _QUEUED_BY.get(o, (o,)) for c in queued.get(q, ()))
            same = by_op[o]
            i = bisect.bisect_right(same, (span[0], "~")) - 1
            if i >= 0:
                flight.append((span, same[i][1]))
                continue
            i = bisect.bisect_right(starts, span[0]) - 1
            flight.append((span, calls[i][1] if i >= 0 else comm_kind(e["name"])))
    ops = merge(_span(e) for e in on_main
                if e.get("cat") == "cpu_op" and not _is_host_comm(e) and not _is_p2p(e))
    return flight, subtract(_close_gaps(ops, GLUE_US), merge(s for s, _ in calls))


def _close_gaps(spans: list, gap: float) -> list:
    """``spans`` with every hole shorter than ``gap`` filled."""
    out = []
    for s, e in spans:
        if out and s - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(e, out[-1][1]))
        else:
            out.append((s, e))
    return out


def _corr(e):
    return (e.get("args") or {}).get("correlation")


def _launch_times(xs) -> dict:
    """correlation id -> host time of the launch (runtime or driver API call)."""
    return {_corr(e): float(e["ts"]) for e in xs
            if e.get("cat") in _LAUNCH_CATS and _corr(e) is not None}


def _inside(t, spans) -> bool:
    return t is not None and any(s <= t < e for s, e in spans)


def mean_split(splits: list) -> dict:
    """Mean over iterations: {"iterations", "iteration_ms", "rows", "hidden",
    "in_flight", "adam_step_ms"} (ms)."""
    n = len(splits)
    if not n:
        raise ValueError("no iteration to average")

    def avg(get):
        return sum(get(s) for s in splits) / n
    return {"iterations": n,
            "iteration_ms": avg(lambda s: s.iteration_ms),
            "rows": {r: avg(lambda s: s.rows[r]) for r in ROWS},
            "hidden": {k: avg(lambda s: s.hidden[k]) for k in KINDS},
            "in_flight": {k: avg(lambda s: s.in_flight[k]) for k in KINDS},
            "adam_step_ms": avg(lambda s: s.adam_step_ms)}


# -- writing the reading back into the trace -----------------------------------------------

_TRACKS = {"phases": 1_000_000_001, "exposed": 1_000_000_002, "hidden": 1_000_000_003}


def annotate(trace: dict, splits: list) -> None:
    """Add three rows to the training process of ``trace`` (in place): the table's
    phases, exposed communication and hidden communication as this module counted
    them, so that a reader can check every millisecond of the table in Perfetto."""
    events = trace.setdefault("traceEvents", [])
    pid = _iterations([e for e in events if e.get("ph") == "X"])[0]["pid"]
    names = {"phases": "zero_triton: table rows (what the iteration was split into)",
             "exposed": "zero_triton: exposed communication (training thread waits)",
             "hidden": "zero_triton: hidden communication (in flight under compute)"}
    for key, tid in _TRACKS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": names[key]}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": -3 + list(_TRACKS).index(key)}})
    for split in splits:
        for key, spans in split.spans.items():
            if key.startswith("hidden:"):
                track, label = "hidden", LABELS[key.split(":", 1)[1]] + " (hidden)"
            else:
                track, label = "phases", LABELS[key]
                if key in KINDS:
                    label += " (exposed)"
            tracks = (track, "exposed") if key in KINDS else (track,)
            for t in tracks:
                for s, e in spans:
                    events.append({"ph": "X", "cat": "zero_triton", "name": label, "pid": pid,
                                   "tid": _TRACKS[t], "ts": s, "dur": e - s})
