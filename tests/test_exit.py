"""Scripts that use ZeroAdam end with their own status, never an abort (docs/reliability.md,
Reliability): torchrun scripts ending with or without ``destroy_process_group()``, with
all-gathers in flight under ``overlap()``, or with an exception; and ranks started as
plain processes (no launcher to kill the rest) whose peers end every way (later, a save as rank
0's last line, SIGKILL, ``sys.exit(3)``, an exception, a rank failing mid-training, one
under ``torch.multiprocessing.spawn``). One run of each here (twelve launches, ~1.5
minutes); ``python bench/exit_soak.py --runs 200`` is the long measurement, with the
time a rank that is done stays after its peers end.
"""
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "bench" / "exit_soak.py"


def test_every_ending_exits_with_its_own_status():
    proc = subprocess.run([sys.executable, str(SOAK), "--runs", "1", "--timeout", "240"],
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "EXIT_SOAK_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("1/1 exited") == 12, proc.stdout
