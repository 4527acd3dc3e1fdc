"""ZeroAdam's state through torch.distributed.checkpoint, sharded (gloo ranks).

``get_optimizer_state_dict(model, opt)`` hands DCP each rank's shard: ShardedTensors of the
parameters' shapes whose local shards are views of the rank's state
(``zero_triton.optim.sharded_state``). ``dcp.load`` + ``set_optimizer_state_dict`` restore
it exactly at the same and at other world sizes and bucket sizes; the checkpoint converts
to a file that torch.optim.AdamW loads.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402

dcp = pytest.importorskip("torch.distributed.checkpoint")
pytest.importorskip("torch.distributed.checkpoint.state_dict")


def _model(seed=0):
    """fp32 and bf16 layers (an fp32 master for the bf16 ones), a 0-dim parameter, and a
    3-D one whose shards cut rows across two dimensions."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
    model[2].to(torch.bfloat16)
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.5)))
    model.register_parameter("cube", torch.nn.Parameter(torch.randn(3, 5, 7)))
    return model


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        h = model[1](model[0](x)) * model.scale
        loss = model[2](h.bfloat16()).float().square().mean() + model.cube.sin().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _lists(state_dict):
    return {k: {n: t.tolist() for n, t in e.items()} for k, e in state_dict["state"].items()}


def _save(rank, world_size, path):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import zero_triton
    from zero_triton.optim.interface import internals
    model = _model()
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.0008)
    _train(model, opt, 3, seed=rank)
    saved = get_optimizer_state_dict(model, opt)
    # What each rank hands DCP: its shard, as views of its own state (no copy).
    ours = {t.untyped_storage().data_ptr() for _, flat in internals(opt).shards()
            for t in flat.state.buffers().values()}
    handed, views, kinds = 0, True, set()
    for entry in saved["state"].values():
        for name, value in entry.items():
            kinds.add((name, type(value).__name__))
            if type(value).__name__ == "ShardedTensor":
                for shard in value.local_shards():
                    handed += shard.tensor.numel()
                    views &= shard.tensor.numel() == 0 or \
                        shard.tensor.untyped_storage().data_ptr() in ours
    total = sum(p.numel() for p in model.parameters() if p.dim()) * 2 + \
        sum(p.numel() for p in model.parameters() if p.dim() and p.dtype == torch.bfloat16)
    dcp.save({"optim": saved}, checkpoint_id=path)
    whole = opt.state_dict()
    # full_state_dict=True asks for the whole state: state_dict()'s, by FQN
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in model.named_parameters()]
    full_ok = all(torch.equal(full["state"][names[k]][n], t)
                  for k, e in whole["state"].items() for n, t in e.items())
    return (_lists(whole), [p.detach().float().tolist() for p in model.parameters()],
            handed / total, views, sorted(kinds), full_ok)


def _load(rank, world_size, path, params, bucket_cap_mb):
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    import zero_triton
    model = _model(seed=5)

    def put_params():
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(torch.tensor(v))
    put_params()
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=bucket_cap_mb)
    _train(model, opt, 1, seed=99)  # state of its own first, to be overwritten
    put_params()
    sd = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd["optim"])
    return _lists(opt.state_dict())


def test_zero_adam_state_is_sharded_through_dcp_and_reshards_exactly(tmp_path):
    """Saved at 2 ranks (several buckets): each rank hands DCP about half the state, as
    views (StateDictOptions(full_state_dict=True) still gives the whole state); loaded at
    1, 2 (another bucket size) and 3 ranks, every rank holds exactly the saved state (fp32
    and bf16 + master, a 0-dim parameter, a 3-D one). Saved at 1 rank, loaded at 2, the
    same."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 2, path, timeout=300)
    want, params = saved[0][0], saved[0][1]
    handed = [s[2] for s in saved]
    assert all(0.3 < h < 0.7 for h in handed) and abs(sum(handed) - 1.0) < 0.05, handed
    assert all(s[3] for s in saved), "a local shard is not a view of the optimizer's state"
    assert ("exp_avg", "ShardedTensor") in saved[0][4] and ("step", "Tensor") in saved[0][4]
    assert all(s[5] for s in saved), "full_state_dict=True did not give the whole state"
    for world_size, bucket in ((1, None), (2, None), (3, 0.0005)):
        for got in run_ranks(_load, world_size, path, params, bucket, timeout=300):
            assert got == want, f"world size {world_size}, bucket_cap_mb={bucket}"
    # and from one rank (whole tensors in the checkpoint) to two
    path = str(tmp_path / "one")
    want, params = run_ranks(_save, 1, path, timeout=300)[0][:2]
    for got in run_ranks(_load, 2, path, params, 0.0008, timeout=300):
        assert got == want, "world size 1 -> 2"


def _stateful(rank, world_size, path, mode):
    """DCP's Stateful protocol with the optimizer itself (dcp.save({"optim": opt}))."""
    import zero_triton
    model = _model()
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    if mode == "save":
        dcp.save({"optim": opt}, checkpoint_id=path)
        return _lists(opt.state_dict())
    fresh = zero_triton.ZeroAdamW(_model(seed=3).parameters(), lr=1e-2)
    dcp.load({"optim": fresh}, checkpoint_id=path)
    return _lists(fresh.state_dict())


def test_dcp_stateful_optimizer_round_trips_at_another_world_size(tmp_path):
    path = str(tmp_path / "stateful")
    want = run_ranks(_stateful, 2, path, "save", timeout=300)[0]
    assert run_ranks(_stateful, 1, path, "load", timeout=300)[0] == want


def _to_torch(rank, world_size, path, out):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    model = _model().float()  # torch's AdamW keeps a bf16 parameter's moments in bf16
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dcp_to_torch_save(path, out)
    converted = torch.load(out, weights_only=False)
    set_optimizer_state_dict(model, torch_opt, converted["optim"])
    return _lists(torch_opt.state_dict())


def test_a_dcp_checkpoint_converts_to_a_file_torch_adamw_loads(tmp_path):
    """dcp_to_torch_save of a ZeroAdamW checkpoint (2 ranks) gives torch.optim.AdamW its
    state by the FQNs get_optimizer_state_dict named: step, exp_avg, exp_avg_sq as saved."""
    path = str(tmp_path / "ckpt")
    want = run_ranks(_save, 2, path, timeout=300)[0][0]
    got = run_ranks(_to_torch, 1, path, str(tmp_path / "optim.pt"), timeout=300)[0]
    for k, entry in want.items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert got[k][name] == entry[name], (k, name)
