"""zero_grad and .grad as views of the flat gradient buffer: torch's semantics
(None after zero_grad, in place with set_to_none=False), a module's zero_grad then
backward, a gradient replaced among the views."""
import copy

import pytest
import torch
from torch import nn

from zero_triton import FusedAdam
from zero_triton.native import ext as _ext
from zero_triton.native import backends

from adam_cases import (assert_close, compare_to_torch, FP32_ROWS, inside, require_backend)


# -- zero_grad and views ------------------------------------------------------------------
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_zero_grad_sets_none_and_backward_lands_in_the_flat_buffer(backend, dtype, rtol, atol):
    # torch's .grad: None after zero_grad(); backward's gradient moves into the flat
    # buffer and .grad is its view from then on, so micro-batches accumulate in place.
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.ReLU(), nn.Linear(11, 1))
    opt = FusedAdam(model.parameters(), backend=backend)
    flat = opt._shards.groups[0][0]
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), "zero_grad() must set .grad to None"
    model(x).sum().backward()
    once = [p.grad.clone() for p in model.parameters()]
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    for i, p in enumerate(model.parameters()):
        assert inside(p.grad, flat.flat_grad), f"param {i}: .grad is not its flat-buffer view"
    model(x).sum().backward()
    for i, (p, g, ptr) in enumerate(zip(model.parameters(), once, ptrs)):
        assert p.grad.data_ptr() == ptr, f"param {i}: autograd replaced the .grad view"
        assert_close(p.grad, 2 * g, rtol, atol, f"param {i}: accumulated gradient")
    assert_close(flat.flat_grad[flat.layout.offsets[0]:][:once[0].numel()], 2 * once[0].reshape(-1),
                 rtol, atol, "the flat buffer does not hold the accumulated gradient")
    opt.zero_grad(set_to_none=False)
    for i, (p, ptr) in enumerate(zip(model.parameters(), ptrs)):
        assert p.grad is not None and p.grad.data_ptr() == ptr and not p.grad.any(), \
            f"param {i}: zero_grad(set_to_none=False) must keep a zeroed .grad"


def _choose_grad_check(opt, check):
    """'native': the C loop of zero_triton._C finds replaced grads; 'python': the loop."""
    for flats in opt._shards.groups:
        for flat in flats:
            if check == "python":
                flat.grad_buffer.check_flat = None
            elif flat.grad_buffer.check_flat is None:
                pytest.skip("the native extension is not loaded here: "
                            f"{_ext.unavailable_reason() or 'only the cpu backend loads it'}")


@pytest.mark.parametrize("check", ["native", "python"])
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_module_zero_grad_set_to_none_then_backward(backend, dtype, rtol, atol, check):
    # model.zero_grad() sets .grad to None; autograd then allocates fresh tensors. The
    # step must pick them up and point .grad back at the flat buffer.
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 2))
    tmodel = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, backend=backend)
    _choose_grad_check(opt, check)
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2, foreach=False)
    flat = opt._shards.groups[0][0]
    gen = torch.Generator().manual_seed(11)
    for step in range(1, 7):
        x = torch.randn(5, 6, generator=gen)
        model.zero_grad()  # set_to_none=True
        assert all(p.grad is None for p in model.parameters())
        if step == 3:
            # Parameters with no gradient at all this step (a detached branch): neither
            # optimizer touches them (torch.optim.Adam's rule), steps included.
            loss = model[2](torch.tanh(model[0](x)).detach()).sum()
        else:
            loss = model(x).sum()
        loss.backward()
        tmodel.zero_grad()
        for p, q in zip(model.parameters(), tmodel.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        topt.step()
        for i, (p, q) in enumerate(zip(model.parameters(), tmodel.parameters())):
            assert (p.grad is None) == (q.grad is None), f"step {step}: param {i} .grad None-ness"
            assert p.grad is None or inside(p.grad, flat.flat_grad), \
                f"step {step}: param {i} .grad not moved into the flat buffer"
        compare_to_torch(opt, topt, list(model.parameters()), list(tmodel.parameters()),
                         rtol, atol, f"{backend} step {step}")


@pytest.mark.parametrize("check", ["native", "python"])
def test_one_replaced_grad_among_views_is_copied_in(check):
    # Only the third parameter's .grad is replaced (and the fourth set to None): the
    # check must find it past a run of intact views, copy it in, and zero the missing one.
    params = [nn.Parameter(torch.randn(5)) for _ in range(5)]
    for p in params:
        p.grad = torch.full((5,), 1.0)
    opt = FusedAdam(params, backend="cpu" if backends.why_not("cpu", torch.device("cpu")) is None
                    else "torch")
    _choose_grad_check(opt, check)
    flat = opt._shards.groups[0][0]
    params[2].grad = torch.full((5,), 7.0)
    params[3].grad = None
    flat.sync_grads()
    assert flat.stepped == [True, True, True, False, True]
    for i, p in enumerate(params):
        if i == 3:
            assert p.grad is None, "a parameter without a gradient got one"
            assert not flat.grad_buffer.views[3].any(), "its view was not zeroed"
            continue
        assert inside(p.grad, flat.flat_grad), f"param {i}: .grad is not the flat view"
        want = {2: 7.0}.get(i, 1.0)
        assert torch.equal(p.grad, torch.full((5,), want)), f"param {i}: {p.grad} != {want}"
