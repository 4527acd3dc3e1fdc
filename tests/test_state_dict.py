"""FusedAdam's state dict in torch.optim.Adam's format: a round trip with torch's
own optimizer (both ways, through bytes), and an exact resume of fp16/bf16 parameters
with their fp32 master."""
import io

import pytest
import torch
from torch import nn

from zero_triton import FusedAdam

from adam_cases import (assert_bitwise, BACKENDS, compare_to_torch, feed, FP32_ROWS, make_params,
                        require_backend, SHAPES, step_grads, twins)


# -- state dict ------------------------------------------------------------------------------
def _through_bytes(sd):
    """A save/load cycle, so that no tensor is shared between two optimizers."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_state_dict_round_trip_with_torch(backend, amsgrad, dtype, rtol, atol):
    require_backend(backend)
    init = make_params(SHAPES, dtype)
    ours, theirs = twins(init)
    hp = dict(lr=1e-2, weight_decay=0.05, amsgrad=amsgrad)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]  # noqa: E731
    opt = FusedAdam(groups(ours), backend=backend, **hp)
    topt = torch.optim.Adam(groups(theirs), foreach=False, **hp)
    for step in range(1, 5):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()

    # Format: torch.optim.Adam's keys, one step tensor per parameter.
    sd, tsd = opt.state_dict(), topt.state_dict()
    assert set(sd["state"]) == set(tsd["state"]) == set(range(len(SHAPES)))
    for i in sd["state"]:
        assert set(sd["state"][i]) == set(tsd["state"][i]), f"param {i}: state keys"
        st = sd["state"][i]["step"]
        assert isinstance(st, torch.Tensor) and st.dtype == torch.float32 and st.numel() == 1
        assert float(st) == 4
    steps = [sd["state"][i]["step"] for i in sd["state"]]
    assert len({s.data_ptr() for s in steps}) == len(steps), "parameters share one step tensor"
    for g, tg in zip(sd["param_groups"], tsd["param_groups"]):
        assert set(g) == set(tg), f"param group keys {sorted(set(g) ^ set(tg))}"
        assert g["params"] == tg["params"]

    # ours -> torch, and torch -> ours: both continue like the uninterrupted pair.
    b = [nn.Parameter(p.detach().clone()) for p in ours]     # torch, loaded from ours
    c = [nn.Parameter(q.detach().clone()) for q in theirs]   # ours, loaded from torch
    torch_from_ours = torch.optim.Adam(groups(b), foreach=False, **hp)
    torch_from_ours.load_state_dict(_through_bytes(opt.state_dict()))
    ours_from_torch = FusedAdam(groups(c), backend=backend, **hp)
    ours_from_torch.load_state_dict(_through_bytes(topt.state_dict()))
    for step in range(5, 11):
        grads = step_grads(ours, step)
        feed(ours, theirs, grads)
        feed(c, b, grads)
        for o in (opt, topt, torch_from_ours, ours_from_torch):
            o.step()
        compare_to_torch(opt, torch_from_ours, ours, b, rtol, atol, f"ours->torch, step {step}")
        compare_to_torch(ours_from_torch, topt, c, theirs, rtol, atol, f"torch->ours, step {step}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_low_precision_resume_is_exact(backend, dtype):
    # Save after 4 steps, load into a fresh optimizer over fresh parameters, run 4
    # more: bit for bit what the uninterrupted run does (same backend, same inputs).
    require_backend(backend)
    ours = [nn.Parameter(t) for t in make_params(SHAPES, dtype)]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, amsgrad=True, backend=backend)
    for step in range(1, 5):
        for p, g in zip(ours, step_grads(ours, step)):
            with torch.no_grad():
                p.grad = g.to(p.dtype).clone()
        opt.step()
    sd = _through_bytes(opt.state_dict())
    for i, s in sd["state"].items():
        assert s["master_param"].dtype == torch.float32, f"param {i}: master dtype"
        assert set(s) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"}
        # The master is not just the parameter upcast (else it would be pointless).
    assert any(not torch.equal(s["master_param"].to(dtype).float(), s["master_param"])
               for s in sd["state"].values()), "the masters carry no information beyond the params"
    resumed = [nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = FusedAdam(resumed, lr=1e-2, weight_decay=0.1, amsgrad=True, backend=backend)
    opt2.load_state_dict(sd)
    for step in range(5, 9):
        for ps in (ours, resumed):
            for p, g in zip(ps, step_grads(ours, step)):
                with torch.no_grad():
                    p.grad = g.to(p.dtype).clone()
        opt.step()
        opt2.step()
        for i, (p, q) in enumerate(zip(ours, resumed)):
            assert_bitwise(q, p, f"step {step}, param {i}")
            for k in ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert_bitwise(opt2.state[q][k], opt.state[p][k], f"step {step}, param {i}, {k}")
