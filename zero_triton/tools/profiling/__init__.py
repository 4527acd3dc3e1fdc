"""``python -m zero_triton profile``: where the time of a training step goes.

Modules, one job each:

    timeline.py      a Chrome trace -> each iteration cut into forward, backward,
                     reduce-scatter / all-reduce / all-gather (exposed and hidden), Adam
                     step, other; the cut written back into the trace as rows
    harness.py       one rank: the GPT trained with ZeroAdamW and with DDP + AdamW under
                     torch.profiler, memory per phase, the Adam step's bandwidth
    wire.py          bytes on the wire per rank by formula, and each collective timed
    bandwidth.py     the Adam step against a copy of the same bytes
    memory_probe.py  current and peak memory around a phase (CUDA allocator or RSS)
    launch.py        spawned ranks or torchrun's, with timeouts and one-line failures
    report.py        the report as JSON, text tables and a PNG
    cli.py           the options and the run
"""
from zero_triton.tools.profiling.timeline import IterationSplit, mean_split, split_iterations


def main(argv=None) -> int:
    from zero_triton.tools.profiling.cli import main as run
    return run(argv)


__all__ = ["main", "split_iterations", "mean_split", "IterationSplit"]
