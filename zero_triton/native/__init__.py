"""The native layer: the step's kernels behind one call (``backends``: triton, cuda, cpu,
torch), the C++/CUDA extension's build and cache (``ext``) and the ``torch.ops`` operator
(``ops``). It imports nothing of the package above it; ``zero_triton.kernels`` holds the
Triton kernels it launches."""
