"""Scripts that use ZeroAdam end with their own status, never an abort (docs/reliability.md,
Reliability): torchrun scripts ending with or without ``destroy_process_group()``, with
all-gathers in flight under ``overlap()``, or with an exception; and ranks started as
plain processes (no launcher to kill the rest) whose peers end every way (later, a save as rank
0's last line, SIGKILL, ``sys.exit(3)``, an exception, a rank failing mid-training, one
under ``torch.multiprocessing.spawn``). One run of four of them here (~30 s): the eight
left to the script repeat a mechanism these run (``LEFT_TO_THE_SCRIPT``). ``python
bench/exit_soak.py --runs 200`` is the long measurement of all twelve, with the time a
rank that is done stays after its peers end.
"""
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "bench" / "exit_soak.py"
VARIANTS = ("destroy", "no-destroy", "overlap+destroy", "overlap", "raise", "lone-end",
            "lone-save-last", "lone-peer-killed", "lone-peer-exit", "lone-peer-raises",
            "lone-raise-mid-training", "lone-spawn-raise")  # bench/exit_soak.py's twelve
# Left to the script (``python bench/exit_soak.py --runs 1`` runs all twelve in ~1.5
# minutes), each repeating a mechanism one run here runs: ``destroy`` (the ending of
# every torchrun script the suite runs besides: the demo, the profiler, the README's
# example), ``overlap`` without destroy
# (``overlap+destroy``, ``no-destroy``); a peer ending with an error status after its
# rank is done (``lone-peer-raises``, ``lone-peer-exit``: ``lone-peer-killed`` ends it
# harder); a rank or every rank failing (``raise``, ``lone-raise-mid-training``,
# ``lone-spawn-raise``: a script's exception ends it as ``destroy``'s last line does,
# and a dead peer is ``lone-peer-killed``); ``lone-end``, the baseline of the script's
# teardown figure, which ends as ``destroy`` does.
LEFT_TO_THE_SCRIPT = ("destroy", "overlap", "lone-peer-raises", "lone-peer-exit", "lone-raise-mid-training",
                      "lone-end", "raise", "lone-spawn-raise")


def test_every_ending_exits_with_its_own_status():
    proc = subprocess.run([sys.executable, str(SOAK), "--runs", "1", "--timeout", "240",
                           "--variants", ",".join(v for v in VARIANTS if v not in LEFT_TO_THE_SCRIPT)],
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "EXIT_SOAK_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("1/1 exited") == len(VARIANTS) - len(LEFT_TO_THE_SCRIPT), proc.stdout
