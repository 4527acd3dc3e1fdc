"""How state is stored (``zero_triton.state.protocol.MomentStore``): every format in
``zero_triton.state.moments.FORMATS`` implements the protocol signature by signature,
exports torch.optim.Adam's keys, takes back what is written into its export, resets and
carries over; the kernel registry (``zero_triton.native.backends.STEPS``) has a step for
every (backend, format) it lists and refuses one it lacks with the fix. A new format is
held to all of it by being registered."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_signature, protocol_methods
from zero_triton import FusedAdamW
from zero_triton.native import backends
from zero_triton.state import moments
from zero_triton.state.protocol import MomentStore

FORMATS = list(moments.FORMATS.values())
METHODS = protocol_methods(MomentStore)


def test_the_protocol_names_what_the_optimizer_needs():
    assert set(METHODS) == {"ensure_amsgrad", "operands", "reset", "export", "commit", "nbytes",
                            "carry_over"}


@pytest.mark.parametrize("impl", FORMATS, ids=lambda c: c.format)
@pytest.mark.parametrize("method", METHODS)
def test_each_format_has_the_protocols_signature(impl, method):
    assert_signature(impl, MomentStore, method)


@pytest.mark.parametrize("impl", FORMATS, ids=lambda c: c.format)
def test_a_store_exports_resets_and_carries_over(impl):
    store = impl(10, torch.float32, torch.device("cpu"))
    assert isinstance(store, MomentStore) and not store.amsgrad
    assert list(store.export()) == [moments.FIRST, moments.SECOND]
    out = store.export()
    out[moments.FIRST].copy_(torch.arange(10.0))
    out[moments.SECOND].fill_(2.0)
    store.commit(out)
    first, second, vmax = store.operands(2, 5, amsgrad=False)
    assert vmax is None and first.tolist() == [2.0, 3.0, 4.0] and second.tolist() == [2.0] * 3
    assert store.ensure_amsgrad() and not store.ensure_amsgrad()
    assert list(store.export()) == list(moments.KEYS)
    assert store.nbytes() >= 3 * 10  # at least a byte per element per moment
    other = impl(10, torch.float32, torch.device("cpu"))
    other.carry_over(store)
    assert other.amsgrad
    for key, value in store.export().items():
        assert torch.equal(other.export()[key], value), key
    store.reset()
    assert all(not t.any() for t in store.export().values())
    fresh = impl(4, torch.float32, torch.device("cpu"))
    fresh.reset(amsgrad=True)
    assert fresh.amsgrad


def test_an_unknown_format_or_a_missing_kernel_names_the_fix():
    with pytest.raises(ValueError, match="unknown moments format 'int4'; choose one of"):
        moments.make("int4", 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="has no kernel for 'int4' moments; backends that have one"):
        backends.step_function("torch", "int4")
    with pytest.raises(ValueError, match="not a concrete backend"):
        backends.step_function("auto")


def test_every_registered_format_has_a_kernel_on_every_backend():
    names = set(backends.NAMES[1:])
    for fmt in moments.FORMATS:
        assert {b for b, f in backends.STEPS if f == fmt} == names, fmt


def test_the_optimizer_steps_through_the_store():
    """The kernel writes the store's operands: a step moves the exported moments, and
    opt.state views them (world size 1)."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = FusedAdamW([p], lr=0.1, backend="torch")
    p.grad = torch.full((8,), 0.5)
    opt.step()
    store = opt._flats[0][0].state.moments
    exported = store.export()
    assert torch.allclose(exported[moments.FIRST][:8], torch.full((8,), 0.05))  # then padding
    assert opt.state[p][moments.FIRST].data_ptr() == exported[moments.FIRST].data_ptr()
