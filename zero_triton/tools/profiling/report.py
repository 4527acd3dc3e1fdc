"""The profile's report: every rank's measurements in one JSON-ready dict, its text
tables, and the PNG (one stacked bar per configuration)."""
from __future__ import annotations

import textwrap

from zero_triton.tools import outputs
from zero_triton.tools.profiling.timeline import KINDS, LABELS, ROWS

SHORT = {"zero": "ZeroAdamW", "ddp": "DDP + AdamW"}
MB = 1e6


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def build(ranks: list, meta: dict) -> dict:
    """One report from the per-rank results of ``harness.profile_rank`` (rank order)."""
    report = {"meta": meta, "configs": {}}
    for name in ranks[0]["configs"]:
        per_rank = [r["configs"][name] for r in ranks]
        means = [c["mean"] for c in per_rank]
        report["configs"][name] = {
            "label": per_rank[0]["label"],
            "mean": {"iteration_ms": _mean(m["iteration_ms"] for m in means),
                     "wall_ms": _mean(m["wall_ms"] for m in means),
                     "rows": {r: _mean(m["rows"][r] for m in means) for r in ROWS},
                     "hidden": {k: _mean(m["hidden"][k] for m in means) for k in KINDS},
                     "in_flight": {k: _mean(m["in_flight"][k] for m in means) for k in KINDS}},
            "ranks": per_rank,
        }
    zero = [r["configs"]["zero"] for r in ranks if "zero" in r["configs"]]
    if zero:
        report["wire"] = _wire_over_ranks([c.pop("wire") for c in zero])
    return report


def _wire_over_ranks(tables: list) -> dict:
    """Rank 0's table with each collective's time averaged over the ranks."""
    out = tables[0]
    for name, row in out["measured"].items():
        row["ms"] = _mean(t["measured"][name]["ms"] for t in tables)
        wire = out["collectives"][name]
        row["bus_gbps"] = wire / (row["ms"] / 1e3) / 1e9 if row["ms"] else None
    for key, scheme in out["schemes"].items():
        scheme["ms"] = _mean(t["schemes"][key]["ms"] for t in tables)
    return out


# -- text ----------------------------------------------------------------------------------

def _f(x, spec, empty="-"):
    return empty if x is None else format(x, spec)


def phase_table(title: str, configs: dict, pick) -> str:
    """Rows x configurations: ms, % of the iteration and hidden ms of each phase.
    ``pick(config)`` -> {"rows", "hidden", "iteration_ms", "wall_ms"}."""
    names = list(configs)
    head = f"{title:<22}" + "".join(f"{SHORT.get(n, n):>28}" for n in names)
    sub = f"{'phase':<22}" + "".join(f"{'ms':>10}{'%':>8}{'hidden ms':>10}" for _ in names)
    lines = [head, sub, "-" * len(sub)]
    data = [pick(configs[n]) for n in names]
    for row in ROWS:
        if row == "other_collective" and not any(d["rows"][row] or d["hidden"][row] for d in data):
            continue
        cells = ""
        for d in data:
            ms, total = d["rows"][row], d["iteration_ms"]
            hidden = d["hidden"].get(row)
            cells += (f"{ms:>10.2f}{100 * ms / total:>7.1f}%"
                      f"{_f(hidden, '.2f') if row in KINDS else '':>10}")
        lines.append(f"{LABELS[row]:<22}{cells}")
    lines.append("-" * len(sub))
    lines.append(f"{'iteration (sum)':<22}" + "".join(
        f"{sum(d['rows'].values()):>10.2f}{'100.0%':>8}{sum(d['hidden'].values()):>10.2f}" for d in data))
    lines.append(f"{'iteration (wall clock)':<22}" + "".join(
        f"{d['wall_ms']:>10.2f}{'':>18}" for d in data))
    return "\n".join(line.rstrip() for line in lines)


def format_text(report: dict) -> str:
    meta, configs = report["meta"], report["configs"]
    m = meta["model"]
    out = [f"zero_triton profile: GPT {m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, "
           f"vocab {m['vocab_size']} ({m['params'] / 1e6:.2f}M params, {meta['dtype']}), batch "
           f"{meta['batch']} x {meta['seq']} tokens per rank, {meta['world_size']} {meta['dist_backend']} "
           f"rank(s) on {meta['device']}; mean of {meta['steps']} profiled iterations after "
           f"{meta['warmup']} warm-up"]
    for name, c in configs.items():
        out.append(f"  {SHORT.get(name, name)}: {c['label']}; traces "
                   + ", ".join(r["trace"] for r in c["ranks"]))
    out.append("")
    n = meta["world_size"]
    for rank in range(n):
        out.append(phase_table(f"rank {rank}", configs, lambda c, r=rank: c["ranks"][r]["mean"]))
        out.append("")
    if n > 1:
        out.append(phase_table(f"mean of {n} ranks", configs, lambda c: c["mean"]))
        out.append("")
    out.append(_wrap("exposed: the training thread waits for the collective (its row); hidden: "
                     "the collective was in flight while the thread computed, time already "
                     "inside forward/backward. The rows sum to the iteration."))
    out.append("")
    if "wire" in report:
        out.append(wire_text(report["wire"]))
        out.append("")
    if "zero" in configs and configs["zero"]["ranks"][0]["memory"].get("sent") is not None:
        out.append(sent_text(configs["zero"]))
        out.append("")
    if "zero" in configs:
        out.append(adam_text(configs["zero"]))
        out.append("")
    out.append(memory_text(configs))
    return "\n".join(out)


def wire_text(w: dict) -> str:
    n = w["world_size"]
    b = w["buffers"]
    elems = sum(x["numel"] for x in b)
    dtypes = "/".join(sorted({x["grad_dtype"] for x in b}))
    measured = w.get("measured", {})
    gloo = w.get("note") is not None
    lines = [_wrap(f"bytes on the wire per rank, N = {n}: gradient buffer B = {w['grad_buffer_bytes']:,} "
                   f"bytes ({elems:,} {dtypes} elements in {len(b)} flat buffer(s), padded to a "
                   f"multiple of {n} x 16), parameter buffer {w['param_buffer_bytes']:,} bytes"),
             f"{'scheme':<27}{'collective':<22}{'ring formula':>14}"
             + (f"{'gloo moves':>13}" if gloo else "") + f"{'ms':>9}{'bus GB/s':>10}"]
    lines.append("-" * len(lines[-1]))

    def row(scheme, coll, formula, backend, name):
        t = measured.get(name, {})
        return (f"{scheme:<27}{coll:<22}{formula:>14,}" + (f"{backend:>13,}" if gloo else "")
                + f"{_f(t.get('ms'), '9.3f'):>9}{_f(t.get('bus_gbps'), '10.3f'):>10}")
    c, s = w["collectives"], w["schemes"]
    rs_backend = s["zero1"]["backend_bytes_per_rank"] - c["all_gather"]
    lines.append(row("DDP: naive all-reduce", "all_reduce(grads)", c["all_reduce"], c["all_reduce"],
                     "all_reduce"))
    lines.append(row("ZeRO-1/2 (ZeroAdam)", "reduce_scatter(grads)", c["reduce_scatter"], rs_backend,
                     "reduce_scatter"))
    lines.append(row("", "all_gather(params)", c["all_gather"], c["all_gather"], "all_gather"))
    lines.append(f"{'':<27}{'together':<22}{s['zero1']['bytes_per_rank']:>14,}"
                 + (f"{s['zero1']['backend_bytes_per_rank']:>13,}" if gloo else "")
                 + f"{_f(s['zero1'].get('ms'), '9.3f'):>9}")
    lines.append(_wrap("ring formulas: all-reduce 2(N-1)/N*B, reduce-scatter and all-gather "
                       "(N-1)/N*B each: ZeRO-1 and ZeRO-2 move exactly what DDP moves. "
                       "ZeroAdam's reduce-scatter is an all-to-all and a sum in rank order, "
                       "which moves (N-1)/N*B. bus GB/s = formula bytes / time."))
    if gloo:
        lines.append(_wrap("note: " + w["note"]))
    return "\n".join(lines)


def sent_text(zero: dict) -> str:
    """The bytes each rank sent over one iteration, per collective, as ZeroAdamW's
    communicator counted them ("replicas.": between a 2-D mesh's replicas, across nodes)."""
    sent = [r["memory"]["sent"] for r in zero["ranks"]]
    names = sorted({k for s in sent for k in s})
    lines = [_wrap("bytes each rank sent over one iteration, counted per collective by "
                   "ZeroAdamW's communicator (replicas.: between the replicas of a 2-D mesh)"),
             f"{'rank':<6}" + "".join(f"{n:>26}" for n in names) + f"{'total':>14}"]
    for r, s in enumerate(sent):
        lines.append(f"{r:<6}" + "".join(f"{s.get(n, 0):>26,}" for n in names)
                     + f"{sum(s.values()):>14,}")
    return "\n".join(lines)


def adam_text(zero: dict) -> str:
    ranks = [r["adam"] for r in zero["ranks"]]
    a = ranks[0]
    lines = [f"Adam step kernel (zero_triton.adam_step, backend {a['backend']}): "
             f"{a['bytes_per_param']} B/param over this rank's shard",
             f"{'rank':<6}{'shard params':>14}{'MB/step':>10}{'step ms':>10}{'GB/s':>9}"
             f"{'copy ms':>10}{'copy GB/s':>11}{'% of copy':>11}"]
    lines.append("-" * len(lines[-1]))
    for i, r in enumerate(ranks):
        lines.append(f"{i:<6}{r['shard_elements']:>14,}{r['bytes_per_step'] / MB:>10.2f}"
                     f"{r['step_ms']:>10.3f}{_f(r['gbps'], '9.1f'):>9}{r['copy_ms']:>10.3f}"
                     f"{_f(r['copy_gbps'], '11.1f'):>11}{_f(r['pct_of_copy'], '10.0f'):>10}%")
    lines.append(_wrap(f"time: {a['source']} (median of the profiled iterations); limit: {a['copy']}"))
    for k in a.get("kernels") or []:
        lines.append(f"  kernel {k['name'][:60]}: {k['calls_per_step']:.0f} per step, "
                     f"median {k['median_us']:.1f} us")
    return "\n".join(lines)


def memory_text(configs: dict) -> str:
    first = next(iter(configs.values()))["ranks"][0]["memory"]
    phases = list(first["phases"])
    lines = [_wrap(f"memory per phase, MB current / peak within the phase ({first['how']})"),
             f"{'config':<14}{'rank':<6}" + "".join(f"{p:>20}" for p in phases)]
    lines.append("-" * len(lines[-1]))
    for name, c in configs.items():
        for i, r in enumerate(c["ranks"]):
            cells = ""
            for p in phases:
                v = r["memory"]["phases"].get(p, {})
                cells += f"{_f(_div(v.get('current')), '.1f') + ' / ' + _f(_div(v.get('peak')), '.1f'):>20}"
            lines.append(f"{SHORT.get(name, name):<14}{i:<6}{cells}")
    lines.append("")
    lines.append("model states per rank, MB: predicted by zero_triton.memory.model | held on rank 0")
    keys = ("params", "grads", "optimizer_state", "total")
    lines.append(f"{'config':<14}{'stage':<7}" + "".join(f"{k.replace('_', ' '):>22}" for k in keys))
    lines.append("-" * len(lines[-1]))
    for name, c in configs.items():
        ms = c["ranks"][0]["model_states"]
        cells = "".join(f"{_f(_div(ms['predicted'][k]), '.2f') + ' | ' + _f(_div(ms['measured'][k]), '.2f'):>22}"
                        for k in keys)
        lines.append(f"{SHORT.get(name, name):<14}{ms['stage']:<7}{cells}")
    pad = configs.get("zero", {}).get("ranks", [{}])[0].get("model_states", {}).get("measured", {}).get("padding")
    if pad is not None:
        lines.append(_wrap(f"(measured params and grads include {pad:,} bytes of ZeroAdam's alignment "
                           "padding; the memory model leaves out activations and DDP's gradient "
                           "buckets)"))
    return "\n".join(lines)


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100, subsequent_indent="  ")


def _div(x):
    return None if x is None else x / MB


# -- PNG -------------------------------------------------------------------------------------

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "reduce_scatter": "#C44E52",
          "all_reduce": "#DD8452", "adam_step": "#8172B3", "all_gather": "#DA8BC3",
          "other_collective": "#937860", "other": "#BBBBBB"}


def write_png(report: dict, path) -> str | None:
    """One horizontal stacked bar per configuration (mean over ranks), the rows of the
    table in order, with a thin dark bar beneath for its hidden communication (time
    already inside forward/backward). Returns None, or why it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    configs, meta = report["configs"], report["meta"]
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 0.8 * len(configs)))
    seen = set()

    def bar(y, width, left, height, color, label):
        ax.barh(y, width, left=left, height=height, color=color, edgecolor="white", linewidth=0.5,
                label=None if label in seen else label)
        seen.add(label)
    ticks = []
    for i, c in enumerate(configs.values()):
        y = -i
        ticks.append((y, c["label"]))
        left = 0.0
        for row in ROWS:
            ms = c["mean"]["rows"][row]
            if ms > 0:
                bar(y, ms, left, 0.5, COLORS[row], LABELS[row] + (" (exposed)" if row in KINDS else ""))
                left += ms
        ax.text(left, y, f" {left:.1f} ms", va="center", fontsize=7)
        hidden = sum(c["mean"]["hidden"].values())
        if hidden > 0:
            bar(y - 0.33, hidden, 0.0, 0.12, "#333333", "comm hidden under compute")
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.set_xlabel("ms per iteration (mean over ranks)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.08)
    m = meta["model"]
    ax.set_title(f"one training step: GPT {m['params'] / 1e6:.2f}M params {meta['dtype']}, batch "
                 f"{meta['batch']}x{meta['seq']}, {meta['world_size']} {meta['dist_backend']} "
                 f"rank(s) on {meta['device']}", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    with outputs.replacing(path, "wb") as fh:
        fig.savefig(fh, dpi=100, bbox_inches="tight", format="png")
    plt.close(fig)
    return None
