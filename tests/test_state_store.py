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
                            "storage", "carry_over"}


@pytest.mark.parametrize("impl", FORMATS, ids=lambda c: c.format)
@pytest.mark.parametrize("method", METHODS)
def test_each_format_has_the_protocols_signature(impl, method):
    assert_signature(impl, MomentStore, method)


@pytest.mark.parametrize("impl", FORMATS, ids=lambda c: c.format)
def test_a_store_exports_resets_and_carries_over(impl):
    """What every format does, with values every format holds exactly (powers of two
    within 2^-2 of their block's largest: int4's range)."""
    store = impl(10, torch.float32, torch.device("cpu"))
    assert isinstance(store, MomentStore) and not store.amsgrad
    assert store.align % 16 == 0 and isinstance(store.live, bool)
    assert list(store.export()) == [moments.FIRST, moments.SECOND]
    first = torch.tensor([2.0 ** -(k % 3) for k in range(10)]) * torch.tensor([1, -1] * 5)
    out = store.export()
    out[moments.FIRST].copy_(first)
    out[moments.SECOND].fill_(2.0)
    store.commit(out)
    got = store.export()
    assert torch.equal(got[moments.FIRST], first) and torch.equal(got[moments.SECOND], torch.full((10,), 2.0))
    if store.live:  # the export is the storage: opt.state views it
        assert got[moments.FIRST].data_ptr() == store.storage()[0].data_ptr()
    assert store.operands(0, 5, amsgrad=False)[0].numel() in (5, 3)  # a code a byte, or two
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.storage())
    assert store.nbytes() >= 10  # at least half a byte per element per moment
    try:
        new = store.ensure_amsgrad()
    except ValueError as exc:  # a format without the running maximum says so, with the fix
        assert "amsgrad" in str(exc) and "moments='fp32'" in str(exc)
    else:
        assert new and not store.ensure_amsgrad()
        assert list(store.export()) == list(moments.KEYS)
    other = impl(10, torch.float32, torch.device("cpu"))
    other.carry_over(store)
    assert other.amsgrad == store.amsgrad
    for key, value in store.export().items():
        assert torch.equal(other.export()[key], value), key
    store.reset()
    assert all(not t.any() for t in store.export().values())


def test_fp32_operands_are_slices_of_the_moments_and_amsgrad_is_stored_on_demand():
    store = moments.Fp32Moments(10, torch.float32, torch.device("cpu"))
    out = store.export()
    out[moments.FIRST].copy_(torch.arange(10.0))
    out[moments.SECOND].fill_(2.0)
    store.commit(out)
    first, second, vmax = store.operands(2, 5, amsgrad=False)
    assert vmax is None and first.tolist() == [2.0, 3.0, 4.0] and second.tolist() == [2.0] * 3
    fresh = moments.Fp32Moments(4, torch.float32, torch.device("cpu"))
    fresh.reset(amsgrad=True)
    assert fresh.amsgrad


def test_an_unknown_format_or_a_missing_kernel_names_the_fix():
    with pytest.raises(ValueError, match="unknown moments format 'int2'; choose one of"):
        moments.make("int2", 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="has no kernel for 'int2' moments; backends that have one"):
        backends.step_function("torch", "int2")
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
    store = opt._shards.groups[0][0].state.moments
    exported = store.export()
    assert torch.allclose(exported[moments.FIRST][:8], torch.full((8,), 0.05))  # then padding
    assert opt.state[p][moments.FIRST].data_ptr() == exported[moments.FIRST].data_ptr()
