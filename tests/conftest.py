"""Shared test setup.

Triton kernels run on CPU tensors only under the interpreter, which Triton reads when
a kernel is decorated: set it before anything imports zero_triton.kernels. A GPU run
that wants compiled kernels sets TRITON_INTERPRET=0 explicitly (bench/gpu_check.sh).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The commands' CPU ranks (demo, profile, bench/e2e.py, memory --measure) fork from a
# server that imported torch once instead of importing it each (~4 s of a core a rank):
# the tests check what the commands print and write, not resident sets against a fresh
# process. test_memory's measurement spawns them as the command does by default.
os.environ.setdefault("ZERO_TRITON_RANK_START", "forkserver")

import pytest  # noqa: E402
import torch  # noqa: E402


def cuda_present() -> bool:
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")


def devices():
    """cpu always, cuda when there."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def protocol_methods(protocol) -> list:
    """The public methods a typing Protocol declares."""
    import inspect
    return [name for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")]


def assert_signature(impl, protocol, method: str) -> None:
    """``impl.method`` takes exactly the parameters (names, kinds, defaults) that
    ``protocol.method`` declares."""
    import inspect
    want = inspect.signature(getattr(protocol, method))
    got = inspect.signature(getattr(impl, method))
    strip = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
    assert strip(got) == strip(want), \
        f"{impl.__name__}.{method}{got} is not {protocol.__name__}.{method}{want}"
