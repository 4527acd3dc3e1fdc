"""torch.optim.Adam's names of the moments, in the kernels' argument order (every store
exports them under these keys; ``zero_triton.state.moments`` re-exports them)."""
FIRST, SECOND, MAXIMUM = "exp_avg", "exp_avg_sq", "max_exp_avg_sq"
KEYS = (FIRST, SECOND, MAXIMUM)
