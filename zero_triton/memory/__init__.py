"""Memory per rank: the model (``model``: bytes of DDP and ZeRO-1/2/3 for mixed-precision
Adam) and the probe that measures a process (``probe``)."""
