"""Which ZeroAdam owns a parameter, and what runs when one is built.

A weak map (parameter -> weak reference to its ZeroAdam): nothing is stored on the
parameters (they must stay picklable), and neither side is kept alive by it. Code above
the optimizer (``zero_triton.integrations``) reads it through ``owner(p)`` and adds
what must happen once a ZeroAdam exists with ``when_built(install)`` (once any FusedAdam
does: ``when_any_built``): the optimizer never imports the layers above it.
"""
from __future__ import annotations

import weakref

from torch.utils.weak import WeakIdKeyDictionary

_OWNER = WeakIdKeyDictionary()  # parameter -> weakref.ref(ZeroAdam)
_WHEN_BUILT: list = []
_WHEN_ANY_BUILT: list = []


def when_built(install) -> None:
    """``install()`` runs each time a ZeroAdam registers parameters (it must be idempotent)."""
    if install not in _WHEN_BUILT:
        _WHEN_BUILT.append(install)


def when_any_built(install) -> None:
    """``install()`` runs each time any FusedAdam (ZeroAdam included) is built (it must be
    idempotent and cheap)."""
    if install not in _WHEN_ANY_BUILT:
        _WHEN_ANY_BUILT.append(install)


def built() -> None:
    """A FusedAdam was built."""
    for install in _WHEN_ANY_BUILT:
        install()


def register(optimizer, params, *, routes_clipping: bool) -> None:
    """``params`` (its trainable parameters) belong to ``optimizer`` from now on; with
    ``routes_clipping``, torch's ``clip_grad_norm_`` on them is the optimizer's to do (its
    local gradients are not the averaged ones)."""
    if not routes_clipping:  # one rank of ZeRO-1: nothing of torch needs routing
        return
    for install in _WHEN_BUILT:
        install()
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNER[p] = ref


def owner(p):
    """The live ZeroAdam that clips ``p``'s gradients, or None."""
    ref = _OWNER.get(p)
    return ref() if ref is not None else None


def live() -> list:
    """Every live ZeroAdam that clips its parameters' gradients, once each."""
    found = {}
    for ref in list(_OWNER.values()):
        opt = ref()
        if opt is not None:
            found[id(opt)] = opt
    return list(found.values())
