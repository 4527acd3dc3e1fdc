"""Step benchmark: one optimizer step of zero_triton against torch and a memory limit.

``python -m zero_triton bench ...`` and ``python bench/step.py ...`` both call
``main(argv)``; ``--help`` lists the options.

What is timed, per case, side by side in one process:

* every zero_triton backend usable on the device (``FusedAdam(..., backend=b).step()``);
* ``torch.optim.Adam`` with ``foreach=False``, ``foreach=True`` and ``fused=True``;
* for bf16 parameters, the torch composite a careful user writes: bf16 grads cast into
  a preallocated fp32 buffer, torch's fused Adam on the fp32 master, master copied
  back into the bf16 parameters;
* DeepSpeedCPUAdam / apex FusedAdam when importable;
* the limit: a plain memory kernel with the step's exact access pattern (read p, g,
  m, v; write p, m, v -- for bf16 + master: read g2, master4, m4, v4; write master4,
  m4, v4, p2), and on CUDA a device-to-device copy as well.

Providers run interleaved: every round times each provider once, in an order rotated
round by round, so that drifting memory bandwidth hits all of them alike; we report
the median and p20/p80 over rounds. Bytes are counted at 28 B/param for every case
(an fp32 step reads p, g, m, v and writes p, m, v), so GB/s compare across providers
even when a provider moves more bytes (the composite moves 40 B/param).

Before timing, a correctness guard steps each provider twice from identical data and
compares parameters (or fp32 master) and both moments with torch ``fused=True`` (the
composite for bf16) and with ``zero_triton.reference`` on a slice: a provider that
disagrees gets an error row instead of a time.
"""
from zero_triton.tools.bench.cases import BYTES_PER_PARAM, GUARD_RTOL, LR, parse_size
from zero_triton.tools.bench.report import COLUMNS, main, parse_args

__all__ = ["main", "parse_args", "parse_size", "BYTES_PER_PARAM", "GUARD_RTOL", "LR", "COLUMNS"]
