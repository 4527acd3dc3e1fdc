"""How one shard's Adam moments are stored: the declared part (a Protocol) that every
format implements, so that a new format (bf16, 8-bit block-quantized) is a file in
``zero_triton.state`` and a kernel in the registry (``zero_triton.native.backends``),
not a branch through the optimizer.

A store holds the moments of one rank's shard of one flat buffer, in state order (the
shard's segments one after another, ``FlatLayout.shard_segments``). The optimizer and the
checkpoint layer reach the moments only through it:

- ``operands(a, b, amsgrad)``: what one kernel launch over state elements [a, b) reads
  and writes, in the kernel's argument order;
- ``reset(amsgrad)``: every moment zero (a cleared ``opt.state``, a load that brings none);
- ``export()``: the moments in torch.optim.Adam's format (float32 or float64, keyed by
  torch's names), over the whole shard in state order; ``commit(exported)`` takes back
  what was written into them (a format whose export is a copy re-encodes it; one whose
  export is the storage itself has nothing to do);
- ``nbytes()``, ``storage()`` (the tensors it holds) and ``carry_over(old)`` (a re-home
  to another device or dtype);
- ``align``: the flat layout's alignment the format needs (every parameter, bucket and
  shard starts on a multiple of it: a block-quantized format's blocks are then the
  layout's, never a shard's); ``live``: whether ``export()`` is the storage itself
  (``opt.state`` then holds views of it, as torch.optim.Adam's state); ``block``: how
  many consecutive state elements share a scale (1: none do); ``keyed``: whether
  its kernels round by a generator keyed by element, and so take ``seed`` (the flat
  buffer's number) and ``index`` (the canonical index of the run's first element).

This module imports nothing of the package (``tests/test_layers.py`` holds it to that).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class MomentStore(Protocol):
    format: str         # the name the optimizers' ``moments=`` argument takes
    dtype: torch.dtype  # what the kernels compute the moments in
    numel: int          # state elements of the shard
    align: int          # the flat layout's alignment (elements) the format needs
    block: int          # elements stored together (one scale): 1 where each is by itself
    live: bool          # export() returns the storage itself, not a copy
    keyed: bool         # the step takes ``seed`` and ``index`` (its rounding is keyed by element)

    @property
    def amsgrad(self) -> bool:
        """Whether the running maximum of the second moment is stored."""

    def ensure_amsgrad(self) -> bool:
        """Store the running maximum from now on (zeros); True if it is new."""

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        """The kernel's moment operands over state elements [a, b): (first moment,
        second moment, running maximum or None)."""

    def reset(self, amsgrad: bool | None = None) -> None:
        """Every moment zero; ``amsgrad`` True stores the running maximum too (zeros),
        None keeps it as it is."""

    def export(self) -> dict:
        """The moments in torch.optim.Adam's format over the shard: {torch's key:
        tensor}, the running maximum only when stored."""

    def commit(self, exported: dict) -> None:
        """Take back what was written into ``export()``'s tensors."""

    def nbytes(self) -> int:
        """Bytes the moments take on the device."""

    def storage(self) -> list:
        """The tensors the store holds."""

    def carry_over(self, old: "MomentStore") -> None:
        """Take ``old``'s moments (the same shard, another device or dtype)."""
