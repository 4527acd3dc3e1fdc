"""accelerate's ``Accelerator.clip_grad_norm_`` on a ZeroAdam's parameters clips by the
global norm, as torch's function does under ZeroAdam (``clip_grad``).

accelerate up to 1.15 clipped through ``torch.nn.utils.clip_grad_norm_``, which
``clip_grad`` routes to the optimizer. From 1.16 it takes the norm itself
(``torch.nn.utils.get_total_norm`` over each ``.grad``, then ``clip_grads_with_norm_``):
under ZeroAdam without DDP that is each rank's local gradients at stage 1, so each rank
clipped by its own norm, and nothing at stage 2 (no ``.grad``), so nothing was clipped;
silently. The method is wrapped: a call whose parameters a ZeroAdam owns unscales (as
accelerate does) and goes to torch's routed function, which clips by the norm of the
averaged gradients and returns it; every other call is accelerate's, unchanged.

``install`` runs when the first ZeroAdam is built: it wraps the method if accelerate is
imported, and otherwise wraps it when ``accelerate.accelerator`` is first imported (HF
Trainer imports it when a Trainer is made, often after the optimizer).
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

import torch

from zero_triton.integrations import patching
from zero_triton.integrations.clip_grad import any_owned, as_list

_MODULE = "accelerate.accelerator"


def install() -> None:
    module = sys.modules.get(_MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        patching.add_finder("accelerate_clip", _WhenImported())


def _wrap(module) -> None:
    cls = getattr(module, "Accelerator", None)
    original = getattr(cls, "clip_grad_norm_", None)
    if original is not None and getattr(original, "_zero_triton_routes", False):
        return
    if original is None:
        patching.skipped("accelerate_clip", "accelerate's Accelerator.clip_grad_norm_",
                         "under ZeroAdam clip with max_grad_norm= or "
                         "torch.nn.utils.clip_grad_norm_(model.parameters(), ...)")
        return

    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = as_list(parameters)
        if not any_owned(params):
            return original(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    clip_grad_norm_._zero_triton_routes = True
    patching.set_attr("accelerate_clip", cls, "clip_grad_norm_", clip_grad_norm_)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``accelerate.accelerator`` is imported, the spec the
    other finders give it runs the module, then ``_wrap``. Leaves ``sys.meta_path`` then."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            _wrap(module)
        # this module's own loader instance
        patching.set_attr("accelerate_clip", loader, "exec_module", exec_module)
        return spec
