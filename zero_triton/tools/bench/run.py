"""One case timed: every provider interleaved round by round, after the guard that
checks each against torch and the float64 reference."""
from __future__ import annotations

import gc
import importlib.util
import math
import os
import statistics
import time

import torch

from zero_triton.tools.bench import providers as provide
from zero_triton.tools.bench.cases import (BETAS, BYTES_PER_PARAM, EPS, GUARD_LP_RTOL, GUARD_RTOL,
                                           GUARD_STEPS, INTERPRET_MAX_NUMEL, LR, REF_SLICE,
                                           format_size)
from zero_triton.tools.bench.providers import Provider
from zero_triton.tools.machine import cache_bytes

# -- timing -----------------------------------------------------------------------------


class Timer:
    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(self, fns, calls, start_index=0):
        """Seconds per call of ``calls`` calls rotating over ``fns``."""
        if self.cuda:
            # CUDA events around the calls, as triton.testing.do_bench; buffer sets
            # rotate instead of do_bench's L2 flush, which would be timed with them.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for i in range(calls):
                fns[(start_index + i) % len(fns)]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for i in range(calls):
            fns[(start_index + i) % len(fns)]()
        return (time.perf_counter() - t0) / calls


def _percentile(values, q):
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# -- the guard --------------------------------------------------------------------------

def _max_rel(a_list, b_list, chunk=1 << 24) -> float:
    """max|a - b| / max|b| over lists of tensors, in chunks (no full-size temporaries
    next to 1B-param buffers on a full GPU)."""
    num = den = 0.0
    for a, b in zip(a_list, b_list):
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        for lo in range(0, b.numel(), chunk):
            bs = b[lo:lo + chunk].float()
            num = max(num, float((a[lo:lo + chunk].float() - bs).abs().max()))
            den = max(den, float(bs.abs().max()))
    return num / den if den > 0 else num


def _reference_slice(case, p0s, g0s):
    """zero_triton.reference's float64 step on a slice of tensor 0, GUARD_STEPS times."""
    from zero_triton.reference import torch_adam_step_
    k = min(REF_SLICE, p0s[0].numel())
    p = p0s[0].reshape(-1)[:k].float().cpu().clone()
    g = g0s[0].reshape(-1)[:k].cpu().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, GUARD_STEPS + 1):
        torch_adam_step_(p, g, m, v, None, t, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                         weight_decay=0.0, adamw=False, amsgrad=False, maximize=False)
    return k, {"p": [p], "m": [m], "v": [v]}


def _guard(case, providers, p0s, g0s):
    """Step every optimizer provider GUARD_STEPS times on set 0 (identical data) and
    compare with the baseline and the reference. Returns {id: (passed, max_rel, text)}."""
    results = {}
    stepped = [pr for pr in providers if pr.states]
    for pr in stepped:
        for _ in range(GUARD_STEPS):
            pr.fns[0]()
    base = next((pr for pr in stepped if pr.id == case.baseline), None)
    k, ref = _reference_slice(case, p0s, g0s)
    base_state = base.state(0) if base is not None else None
    for pr in stepped:
        s = pr.state(0)
        diffs = {}
        if base_state is not None and pr is not base:
            diffs["vs_" + case.baseline] = max(_max_rel(s[key], base_state[key]) for key in "pmv")
        diffs["vs_reference"] = max(
            _max_rel([s[key][0].reshape(-1)[:k].cpu()], ref[key]) for key in "pmv")
        worst = max(diffs.values())
        passed = worst < GUARD_RTOL
        if case.mixed and base_state is not None and pr is not base:
            lp = _max_rel(s["lp"], base_state["lp"])
            diffs["bf16_params_vs_" + case.baseline] = lp
            passed = passed and lp < GUARD_LP_RTOL
        text = ", ".join(f"{name} {value:.1e}" for name, value in diffs.items())
        results[pr.id] = (passed, worst, text)
    return results


# -- one case ---------------------------------------------------------------------------

def _split(flat, shapes):
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def _zt_backends(device, case, say):
    from zero_triton.native import backends
    names = ("triton", "cuda", "torch") if device.type == "cuda" else ("cpu", "torch", "triton")
    usable = []
    for name in names:
        try:
            reason = backends.why_not(name, device)
        except Exception as exc:  # a half-installed extension is a reason, not a crash
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None and name == "triton" and device.type == "cpu" and case.numel > INTERPRET_MAX_NUMEL:
            reason = (f"TRITON_INTERPRET=1 runs Triton in the interpreter, ~1000x slower than "
                      f"compiled; not timed above {format_size(INTERPRET_MAX_NUMEL)} params")
        if reason is None:
            usable.append(name)
        else:
            say(f"  skipped zt-{name}: {reason}")
    return usable


def _provider_plan(case, device, args, say):
    """Provider ids to build for this case, in table order, with skip reasons said."""
    plan = [f"zt-{b}" for b in _zt_backends(device, case, say)]
    if case.mixed:
        plan.append("torch-composite")
    else:
        plan += ["torch-loop", "torch-foreach", "torch-fused"]
    if device.type == "cpu" and not case.mixed:
        if importlib.util.find_spec("deepspeed") is None:
            say("  skipped ds-cpuadam: deepspeed is not installed (pip install deepspeed)")
        else:
            plan.append("ds-cpuadam")
    elif device.type == "cpu":
        say("  skipped ds-cpuadam: no bf16-params + fp32-master mode wired up here")
    if device.type == "cuda" and not case.mixed:
        if importlib.util.find_spec("apex") is None:
            say("  skipped apex-fused: apex is not installed (github.com/NVIDIA/apex)")
        else:
            plan.append("apex-fused")
    elif device.type == "cuda":
        say("  skipped apex-fused: its master-weights mode is not wired up here")
    else:
        say("  skipped apex-fused: apex FusedAdam steps CUDA tensors only")
    plan.append("limit")
    if device.type == "cuda":
        plan.append("copy")
    if args.providers:
        dropped = [p for p in plan if p not in args.providers and p != case.baseline and p != "limit"]
        for p in dropped:
            say(f"  skipped {p}: not in --providers")
        plan = [p for p in plan if p not in dropped]
    return plan


def _fit_memory(case, plan, device, sets, say):
    """Drop the slow multi-pass providers first when all would not fit in memory."""
    n = case.numel
    lp = 2 if case.mixed else 4
    # Bytes per param each provider holds (grads are shared except zero_triton's flat
    # buffer), with the temporaries torch's multi-pass steps allocate.
    need = {"zt-torch": 20, "torch-loop": 16, "torch-foreach": 20, "torch-fused": 12,
            "torch-composite": 18, "limit": 14, "copy": 0}
    per_set = sum(need.get(p, 16) for p in plan) * n + 2 * lp * n  # + shared p0, g0
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for victim in ("torch-loop", "zt-torch", "torch-foreach"):
        if per_set * sets <= 0.85 * free:
            break
        if victim in plan:
            plan.remove(victim)
            per_set -= need[victim] * n
            say(f"  skipped {victim}: all providers need ~{per_set * sets / 1e9:.0f}+ GB, "
                f"{free / 1e9:.0f} GB free")
    return plan


def run_case(case, device, args, cpu_limit, say):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n = case.numel
    state_bytes = n * (16 if not case.mixed else 14)
    cache = cache_bytes(device)
    sets = 1 if state_bytes >= 2 * cache else min(args.max_sets, math.ceil(2 * cache / state_bytes))
    say(f"\n== {case.name}: {len(case.shapes)} tensor(s), {n:,} params, "
        f"{BYTES_PER_PARAM * n / 1e9:.3f} GB per step at {BYTES_PER_PARAM} B/param"
        + (f", {sets} buffer sets rotated (working set vs {cache >> 20} MiB cache)" if sets > 1 else ""))
    plan = _fit_memory(case, _provider_plan(case, device, args, say), device, sets, say)

    providers = {pid: Provider(pid) for pid in plan}
    errors = {}
    p0s_guard, g0s_guard = _set_up(providers, case, device, sets, cpu_limit, errors)
    live = [pr for pid, pr in providers.items() if pid not in errors]
    guard = {}
    try:
        guard = _guard(case, live, p0s_guard, g0s_guard)
    except Exception as exc:
        for pr in live:
            if pr.states:
                errors[pr.id] = f"guard crashed: {type(exc).__name__}: {exc}"
    for pid, (passed, worst, text) in guard.items():
        if not passed:
            errors[pid] = f"GUARD FAILED ({text}): not timed"
    timed = [pr for pr in live if pr.id not in errors]

    timer = Timer(device)
    calls = _calls_per_sample(timed, timer, args.min_time, errors)
    timed = [pr for pr in timed if pr.id not in errors]
    samples = _samples(timed, timer, calls, args.repeats)

    medians = {pid: statistics.median(v) for pid, v in samples.items() if v}
    run = {"sets": sets, "calls": calls, "guard": guard, "errors": errors, "samples": samples,
           "medians": medians, "base": medians.get(case.baseline), "limit": medians.get("limit"),
           "copy_gbps": None}
    if "copy" in medians:
        run["copy_gbps"] = providers["copy"].bytes_per_call / medians["copy"] / 1e9
    rows = [_row(case, pr, run) for pr in providers.values()]
    del providers, live, timed
    return rows


def _set_up(providers: dict, case, device, sets: int, cpu_limit, errors: dict) -> tuple:
    """Each provider's ``sets`` buffer sets, from the same seeded parameters and
    gradients (a provider that fails is put in ``errors``); returns the slice of tensor
    0's parameters and gradients the reference checks."""
    n = case.numel
    gen = torch.Generator(device=device)
    p0s_guard = g0s_guard = None
    for k in range(sets):
        gen.manual_seed(1234 + k)
        flat_p0 = torch.randn(n, generator=gen, device=device).to(case.dtype)
        flat_g0 = torch.randn(n, generator=gen, device=device).to(case.dtype)
        p0s, g0s = _split(flat_p0, case.shapes), _split(flat_g0, case.shapes)
        if k == 0:  # the reference checks a slice of tensor 0
            p0s_guard = [p0s[0].reshape(-1)[:REF_SLICE].clone()]
            g0s_guard = [g0s[0].reshape(-1)[:REF_SLICE].clone()]
        for pid, pr in providers.items():
            if pid in errors:
                continue
            try:
                step, state = _make(pr, (p0s, g0s), (flat_p0, flat_g0), case, device, cpu_limit)
                pr.fns.append(step)
                if state is not None:
                    pr.states.append(state)
            except Exception as exc:
                errors[pid] = f"setup failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        del flat_p0, flat_g0, p0s, g0s
    return p0s_guard, g0s_guard


def _make(pr, tensors, flats, case, device, cpu_limit):
    """Provider ``pr``'s step over one buffer set (``tensors``: the parameters' and
    gradients' starting values, ``flats``: the same as two flat tensors): (step, the
    state the guard reads, or None)."""
    pid, (p0s, g0s) = pr.id, tensors
    if pid.startswith("zt-"):
        return provide.make_zt(pid[3:], p0s, g0s, case)
    if pid in ("torch-loop", "torch-foreach", "torch-fused"):
        return provide.make_torch(pid, p0s, g0s, case)
    if pid == "torch-composite":
        return provide.make_composite(p0s, g0s, case)
    if pid == "ds-cpuadam":
        return provide.make_deepspeed(p0s, g0s, case)
    if pid == "apex-fused":
        return provide.make_apex(p0s, g0s, case)
    if pid == "limit":
        step, pr.note = provide.make_limit(flats[0], flats[1], case, device, cpu_limit)
        return step, None
    if pid == "copy":
        nbytes = min(BYTES_PER_PARAM // 2 * case.numel, 2 << 30)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        pr.bytes_per_call = 2 * nbytes
        return (lambda d=dst, s=src: d.copy_(s)), None
    raise ValueError(f"unknown provider {pid!r}")


def _calls_per_sample(timed, timer, target: float, errors: dict) -> dict:
    """Warm every buffer set of each provider (torch allocates state on step 1) and
    size a sample to about ``target`` seconds (a whole number of rotations)."""
    calls = {}
    for pr in timed:
        try:
            for fn in pr.fns:
                fn()
            timer.sync()
            t = timer.measure(pr.fns, len(pr.fns))
            calls[pr.id] = max(len(pr.fns), math.ceil(target / max(t, 1e-9) / len(pr.fns)) * len(pr.fns))
        except Exception as exc:
            errors[pr.id] = f"warm-up failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return calls


def _samples(timed, timer, calls: dict, repeats: int) -> dict:
    """``repeats`` rounds, each provider once per round in an order rotated round by
    round, the garbage collector off."""
    samples = {pr.id: [] for pr in timed}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            order = timed[r % len(timed):] + timed[:r % len(timed)] if timed else []
            for pr in order:
                samples[pr.id].append(timer.measure(pr.fns, calls[pr.id], start_index=r))
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _row(case, pr, run: dict) -> dict:
    """Provider ``pr``'s row of the table, from what ``run_case`` measured (``run``: the
    buffer sets, calls per sample, guard results, errors, samples and their medians, and
    the baseline's and the limit's median seconds and the copy's GB/s)."""
    n, pid = case.numel, pr.id
    guard, errors, samples, medians = run["guard"], run["errors"], run["samples"], run["medians"]
    row = {"case": case.name, "provider": pid, "dtype": str(case.dtype).replace("torch.", ""),
           "numel": n, "n_tensors": len(case.shapes), "sets": run["sets"],
           "bytes_per_step": pr.bytes_per_call or BYTES_PER_PARAM * n,
           "median_ms": None, "p20_ms": None, "p80_ms": None, "gbps": None,
           "x_baseline": None, "baseline": case.baseline, "pct_limit": None, "pct_copy": None,
           "guard": None, "guard_max_rel": None, "calls_per_sample": run["calls"].get(pid),
           "status": "ok", "note": pr.note}
    if pid in guard:
        row["guard"] = "pass" if guard[pid][0] else "FAIL"
        row["guard_max_rel"] = guard[pid][1]
    if pid in errors:
        row["status"] = "error"
        row["note"] = errors[pid]
    elif pid in medians:
        med = medians[pid]
        row["median_ms"] = med * 1e3
        row["p20_ms"] = _percentile(samples[pid], 0.2) * 1e3
        row["p80_ms"] = _percentile(samples[pid], 0.8) * 1e3
        row["gbps"] = row["bytes_per_step"] / med / 1e9
        if pid != "copy":
            if run["base"] is not None:
                row["x_baseline"] = run["base"] / med
            if run["limit"] is not None:
                row["pct_limit"] = 100 * run["limit"] / med
            if run["copy_gbps"]:
                row["pct_copy"] = 100 * row["gbps"] / run["copy_gbps"]
    return row
