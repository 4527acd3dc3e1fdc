"""The command line's answers to bad input and to a reader that goes away: one clear line
(argparse's usage and error, or ``error: ...``), never a traceback."""
import json
import os
import subprocess
import sys

import pytest
import torch
from dist_utils import run_python

from zero_triton import FusedAdam, checkpoint
from zero_triton.tools import bench
from zero_triton.tools import cli
from zero_triton.tools.units import format_count, parse_count

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CMD = [sys.executable, "-m", "zero_triton"]


def _run(args, timeout=120, cwd=None):
    """The command in a process of its own (forked with torch imported: what it prints and
    its exit status are the interpreter's; a closed pipe, below, takes a real one)."""
    return run_python(CMD[1:] + list(args), env=ENV, timeout=timeout, cwd=cwd)


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr and "Error:" not in proc.stderr, proc.stderr


# -- counts: one parser for bench --sizes and memory --params -----------------------------
@pytest.mark.parametrize("text, n", [
    ("7B", 7 * 10**9), ("7.5e9", 7_500_000_000), ("7.5b", 7_500_000_000), ("7G", 7 * 10**9),
    ("2T", 2 * 10**12), ("1.5K", 1500), ("175_000_000_000", 175 * 10**9),
    ("1152921504606846977", 2**60 + 1), ("64M", 64 * 10**6),
    ("64Mi", 64 << 20), ("1Gi", 1 << 30), ("1gi", 1 << 30), ("1Ti", 1 << 40), ("1.5Ki", 1536),
    ("1000", 1000),
])
def test_parse_count_one_convention_for_every_command(text, n):
    # K/M/G(B)/T powers of ten, Ki/Mi/Gi/Ti powers of two, for bench, profile and memory alike.
    assert parse_count(text) == n
    assert parse_count(format_count(n)) == n


@pytest.mark.parametrize("args, message", [
    (["bench", "--sizes", "0"], "argument --sizes: '0' is not positive; pass a count > 0"),
    (["bench", "--sizes=-4K"], "argument --sizes: '-4K' is not positive"),
    (["bench", "--sizes", "64M,lots"], "'lots' is not a number"),
    (["bench", "--sizes", "1.5"], "'1.5' is not a whole number"),
    (["bench", "--sizes", "1e30"], "out of range"),
    (["bench", "--many", "8x0"], "argument --many: '0' is not positive"),
    (["bench", "--many", "12"], "is not COUNTxSIZE"),
    (["bench", "--scale", "-1"], "argument --scale: '-1' is not a positive number"),
    (["memory", "--params", "0", "--world-size", "8"], "'0' is not positive; pass a count > 0"),
    (["memory", "--params=-7B", "--world-size", "8"], "'-7B' is not positive"),
    (["memory", "--params", "7Q", "--world-size", "8"], "'7Q' is not a number; pass a positive "
                                                         "count such as 7.5e9 or 7.5B"),
])
def test_bad_counts_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and message in err, err


def test_bench_sizes_take_suffixes():
    args = bench.parse_args(["--sizes", "64Mi,1Gi,3k", "--many", "4x1Ki"])
    assert args.sizes == args.bf16_sizes == [64 << 20, 1 << 30, 3000]
    assert args.many == (4, 1024)
    assert bench.parse_args([]).many == (8192, 4096)


@pytest.mark.parametrize("params, n", [("7B", 7 * 10**9), ("7.5e9", 7_500_000_000),
                                       ("1.5T", 1_500_000_000_000)])
def test_memory_params_take_suffixes(params, n, capsys):
    assert cli.main(["memory", "--params", params, "--world-size", "8", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["params"] == n
    assert table["stages"][0]["bytes_per_rank"] == 16 * n


def test_bench_zero_size_exits_2_without_a_traceback():
    proc = _run(["bench", "--sizes", "0"])
    assert proc.returncode == 2, proc.stderr
    _no_traceback(proc)
    assert "'0' is not positive" in proc.stderr


# -- checkpoint consolidate / inspect ---------------------------------------------------------
def test_checkpoint_cli_creates_directories_and_reports_errors_in_one_line(tmp_path):
    model = torch.nn.Linear(3, 4)
    checkpoint.save(tmp_path / "ck", FusedAdam(model.parameters(), backend="torch"), model)
    proc = _run(["checkpoint", "consolidate", "ck", "missing_dir/a.pt"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "missing_dir" / "a.pt").exists()
    assert (tmp_path / "missing_dir" / "a.model.pt").exists()
    for args in (["consolidate", "nowhere", "out/a.pt"], ["inspect", "nowhere"],
                 ["consolidate", "ck", "missing_dir"]):
        proc = _run(["checkpoint", *args], cwd=tmp_path)
        assert proc.returncode == 1, (args, proc.stderr)
        _no_traceback(proc)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


# -- a reader that goes away ---------------------------------------------------------------
def _into_closed_pipe(args, **kw):
    """Run with stdout a pipe whose reader is already gone: every write fails (EPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(CMD + [str(a) for a in args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=ENV, timeout=120, **kw)
    finally:
        os.close(write)


@pytest.mark.parametrize("args, code", [
    (["memory", "--params", "7B", "--world-size", "64"], 141),  # 128 + SIGPIPE, as `yes | head`
    (["info"], 141),
    (["--help"], 141),
    (["bench", "--quick", "--cases", "fp32"], 141),
    (["checkpoint", "inspect", "ck"], 141),
    (["memory", "--help"], 0),  # argparse's help ignores a failed write itself
])
def test_broken_pipe_ends_quietly(args, code, tmp_path):
    model = torch.nn.Linear(3, 4)
    checkpoint.save(tmp_path / "ck", FusedAdam(model.parameters(), backend="torch"), model)
    proc = _into_closed_pipe(args, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (code, "")


def test_demo_reader_leaving_stops_the_output_not_the_training():
    proc = subprocess.Popen(CMD + ["demo", "--world-size", "2", "--steps", "3", "--backend",
                                   "torch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        first = proc.stdout.readline()  # the parent's line; the ranks print after it
        proc.stdout.close()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first.startswith("zero_triton demo: spawning 2 ranks"), first
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("argv", [
    ["-m", "zero_triton", "demo"],
    ["-m", "zero_triton", "profile"],
    ["-m", "zero_triton", "memory", "--params", "1e6", "--world-size", "2", "--measure"],
    [os.path.join(os.path.dirname(__file__), "..", "bench", "e2e.py"), "--ranks", "2"],
], ids=["demo", "profile", "memory --measure", "bench/e2e.py"])
def test_a_bad_rank_start_method_is_one_argparse_error_before_any_rank(argv, tmp_path):
    proc = run_python(argv + ["--out", tmp_path] * ("e2e" in argv[0] or "profile" in argv),
                      env={**ENV, "ZERO_TRITON_RANK_START": "fork"}, timeout=120)
    _no_traceback(proc)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert "ZERO_TRITON_RANK_START='fork'" in lines[-1] and "spawn or forkserver" in lines[-1], lines
    assert not list(tmp_path.iterdir()), "a refused run wrote files"
