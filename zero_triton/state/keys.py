"""torch.optim.Adam's names of the moments, in the kernels' argument order (every store
exports them under these keys; ``zero_triton.state.moments`` re-exports them); the keys by
which a param group names its own state formats (``zero_triton.optim.spec.Spec.for_group``)."""
FIRST, SECOND, MAXIMUM = "exp_avg", "exp_avg_sq", "max_exp_avg_sq"
KEYS = (FIRST, SECOND, MAXIMUM)
# A param group's own state formats, over the optimizer's: {"params": ..., "moments": "fp32"}.
GROUP_FORMATS = ("moments", "master_weights")


def formats_of(group: dict) -> dict:
    """The state formats a param group names, {key: value} (none: the optimizer's)."""
    return {k: group[k] for k in GROUP_FORMATS if k in group}
