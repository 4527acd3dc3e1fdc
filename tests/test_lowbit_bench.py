"""The low-bit benchmarks run and print what they say: bench/lowbit_step.py (the step's
time and state bytes side by side) and bench/lowbit_quality.py (final losses against
torch AdamW's), at tiny sizes."""
import json
import os
from pathlib import Path

from dist_utils import run_python

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_step_bench_prints_every_row_with_its_state_bytes(tmp_path):
    proc = run_python([REPO / "bench" / "lowbit_step.py", "--size", "64Ki", "--repeats", "1",
                       "--no-peers"], env=ENV, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line[:16].strip(): line for line in proc.stdout.splitlines()}
    for name in ("zt fp32", "zt int8", "zt bf16", "zt bf16+master", "zt bf16 sr int8", "zt bf16 rem",
                 "zt bf16 rem int8", "zt bf16 rem8", "zt bf16 r8 int8", "torch fused", "limit 28 B",
                 "limit 20 B", "limit 16 B"):
        assert name in rows, proc.stdout
    state = {name: float(rows[name].split()[-1])
             for name in ("zt fp32", "zt int8", "zt bf16", "zt bf16 sr int8", "zt bf16 rem",
                          "zt bf16 rem int8", "zt bf16 rem8", "zt bf16 r8 int8")}
    assert state["zt fp32"] == 8.0 and state["zt bf16"] == 4.0 and state["zt bf16 rem"] == 10.0
    assert 2.0 < state["zt int8"] < 2.1 and 2.0 < state["zt bf16 sr int8"] < 2.1
    assert 4.0 < state["zt bf16 rem int8"] < 4.1
    assert state["zt bf16 rem8"] == 9.0 and 3.0 < state["zt bf16 r8 int8"] < 3.1


def test_state_bytes_bench_prints_the_report_and_resident_memory_per_row():
    proc = run_python([REPO / "bench" / "state_bytes.py", "--size", "1Mi", "--rows",
                       "remainder8+int8,fp32+fp32"], env=ENV, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert [float(x) for x in rows["remainder8+int8"][:3]] == [7.031, 1.0, 2.031]
    assert float(rows["fp32+fp32"][0]) == 16.0
    assert all(float(x) > 0 for r in rows.values() for x in r[3:] if x != "n/a")


def test_quality_bench_writes_its_table_per_seed_and_the_means(tmp_path):
    proc = run_python([REPO / "bench" / "lowbit_quality.py", "--steps", "12", "--tail", "4",
                       "--warmup", "2", "--val-batches", "2", "--corpus-bytes", "200000",
                       "--rows", "torch_fp32,zt_int8,zt_bf16p_rem8", "--seeds", "0,1",
                       "--out", tmp_path], env=ENV, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for seed in (0, 1):
        data = json.loads((tmp_path / f"seed{seed}" / "quality.json").read_text())
        rows = {r["row"]: r for r in data["results"]}
        assert set(rows) == {"torch_fp32", "zt_int8", "zt_bf16p_rem8"}
        for r in rows.values():
            assert len(r["losses"]) == 12 and r["losses"][-1] < r["losses"][0]  # it trains
        assert rows["zt_int8"]["state_bytes_per_param"] < 2.2
        assert rows["zt_bf16p_rem8"]["state_bytes_per_param"] == 9.0
    means = proc.stdout.split("over seeds [0, 1]")[1].splitlines()
    ref = next(line for line in means if line.startswith("torch fp32"))
    assert ref.split()[2] == "1.0000" and ref.split()[-1] == "2"
    assert any(line.startswith("bf16p rem8") for line in means)


def test_wire_quality_bench_trains_each_row_at_four_ranks_and_counts_its_bytes(tmp_path):
    """bench/wire_quality.py: ZeroAdamW at 4 gloo ranks, exact and int8 rows side by side."""
    proc = run_python([REPO / "bench" / "wire_quality.py", "--steps", "6", "--tail", "3",
                       "--warmup", "2", "--val-batches", "2", "--corpus-bytes", "200000",
                       "--rows", "exact,int8_both,hsdp_int8_both", "--out", tmp_path],
                      env=ENV, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "quality.json").read_text())
    rows = {r["row"]: r for r in data["results"]}
    for r in rows.values():
        assert len(r["losses"]) == 6 and r["losses"][-1] < r["losses"][0]  # it trains
    # int8 blocks both ways: about half of the bf16 bytes the exact row sends
    assert 0.45 < rows["int8_both"]["bytes_per_step"] / rows["exact"]["bytes_per_step"] < 0.55
    assert rows["int8_both"]["error_bytes"] > 0 and rows["exact"]["error_bytes"] == 0
    assert "x exact" in proc.stdout
