#!/usr/bin/env python
"""What keeping each released gradient's norm costs FusedAdamW(grad_release=True): the
backward (which steps every parameter) with ``ReleasedNorms.note`` as built against it
made a no-op, in blocks of 8 iterations alternated, the median block of each.

    python bench/release_norms.py

16 Linear(1024, 1024) layers (16.8M parameters), a batch of 8, fp32 and bf16 with
``master_weights="remainder8", moments="int8"``; two threads.
"""
import statistics
import time

import torch

from zero_triton import FusedAdamW
from zero_triton.optim import release

torch.set_num_threads(2)
real = release.ReleasedNorms.note
for fmt in ({}, {"master_weights": "remainder8", "moments": "int8"}):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    dt_ = torch.float32
    if fmt:
        m = m.bfloat16(); dt_ = torch.bfloat16
    opt = FusedAdamW(m.parameters(), lr=1e-4, grad_release=True, **fmt)
    x = torch.randn(8, 1024, dtype=dt_)
    blocks = {"kept": [], "off": []}
    for b in range(8):
        for mode in (("kept", "off") if b % 2 else ("off", "kept")):
            release.ReleasedNorms.note = real if mode == "kept" else (lambda self, g: None)
            ts = []
            for it in range(8):
                t0 = time.perf_counter()
                m(x).float().square().mean().backward()
                ts.append(time.perf_counter() - t0)
                opt.step(); opt.zero_grad()
            if b: blocks[mode].append(statistics.median(ts))
    release.ReleasedNorms.note = real
    k, o = statistics.median(blocks["kept"]), statistics.median(blocks["off"])
    print(fmt or "fp32", f"{o*1e3:.1f} ms without, {k*1e3:.1f} ms with: {k/o:.3f}x  (blocks: off {[round(v*1e3,1) for v in blocks['off']]}, kept {[round(v*1e3,1) for v in blocks['kept']]})")
