"""The compact state dict (zero_triton.optim.compact): low-bit moments as their store keeps
them, a quarter (int8) or half (bf16) of torch's format, loading back bit for bit into
any optimizer of the package at any world size; its expansion is torch's format; a
malformed one is refused before anything changes."""
import io
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.optim import compact

from dist_utils import run_ranks
from lowbit_cases import mean_grads


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 6 * 6, 300), torch.nn.Linear(300, 5)).to(dtype)
    return m.to(memory_format=torch.channels_last)  # strided parameters: blocks in memory order


def _train(m, opt, steps, first=0):
    for t in range(first, first + steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(4, 3, 8, 8, generator=g).to(next(m.parameters()).dtype)
        m(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("moments,master_weights,dtype,ratio", [
    ("int8", None, torch.float32, 0.27),
    ("bf16", None, torch.float32, 0.51),
    ("int8", "remainder", torch.bfloat16, 0.52),   # master_param stays float32
    ("fp32", None, torch.float32, 1.0),
])
def test_saved_compact_and_loaded_back_bit_for_bit(moments, master_weights, dtype, ratio):
    m = _model(dtype)
    opt = zt.FusedAdamW(m.parameters(), lr=1e-2, moments=moments, master_weights=master_weights)
    _train(m, opt, 3)
    full, small = opt.state_dict(), _round_trip(opt.state_dict(compact=True))
    assert small["compact"] == {"moments": moments, "version": compact.VERSION}
    assert compact.size_bytes(small) <= ratio * compact.size_bytes(full)
    # Its expansion is torch's format, element for element.
    expanded = compact.expand(small)
    for k, entry in full["state"].items():
        for n, v in entry.items():
            assert torch.equal(expanded["state"][k][n], v), (k, n)
    # A fresh optimizer takes it and continues as the first one does.
    m2 = _model(dtype)
    m2.load_state_dict(m.state_dict())
    opt2 = zt.FusedAdamW(m2.parameters(), lr=1e-2, moments=moments, master_weights=master_weights)
    opt2.load_state_dict(small)
    stores = [f.state.moments.storage() for _, f in opt._shards.listed(opt.param_groups)]
    stores2 = [f.state.moments.storage() for _, f in opt2._shards.listed(opt2.param_groups)]
    assert all(torch.equal(a, b) for s, s2 in zip(stores, stores2) for a, b in zip(s, s2))
    _train(m, opt, 2, first=3)
    _train(m2, opt2, 2, first=3)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_codes_and_scales_are_the_documented_ones():
    """exp_avg element j of block b decodes from its code and moment_scales[b]."""
    from zero_triton.kernels import quant
    m = _model()
    opt = zt.FusedAdamW(m.parameters(), lr=1e-2, moments="int8")
    _train(m, opt, 2)
    full, small = opt.state_dict(), opt.state_dict(compact=True)
    weight = 2  # the (300, 288) Linear
    codes, scales = small["state"][weight]["exp_avg_codes"], small["state"][weight]["moment_scales"]
    assert codes.dtype == torch.int8 and codes.shape == (300, 288)
    assert scales.shape == (quant.blocks(300 * 288), 2)
    j = 1000
    assert quant.decode(codes.reshape(-1)[j:j + 1], scales[j // quant.BLOCK:j // quant.BLOCK + 1, 0],
                        quant.FIRST) == full["state"][weight]["exp_avg"].reshape(-1)[j]


def test_formats_switch_both_ways_and_torch_adamw_takes_the_expansion():
    m = _model()
    opt = zt.FusedAdamW(m.parameters(), lr=1e-2, moments="int8")
    _train(m, opt, 3)
    small = opt.state_dict(compact=True)
    for moments in ("fp32", "bf16"):
        other = zt.FusedAdamW(_model().parameters(), lr=1e-2, moments=moments)
        other.load_state_dict(small)
        got = other.state_dict()
        for k, entry in opt.state_dict()["state"].items():
            assert torch.allclose(got["state"][k]["exp_avg"], entry["exp_avg"], rtol=2 ** -7, atol=0)
    fp32 = zt.FusedAdamW(_model().parameters(), lr=1e-2)
    fp32.load_state_dict(small)
    back = zt.FusedAdamW(_model().parameters(), lr=1e-2, moments="int8")
    back.load_state_dict(fp32.state_dict(compact=True))  # fp32's compact is torch's format
    assert all(torch.equal(a, b) for a, b in zip(opt._shards.groups[0][0].state.moments.storage(),
                                                 back._shards.groups[0][0].state.moments.storage()))
    ref = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    ref.load_state_dict(compact.expand(small))
    assert torch.equal(ref.state_dict()["state"][2]["exp_avg"], opt.state_dict()["state"][2]["exp_avg"])


def test_a_malformed_compact_state_dict_is_refused_before_anything_changes():
    m = _model()
    opt = zt.FusedAdamW(m.parameters(), lr=1e-2, moments="int8")
    _train(m, opt, 2)
    small = opt.state_dict(compact=True)
    before = [t.clone() for t in opt._shards.groups[0][0].state.moments.storage()]
    bad_scales = {**small, "state": {**small["state"], 2: {**small["state"][2],
                                                           "moment_scales": torch.zeros(3, 2)}}}
    bad_codes = {**small, "state": {**small["state"], 2: {
        **small["state"][2], "exp_avg_codes": small["state"][2]["exp_avg_codes"].float()}}}
    for bad, match in ((bad_scales, "moment_scales"), (bad_codes, "exp_avg_codes"),
                       ({**small, "compact": {"moments": "int2", "version": 1}}, "version 1"),
                       ({**small, "compact": {"moments": "int8", "version": 2}}, "version 1")):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert all(torch.equal(a, b) for a, b in zip(before, opt._shards.groups[0][0].state.moments.storage()))
    with pytest.raises(TypeError, match="compact must be True or False"):
        opt.state_dict(compact="yes")


SHAPES = [(37, 19), (300,), (5,), (64, 33)]


def _job(rank, world_size, bucket_cap_mb, steps, save_to, load_from, consolidated):
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = zt.ZeroAdamW(params, lr=1e-2, moments="int8", bucket_cap_mb=bucket_cap_mb)
    first = 0
    if load_from:
        saved = torch.load(load_from)
        with torch.no_grad():
            for p, q in zip(params, saved["params"]):
                p.copy_(q)
        opt.load_state_dict(saved["opt"])
        first = 3
    for t in range(first, first + steps):
        for p, g in zip(params, mean_grads(rank, world_size, t, SHAPES)):
            p.grad = g
        opt.step()
        opt.zero_grad()
    if save_to:
        if consolidated:
            sd = opt.consolidated_state_dict(to_rank=0, compact=True)
        else:
            sd = opt.state_dict(compact=True) if rank == 0 else None  # rank 0 alone
        if rank == 0:
            torch.save({"opt": sd, "params": [p.detach() for p in params]}, save_to)
        torch.distributed.barrier()
    return [p.detach().numpy().copy() for p in params]


@pytest.mark.parametrize("consolidated", [False, True])
def test_zero_saves_compact_at_two_ranks_and_resumes_at_one_and_four_bitwise(tmp_path, consolidated):
    straight = run_ranks(_job, 1, None, 5, None, None, False)[0]
    path = os.fspath(tmp_path / "opt.pt")
    run_ranks(_job, 2, 0.002, 3, path, None, consolidated)
    assert "compact" in torch.load(path)["opt"]
    for world_size in (1, 4):
        resumed = run_ranks(_job, world_size, 0.001 if world_size > 1 else None, 2, None, path,
                            False)[0]
        for a, b in zip(resumed, straight):
            assert (a == b).all(), world_size
