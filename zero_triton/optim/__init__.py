"""The optimizer layer: one Adam over a communicator of any size. ``fused``: FusedAdam
(one rank) and everything the step shares; ``zero``: ZeroAdam (a process group);
``state_dict``: the torch.optim.Adam-format state dicts; ``differentiable``: the
single-tensor step for ``differentiable=True``."""
