"""The step benchmark (zero_triton/tools/bench/) and the GPU check script, as smoke runs on
CPU: outputs exist with their columns, and the correctness guard ran and passed (the
benchmark's quick run is the dry run's bench stage)."""
import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zero_triton.tools import bench
from zero_triton.tools.bench import cases, providers

REPO = Path(__file__).resolve().parent.parent


def test_gpt2_small_shapes():
    shapes = cases.gpt2_small_shapes()
    assert len(shapes) == 148
    assert sum(math.prod(s) for s in shapes) == 124_439_808
    quarter = cases.gpt2_small_shapes(0.25)
    assert len(quarter) == 148
    ratio = sum(math.prod(s) for s in quarter) / 124_439_808
    assert 0.24 < ratio < 0.26, ratio


@pytest.mark.parametrize("text, n", [("16Mi", 16 << 20), ("1Gi", 1 << 30), ("64Ki", 65536), ("1000", 1000),
                                     ("16M", 16_000_000), ("1B", 10**9)])
def test_parse_size(text, n):
    assert bench.parse_size(text) == n


def assert_quick_outputs(tmp_path):
    """What ``bench/step.py --quick --device cpu --out tmp_path`` wrote (the dry run of
    gpu_check.sh runs it, below): every case, with the baseline, the limit and a
    zero_triton provider that passed its guard."""
    with open(tmp_path / "step_cpu.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and list(rows[0]) == bench.COLUMNS
    data = json.loads((tmp_path / "step_cpu.json").read_text())
    for key in ("device", "cpu_model", "torch", "triton", "git_commit", "date"):
        assert key in data["meta"], key
    cases = {r["case"] for r in data["rows"]}
    assert len(cases) == 4, cases  # fp32, gpt2, many, bf16+master
    for case in cases:
        by_provider = {r["provider"]: r for r in data["rows"] if r["case"] == case}
        baseline = "torch-composite" if case.startswith("bf16") else "torch-fused"
        assert by_provider["limit"]["median_ms"] > 0, case
        assert by_provider[baseline]["x_baseline"] == pytest.approx(1.0)
        zt = [r for p, r in by_provider.items() if p.startswith("zt-")]
        assert zt, f"{case}: no zero_triton provider ran"
        for r in zt + [by_provider[baseline]]:
            assert r["status"] == "ok" and r["guard"] == "pass", r
            assert r["guard_max_rel"] < bench.GUARD_RTOL, r
            assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"], r


def test_guard_catches_a_wrong_step(tmp_path, monkeypatch):
    """A provider whose step differs from torch's gets an error row, not a time. (Only
    zero_triton's providers, with the baseline and the limit that always run: torch's
    others run in the dry run below. DeepSpeedCPUAdam runs in neither: its first use in
    an environment compiles cpu_adam, about 85 s of a core; ``bench/step.py --device cpu``
    times it.)"""
    real = providers.make_zt

    def off_by_lr(backend, p0s, g0s, case):
        step, state = real(backend, p0s, g0s, case)

        def wrong():
            step()
            for p in state()["p"]:
                p.data.add_(bench.LR)   # one extra lr: what a dropped bias correction costs
        return wrong, state
    monkeypatch.setattr(providers, "make_zt", off_by_lr)
    zt = ",".join(p for p in cases.PROVIDER_IDS if p.startswith("zt-"))
    rc = bench.main(["--quick", "--device", "cpu", "--cases", "fp32", "--providers", zt, "--out", tmp_path])
    assert rc == 1
    rows = json.loads((tmp_path / "step_cpu.json").read_text())["rows"]
    zt = [r for r in rows if r["provider"].startswith("zt-")]
    assert zt and all(r["status"] == "error" and r["guard"] == "FAIL" for r in zt), zt
    assert all(r["median_ms"] is None for r in zt)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="gpu_check.sh needs bash and coreutils timeout")
def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path), "--dry-run"],
                          # The script bounds each stage (690 s in all on a dry run):
                          # a loaded machine reaches a stage's limit, not this one.
                          cwd=REPO, capture_output=True, text=True, timeout=750,
                          env={**__import__("os").environ, "PYTHON": sys.executable})
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for stage in ("info", "build", "test-marked", "test-named", "bench", "capture"):
        assert stage in summary, summary
    assert_quick_outputs(tmp_path)  # the bench stage: the step benchmark's quick run
