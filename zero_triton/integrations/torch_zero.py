"""torch's ZeroRedundancyOptimizer over FusedAdam with ``parameters_as_bucket_view=True``:
refused when it is built, naming the fix.

ZeroRedundancyOptimizer builds its local optimizer first and then, with bucket views,
points every parameter into buckets of its own (``_build_param_buckets``), which it
broadcasts after each step. FusedAdam keeps its parameters in flat buffers of its own:
its next step moved them back, so each rank's updates never reached the buckets, and no
rank saw another's (0.05 off torch's AdamW after 5 steps, silently). Without bucket
views it trains as with torch's AdamW.

``install`` (whenever a FusedAdam is built, so always before ZeroRedundancyOptimizer
builds its buckets over one) wraps ``_build_param_buckets`` once, if torch's module is
loaded; any other local optimizer is untouched.
"""
from __future__ import annotations

import functools
import sys

from zero_triton.integrations import patching
from zero_triton.optim.fused import FusedAdam

_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def install() -> None:
    module = sys.modules.get(_MODULE)
    cls = getattr(module, "ZeroRedundancyOptimizer", None)
    build = getattr(cls, "_build_param_buckets", None)
    if build is None or getattr(build, "_zero_triton", False):
        return

    @functools.wraps(build)
    def _build_param_buckets(self):
        if (getattr(self, "parameters_as_bucket_view", False)
                and not getattr(self, "_overlap_with_ddp", False)
                and isinstance(getattr(self, "optim", None), FusedAdam)):
            raise ValueError(
                f"ZeroRedundancyOptimizer(optimizer_class={type(self.optim).__name__}, "
                "parameters_as_bucket_view=True): it points the parameters into buckets of its "
                f"own, and {type(self.optim).__name__} keeps them in flat buffers of its own, so "
                "the updates would never reach the buckets it broadcasts. Pass "
                "parameters_as_bucket_view=False (it trains as with torch's AdamW), or use "
                "zero_triton.ZeroAdamW in its place (ZeRO sharding of its own)")
        return build(self)

    _build_param_buckets._zero_triton = True
    patching.set_attr("torch_zero", cls, "_build_param_buckets", _build_param_buckets)
