"""Triton kernels of zero_triton, installed as ``zero_triton.kernels``.

Import this package only after deciding on ``TRITON_INTERPRET``: Triton reads it when a
kernel is decorated, so a process that wants kernels to run on CPU tensors sets
``TRITON_INTERPRET=1`` before the first import of ``zero_triton.kernels.adam``.
"""
