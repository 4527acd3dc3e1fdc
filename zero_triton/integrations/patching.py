"""How a patch of another library is made: recorded, so that it can be undone, and not
made at all while the patches are off for the process.

Every change ``zero_triton.integrations`` makes to torch or accelerate goes through
``set_attr``, ``set_cell`` or ``add_finder``, each recording how to put back what was
there. ``ZERO_TRITON_PATCHES=0`` in the environment, or ``zero_triton.integrations.
disable()``, turns them off for the process; ``undo`` restores every recorded change, the
last first, so that torch and accelerate are exactly as without zero_triton. ``skipped``
says once, as a warning, what a patch could not route because its target is not of the
shape it was written for, and what to call instead.
"""
from __future__ import annotations

import os
import sys
import warnings

_OFF = ("0", "off", "false", "no")
_state = {"off": os.environ.get("ZERO_TRITON_PATCHES", "1").strip().lower() in _OFF}
_undo: list = []    # (patch name, restore), in the order made
_said: set = set()  # the patches whose skip was said


def enabled() -> bool:
    return not _state["off"]


def turn_off() -> None:
    _state["off"] = True


def set_attr(patch: str, obj, name: str, value) -> None:
    """``setattr(obj, name, value)``, recorded: undone, ``obj``'s own attribute comes back
    (or goes, if ``obj`` had none of its own and inherited it)."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    _undo.append((patch, (lambda: setattr(obj, name, old)) if had else (lambda: delattr(obj, name))))


def set_cell(patch: str, cell, value) -> None:
    """A closure cell pointed at ``value``, recorded."""
    old = cell.cell_contents
    cell.cell_contents = value

    def restore():
        cell.cell_contents = old
    _undo.append((patch, restore))


def add_finder(patch: str, finder) -> None:
    """``finder`` first on ``sys.meta_path``, recorded (it may take itself off earlier)."""
    sys.meta_path.insert(0, finder)

    def restore():
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    _undo.append((patch, restore))


def applied() -> list:
    """The patches that changed something, in the order applied (each once)."""
    return list(dict.fromkeys(patch for patch, _ in _undo))


def undo() -> None:
    while _undo:
        _, restore = _undo.pop()
        restore()


def skipped(patch: str, what: str, instead: str) -> None:
    """Say once that ``patch`` leaves ``what`` as it is, and what to use instead."""
    if patch not in _said:
        _said.add(patch)
        warnings.warn(f"zero_triton: {what} is not of the shape this version knows, so it is "
                      f"left as it is: {instead}", RuntimeWarning, stacklevel=3)
