"""Bad input to FusedAdam: a clear error that names the fix, raised before anything
changes (hyperparameters, backends, parameter groups, devices, dtypes)."""

import pytest
import torch
from torch import nn

from zero_triton import FusedAdam
from zero_triton.native import backends

from adam_cases import (assert_bitwise, LAUNCH_KW, launcher_args, make_params, SHAPES, spelled)


# -- bad input: a clear error, nothing changed ----------------------------------------------------
def _state_fingerprint(opt, params):
    return ([p.detach().clone() for p in params], len(opt.param_groups),
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})


def _assert_unchanged(opt, params, fingerprint):
    values, ngroups, state = fingerprint
    for i, (p, v) in enumerate(zip(params, values)):
        assert_bitwise(p.detach(), v, f"param {i} changed by a failed call")
    assert len(opt.param_groups) == ngroups, "a failed call changed param_groups"
    assert set(state) == {id(p) for p in opt.state}, "a failed call changed the state keys"
    for p, s in opt.state.items():
        for k, v in s.items():
            assert_bitwise(v, state[id(p)][k], f"state {k} changed by a failed call")


BAD_HYPERPARAMETERS = [
    (dict(lr=-1e-3), "Invalid learning rate.*>= 0"),
    (dict(eps=-1e-8), "Invalid epsilon.*>= 0"),
    (dict(betas=(1.0, 0.999)), r"Invalid beta parameter at index 0.*\[0, 1\)"),
    (dict(betas=(0.9, -0.1)), r"Invalid beta parameter at index 1.*\[0, 1\)"),
    (dict(weight_decay=-0.1), "Invalid weight_decay.*>= 0"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
]


@pytest.mark.parametrize("kwargs, match", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters(kwargs, match):
    ps = [nn.Parameter(t) for t in make_params(SHAPES[:2])]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match=match):
        FusedAdam(ps, backend="torch", **kwargs)
    # A bad second group, after the first one was built: the first one's parameter
    # keeps its gradient (here a plain tensor), not a view of a dead buffer.
    g0 = torch.ones_like(ps[0])
    ps[0].grad = g0
    with pytest.raises(ValueError, match=match):
        FusedAdam([{"params": ps[:1]}, {"params": ps[1:], **kwargs}], backend="torch")
    assert ps[0].grad is g0 and ps[1].grad is None, "a failed constructor changed .grad"
    ps[0].grad = None
    # Through add_param_group on a live optimizer: nothing changes either.
    opt = FusedAdam(ps[:1], backend="torch")
    fp = _state_fingerprint(opt, ps)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": ps[1:], **kwargs})
    _assert_unchanged(opt, ps, fp)
    for p, b in zip(ps, before):
        assert_bitwise(p.detach(), b, "a rejected constructor changed a parameter")


def test_unknown_backend():
    ps = [nn.Parameter(torch.randn(4))]
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; choose one of .*'triton'"):
        FusedAdam(ps, backend="tpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backends.resolve("tpu", torch.device("cpu"))
    assert_bitwise(ps[0].detach(), before, "param changed")
    assert ps[0].grad is None, "a rejected optimizer attached a .grad view"


def test_triton_without_gpu_or_interpreter(monkeypatch):
    # CPU tensors with the interpreter off: Triton cannot step them, GPU or not.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='cpu' or 'torch'"):
        backends.resolve("triton", torch.device("cpu"))
    ps = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        FusedAdam(ps, backend="triton")
    for p, b in zip(ps, before):
        assert_bitwise(p.detach(), b, "param changed")
        assert p.grad is None, "a rejected optimizer attached a .grad view"
    # Through add_param_group (the first group holds only a frozen parameter, so it
    # needs no backend): the new group is not registered and nothing moves.
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    opt = FusedAdam([frozen], backend="triton")
    fp = _state_fingerprint(opt, ps)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        opt.add_param_group({"params": ps})
    _assert_unchanged(opt, ps, fp)
    assert len(opt._shards.groups) == 1 and all(p.grad is None for p in ps)


def test_launcher_refuses_cpu_tensors_without_interpreter(monkeypatch):
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "INTERPRET", False)
    args = launcher_args(8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='cpu' or 'torch'"):
        spelled(kadam.adam_step)(*args, **LAUNCH_KW)


def test_parameter_in_two_groups():
    a, b = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))
    match = "more than one parameter group.*already in another param group; give each parameter"
    with pytest.raises(ValueError, match=match):
        FusedAdam([{"params": [a]}, {"params": [b, a]}], backend="torch")
    # The first group was built before the second was rejected: its .grad is put back.
    assert a.grad is None and b.grad is None, "a failed constructor left .grad views behind"
    opt = FusedAdam([a], backend="torch")
    a.grad = torch.ones_like(a)
    opt.step()
    fp = _state_fingerprint(opt, [a, b])
    with pytest.raises(ValueError, match="already in another param group"):
        opt.add_param_group({"params": [b, a]})
    _assert_unchanged(opt, [a, b], fp)
    assert b.grad is None, "the rejected group's parameter got a .grad view"
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt.add_param_group({"params": [b, b]})  # torch.optim.Adam warns too
    assert opt.param_groups[-1]["params"] == [b], "the duplicate was not dropped"


def test_mixed_devices_in_one_group():
    second = "cuda" if torch.cuda.is_available() else "meta"
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(torch.empty(3, device=second))
    before = a.detach().clone()
    with pytest.raises(ValueError, match="several devices.*one param group per device"):
        FusedAdam([a, b], backend="torch")
    assert_bitwise(a.detach(), before, "param changed")
    assert a.grad is None, "a rejected optimizer attached a .grad view"


def test_sparse_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse gradient; use torch.optim.SparseAdam"):
        FusedAdam(emb.parameters(), backend="torch")
    assert_bitwise(emb.weight.detach(), before, "param changed")

    # A sparse gradient arriving after construction (autograd stores its own sparse
    # tensor): refused at step, as torch.optim.Adam refuses it.
    emb.weight.grad = None
    opt = FusedAdam(emb.parameters(), backend="torch")
    emb(torch.tensor([3])).sum().backward()
    assert emb.weight.grad.is_sparse
    fp = _state_fingerprint(opt, [emb.weight])
    with pytest.raises(RuntimeError, match="sparse gradient.*SparseAdam"):
        opt.step()
    _assert_unchanged(opt, [emb.weight], fp)


def test_unsupported_parameter_dtype():
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex32))
    with pytest.raises(ValueError, match=r"complex32; FusedAdam handles float32, float16, bfloat16, "
                                         r"float64, complex64 and complex128"):
        FusedAdam([p], backend="torch")
    assert p.grad is None


def test_master_weights_false_with_bf16():
    p = nn.Parameter(torch.randn(5).bfloat16())
    before, where = p.detach().clone(), p.data_ptr()
    with pytest.raises(ValueError, match="master_weights=False.*keep master_weights=None"):
        FusedAdam([p], backend="torch", master_weights=False)
    assert_bitwise(p.detach(), before, "param changed")
    assert p.data_ptr() == where, "the parameter was moved into a flat buffer before the error"
