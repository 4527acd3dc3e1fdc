"""What the library takes from torch beyond its public API, resolved in one place.

Each name is looked up without failing, so that ``import zero_triton`` works on a torch
that renamed or moved one of them; what then cannot work says so when it is used
(``require``), naming the torch it needs, never at import.
"""
from __future__ import annotations

import re

import torch

# The torch releases the suite passes on (``.ci/torch-matrix``; setup.py's bound says the
# same: tests/test_compat.py holds them together). Outside, nothing is refused: ``info``
# says the torch is untested.
TESTED_TORCH = ((2, 7), (2, 14))


def torch_release(version: str = torch.__version__) -> tuple:
    """(major, minor) of a torch version string ("2.13.0+cpu" -> (2, 13))."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def tested_torch(version: str = torch.__version__) -> bool:
    return TESTED_TORCH[0] <= torch_release(version) <= TESTED_TORCH[1]


def _eager(fn=None, recursive=True):
    """Stands in for ``torch._disable_dynamo`` where a torch lacks it: the function is
    left as it is (under torch.compile it is then traced as any code)."""
    return fn if fn is not None else (lambda f: f)


# torch.optim.Optimizer's step and state-dict methods run eagerly under torch.compile
# (a graph break): ours do too, and so do the hooks that wait on collectives.
disable_dynamo = getattr(torch, "_disable_dynamo", None) or _eager

try:  # the default device's mode, which keeps the bottom of the torch function mode stack
    from torch.utils._device import DeviceContext
except ImportError:
    DeviceContext = None

try:
    from torch.utils._pytree import tree_leaves
except ImportError:
    def tree_leaves(tree) -> list:
        """The leaves of nested lists, tuples and dicts (what a module's forward takes)."""
        if isinstance(tree, (list, tuple)):
            return [leaf for item in tree for leaf in tree_leaves(item)]
        if isinstance(tree, dict):
            return [leaf for item in tree.values() for leaf in tree_leaves(item)]
        return [tree]

# The torch function mode stack, read and rebuilt by ``overlap()``'s read guard.
MODE_STACK = all(hasattr(torch._C, name) for name in (
    "_pop_torch_function_stack", "_len_torch_function_stack", "_push_on_torch_function_stack"))


def require(available: bool, what: str, since: str) -> None:
    """Raise, naming ``what`` and the torch it needs, when ``available`` is False."""
    if not available:
        raise RuntimeError(f"zero_triton: {what} needs torch {since} or newer (a private API "
                           f"of torch it uses is missing from torch {torch.__version__}); "
                           "upgrade torch, or do without it")
