"""offload="cpu": the optimizer state in host memory, stepped there segment by segment
(``zero_triton.optim.offload``), gives the same bits as the state beside the parameters,
for every state format, stage, world size, clipping and GradScaler, with delays
injected at random points of the pipeline; the ways out of the state interchange with a
state that is not offloaded. On CPU ranks the copies are host to host: what is proven
here is the pipeline and its order (the state lives in buffers of its own, the
parameters reach the optimizer's all-gathers only through the copy back)."""
from __future__ import annotations

import copy
import io
import random
import time

import pytest
import torch

import zero_triton
from dist_utils import delay_offload, run_ranks

RANK_TIMEOUT_S = 240

# (name, dtype, ZeroAdamW keywords, extra): the matrix every world size runs.
CONFIGS = [
    ("fp32 stage 1, buckets", torch.float32, dict(stage=1, bucket_cap_mb=0.002), {}),
    ("fp32 stage 2, buckets, clipped", torch.float32,
     dict(stage=2, bucket_cap_mb=0.002, max_grad_norm=0.05), {}),
    ("fp32 stage 1, one bucket, GradScaler", torch.float32, dict(stage=1, bucket_cap_mb=None),
     {"scaler": True}),
    ("bf16 fp32 master, int8 moments, stage 2", torch.bfloat16,
     dict(stage=2, bucket_cap_mb=0.002, moments="int8"), {}),
    ("bf16 remainder, int8 moments, stage 1", torch.bfloat16,
     dict(stage=1, bucket_cap_mb=0.002, master_weights="remainder", moments="int8"), {}),
    ("bf16 stochastic, bf16 moments, stage 2", torch.bfloat16,
     dict(stage=2, bucket_cap_mb=0.002, master_weights="stochastic", moments="bf16"), {}),
    ("bf16 int8 collectives, stage 1, clipped", torch.bfloat16,
     dict(stage=1, bucket_cap_mb=0.002, reduce_dtype="int8", gather_dtype="int8",
          max_grad_norm=0.05), {}),
    ("fp32 stage 2, some parameters without a gradient", torch.float32,
     dict(stage=2, bucket_cap_mb=0.002), {"partial": True}),
]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(dtype)


def _same(xs, ys) -> bool:
    """Two sequences of tensors (parameters) hold the same bits."""
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _same_state(a: dict, b: dict) -> bool:
    """Two state dicts hold the same entries, bit for bit."""
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k])


def _steps(model, opt, seeds, dtype) -> None:
    """A step of ``opt`` per seed on a batch drawn from it."""
    for t in seeds:
        model(torch.randn(5, 24, generator=torch.Generator().manual_seed(t)).to(dtype)) \
            .float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _placed(offload) -> dict:
    """The optimizer's keywords for ``offload``: None, "cpu" (all of the state) or a
    fraction (that share of it offloaded, the rest beside the parameters)."""
    if isinstance(offload, float):
        return dict(offload="cpu", offload_fraction=offload)
    return dict(offload=offload)


def _train(rank, world, dtype, kw, extra, offload, seed, steps=4):
    model = _model(dtype)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=2e-2, **_placed(offload), **kw)
    if offload and seed is not None:
        delay_offload(opt, random.Random(seed * 100 + rank))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) \
        if extra.get("scaler") else None
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(6, 24, generator=g).to(dtype)
        if scaler is not None and t == 1 and rank == 0:
            x[0, 0] = float("inf")  # an inf gradient: GradScaler skips the step everywhere
        out = model(x)
        if extra.get("partial") and t % 2:
            out = model[:3](x)  # the last layer has no gradient at odd steps
        loss = out.float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return model, opt


FRACTIONS = (0.25, 0.5, 0.75)  # a part offloaded: config i offloads FRACTIONS[i % 3] of it


def _expected_cut(layout, f) -> int:
    """The docs' rule: the first state element in host memory is the one nearest
    (1 - f) of the shard, on the moments' alignment; between parameters where the shard
    is a whole buffer (one process), so that each parameter's state lies on one side."""
    n = layout.shard_numel
    target = (1 - f) * n
    if layout.world_size == 1:
        return min(list(layout.offsets) + [n], key=lambda o: (abs(o - target), o))
    return min(n, round(target / layout.align) * layout.align)


def _rank_matrix(rank, world, seed):
    out = []
    for c, (name, dtype, kw, extra) in enumerate(CONFIGS):
        plain_model, plain = _train(rank, world, dtype, kw, extra, None, None)
        host_model, host = _train(rank, world, dtype, kw, extra, "cpu", seed)
        part_model, part = _train(rank, world, dtype, kw, extra, FRACTIONS[c % 3], seed)
        state_on_host = all(t.device.type == "cpu" and t.data_ptr() != f.flat_param.data_ptr()
                            for fl in host._shards.groups for f in fl for t in [f.state.master.parameters()])
        # A part offloaded: each shard in two sides, split where the fraction says (on
        # the moments' alignment), the second over mirrors of its own.
        f = part._shards.groups[0][0]
        n, cut = f.layout.shard_numel, _expected_cut(f.layout, FRACTIONS[c % 3])
        sides = [(type(side.place).__name__, side.state.moments.numel) for side in f.sides]
        split_right = sides == [("DevicePlace", cut), ("HostPlace", n - cut)] and \
            f.sides[1].place.mirror.data_ptr() != f.flat_param.data_ptr()
        hosts = [o.memory_report()["host"] for o in (plain, part, host)]
        out.append((name, _same(plain_model.parameters(), host_model.parameters()),
                    _same_state(plain.state_dict(), host.state_dict()),
                    _same(plain_model.parameters(), part_model.parameters()),
                    _same_state(plain.state_dict(), part.state_dict()), state_on_host,
                    split_right or sides, hosts))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offloaded_state_steps_to_the_same_bits_at_every_world_size(world):
    """All of the state offloaded, and a part of it (``offload_fraction``): the same
    parameters and state as beside the parameters, bit for bit."""
    results = run_ranks(_rank_matrix, world, world, timeout=RANK_TIMEOUT_S)
    for rank, rows in enumerate(results):
        for name, params, state, part_params, part_state, on_host, split, hosts in rows:
            where = f"{name}, rank {rank} of {world}"
            assert params and part_params, f"parameters differ: {where} ({params}, {part_params})"
            assert state and part_state, f"state differs: {where} ({state}, {part_state})"
            assert on_host, where
            assert split is True, f"{where}: sides {split}"
            assert 0 == hosts[0] < hosts[1] < hosts[2], f"{where}: host bytes {hosts}"


def _rank_delays(rank, world, seeds):
    rows = []
    for seed in seeds:
        for name, dtype, kw, extra in CONFIGS[:2] + CONFIGS[3:4]:
            plain_model, _ = _train(rank, world, dtype, kw, extra, None, None, steps=3)
            for offload in ("cpu", 0.5):
                host_model, _ = _train(rank, world, dtype, kw, extra, offload, seed, steps=3)
                rows.append((seed, f"{name}, offload {offload}",
                             _same(plain_model.parameters(), host_model.parameters())))
    return rows


@pytest.mark.parametrize("world", [4])
def test_random_delays_in_the_pipeline_change_no_bit(world):
    """Seeded schedules of sleeps before each gradient copy, host step, copy back and
    all-gather, different on every rank (at 4 ranks; 2 ranks' pipeline is the same code,
    and the world sizes' bits are compared without delays above)."""
    for rank, rows in enumerate(run_ranks(_rank_delays, world, [11, 12, 13], timeout=RANK_TIMEOUT_S)):
        for seed, name, same in rows:
            assert same, f"{name}: schedule {seed}, rank {rank} of {world}"


def _rank_parameters_reach_the_gather_only_through_the_copy_back(rank, world):
    model = _model(torch.float32)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-1, offload="cpu", bucket_cap_mb=0.002)
    before = [p.detach().clone() for p in model.parameters()]
    for fl in opt._shards.groups:
        for f in fl:
            f.place.done = lambda ks: None  # the updated mirrors never go back
    model(torch.randn(4, 24)).pow(2).sum().backward()
    opt.step()
    return _same(before, model.parameters())


def test_the_parameters_come_back_from_the_host_mirrors():
    """With the copy back taken out the parameters never change: the host kernel steps
    mirrors of its own, not the device's parameters."""
    assert all(run_ranks(_rank_parameters_reach_the_gather_only_through_the_copy_back, 2,
                         timeout=RANK_TIMEOUT_S))


def _bytes(obj) -> bytes:
    """``obj`` through torch.save: tensors cross the rank's queue as bytes, not as
    shared memory that dies with the rank."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rank_checkpoints(rank, world, path, saved):
    dtype, kw = torch.bfloat16, dict(stage=2, bucket_cap_mb=0.002, moments="int8")
    model, opt = _train(rank, world, dtype, kw, {}, saved, None)
    zero_triton.checkpoint.save(path, opt, model)
    return _bytes(opt.state_dict())


def _rank_load(rank, world, path, offload):
    dtype, kw = torch.bfloat16, dict(stage=2, bucket_cap_mb=0.002, moments="int8")
    model = _model(dtype)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=2e-2, **_placed(offload), **kw)
    zero_triton.checkpoint.load(path, opt, model)
    sd = opt.state_dict()
    # One more step from the loaded state, for both placements to compare.
    model(torch.randn(6, 24, generator=torch.Generator().manual_seed(rank)).to(dtype)).float().pow(2).mean().backward()
    opt.step()
    return _bytes((sd, [p.detach().clone() for p in model.parameters()]))


@pytest.mark.parametrize("saved", ["cpu", None, 0.5])
def test_a_checkpoint_moves_between_offloaded_and_not_at_another_world_size(tmp_path, saved):
    """Saved at 2 ranks offloaded, not, or half offloaded; loaded at 3 each of the three
    ways: every load holds what was saved, and the step after it is the same bits."""
    saved_sd = torch.load(io.BytesIO(run_ranks(_rank_checkpoints, 2, str(tmp_path / "ck"),
                                               saved, timeout=RANK_TIMEOUT_S)[0]))
    got = {off: [torch.load(io.BytesIO(b)) for b in run_ranks(
        _rank_load, 3, str(tmp_path / "ck"), off, timeout=RANK_TIMEOUT_S)]
        for off in (None, "cpu", 0.5)}
    for off, ranks in got.items():
        sd = ranks[0][0]
        for k, entry in saved_sd["state"].items():
            for n, v in entry.items():
                assert torch.equal(sd["state"][k][n], v), (off, k, n)
    for r in range(3):  # the step after the load: the same bits offloaded or not
        assert _same(got[None][r][1], got["cpu"][r][1]) and _same(got[None][r][1], got[0.5][r][1])


def test_fused_adam_offloaded_is_the_same_bits_and_its_state_lives_apart():
    for dtype, kw in [(torch.float32, {}), (torch.bfloat16, {"moments": "int8"}),
                      (torch.bfloat16, {"master_weights": "remainder"}),
                      (torch.bfloat16, {"master_weights": "remainder8", "moments": "int8"})]:
        runs = []
        for offload in (None, "cpu", 0.5):
            model = _model(dtype)
            opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1,
                                         **_placed(offload), **kw)
            _steps(model, opt, range(3), dtype)
            runs.append((model, opt))
        (m0, o0), *others = runs
        for m1, o1 in others:
            assert _same(m0.parameters(), m1.parameters()), (dtype, kw)
            assert _same_state(o0.state_dict(), o1.state_dict()), (dtype, kw)
        flat = runs[1][1]._shards.groups[0][0]
        assert flat.state.master.parameters().data_ptr() != flat.flat_param.data_ptr()
        # The user writes a parameter: the host mirror follows (the next step starts there).
        with torch.no_grad():
            for m, _ in runs:
                for p in m.parameters():
                    p.mul_(0.5)
        for m, o in runs:
            _steps(m, o, [9], dtype)
        for m1, _ in others:
            assert _same(m0.parameters(), m1.parameters()), (dtype, kw)
        # A state dict saved offloaded (all or half) loads without offload, and the
        # reverse: each then holds what the other saved, and the next steps agree.
        for m1, o1 in others:
            s0, s1 = copy.deepcopy(o0.state_dict()), copy.deepcopy(o1.state_dict())
            o0.load_state_dict(s1)
            o1.load_state_dict(s0)
            assert _same_state(o0.state_dict(), s1) and _same_state(o1.state_dict(), s0), (dtype, kw)
        for m, o in runs:
            _steps(m, o, [10, 11], dtype)
        for m1, _ in others:
            assert _same(m0.parameters(), m1.parameters()), (dtype, kw)


def test_a_copy_keeps_the_offload():
    model = _model(torch.float32)
    opt = zero_triton.FusedAdamW(model.parameters(), offload="cpu")
    model(torch.randn(2, 24)).sum().backward()
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin._shards.groups[0][0].place.offloaded


@pytest.mark.parametrize("kw, match", [
    (dict(offload="gpu"), "offload must be None"),
    (dict(offload="cpu", offload_fraction=1.5), r"offload_fraction must be a number in \[0, 1\]"),
    (dict(offload="cpu", offload_fraction=True), "offload_fraction must be a number"),
    (dict(offload_fraction=1.0), "applies to offload='cpu'"),
    (dict(offload="cpu", differentiable=True), "differentiable=True"),
])
def test_bad_offload_arguments_are_refused_before_anything_changes(kw, match):
    model = _model(torch.float32)
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        zero_triton.FusedAdamW(model.parameters(), **kw)
    assert before == [p.data_ptr() for p in model.parameters()]  # nothing was re-homed


def test_a_fraction_splits_each_shard_on_the_moments_alignment():
    """``offload_fraction``: the last f of each shard's state elements in host memory,
    rounded to the format's alignment (an int8 block is never cut), between parameters
    in one process; a fraction that rounds to none or all of a shard keeps it on one
    side."""
    for moments, f in [("fp32", 0.3), ("int8", 0.5), ("bf16", 0.9), ("fp32", 0.001), ("fp32", 0.999)]:
        model = _model(torch.float32)
        opt = zero_triton.FusedAdamW(model.parameters(), moments=moments, offload="cpu",
                                     offload_fraction=f)
        flat = opt._shards.groups[0][0]
        n, cut = flat.layout.shard_numel, _expected_cut(flat.layout, f)
        assert cut % flat.layout.align == 0 and cut in (*flat.layout.offsets, n)
        places = [(type(s.place).__name__, s.state.moments.numel) for s in flat.sides]
        if cut == n:
            assert places == [("DevicePlace", n)] and opt.memory_report()["host"] == 0, places
        elif cut == 0:
            assert places == [("HostPlace", n)], places
        else:
            assert places == [("DevicePlace", cut), ("HostPlace", n - cut)], places
            assert flat.sides[1].place.mirror.numel() == n - cut
            if moments == "fp32":  # opt.state: views of the live state on either side
                _steps(model, opt, [0], torch.float32)
                sides = {side.state.moments.exp_avg.untyped_storage().data_ptr(): k
                         for k, side in enumerate(flat.sides)}
                held = [sides.get(opt.state[p]["exp_avg"].untyped_storage().data_ptr())
                        for p in model.parameters()]
                assert set(held) == {0, 1}, held  # each a view of one side's storage
                first = next(iter(model.parameters()))
                opt.state[first]["exp_avg"].add_(1.0)  # written in place: the state itself
                assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt.state[first]["exp_avg"])
        assert opt.memory_report()["host"] <= zero_triton.FusedAdamW(
            _model(torch.float32).parameters(), moments=moments, offload="cpu").memory_report()["host"]
    # Several ranks cut anywhere on the alignment: ZeroAdam's shards (the matrix tests).


def test_a_split_state_reads_and_writes_as_one():
    """The ways out see one state: an export joins the sides, a commit and a user's
    write that straddles the cut reach both."""
    model = _model(torch.bfloat16)
    opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, moments="int8", offload="cpu",
                                 offload_fraction=0.5)
    _steps(model, opt, range(2), torch.bfloat16)
    flat = opt._shards.groups[0][0]
    state, cut = flat.state, flat.sides[1].cut
    bufs = state.buffers()
    assert all(b.numel() == flat.layout.shard_numel for b in bufs.values())
    first = flat.sides[0].state.buffers()
    assert all(torch.equal(bufs[k][:cut], first[k]) for k in first)
    bufs["master_param"][cut - 3:cut + 3] = 7.0  # across the cut
    state.commit(bufs)
    assert torch.equal(state.buffers()["master_param"], bufs["master_param"])
    state.master.publish()  # the parameters from the master, on both sides of the cut
    assert torch.equal(flat.flat_param[cut - 3:cut + 3].float(), torch.full((6,), 7.0))
    assert torch.equal(flat.sides[1].place.mirror[:3].float(), torch.full((3,), 7.0))


def test_a_host_allocation_that_fails_names_the_bytes_and_the_fix(monkeypatch):
    from zero_triton.optim import offload
    real = torch.empty

    def failing(*args, **kwargs):
        if "pin_memory" in kwargs:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)
    monkeypatch.setattr(offload.torch, "empty", failing)
    model = _model(torch.float32)
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"could not allocate \d+ bytes .* leave offload out"):
        zero_triton.FusedAdamW(model.parameters(), offload="cpu")
    monkeypatch.undo()
    # The parameters keep their values and no hook of the refused optimizer stays behind:
    # an optimizer without offload trains them as one built first would.
    assert _same(values, model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    opt = zero_triton.FusedAdamW(model.parameters())
    model(torch.randn(2, 24)).sum().backward()
    opt.step()


def _rank_fsdp2(rank, world, dtype, kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    runs = []
    for offload in (None, "cpu", 0.5):
        model = _model(dtype)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = zero_triton.FusedAdamW(model.parameters(), lr=2e-2, **_placed(offload), **kw)
        for t in range(3):
            x = torch.randn(6, 24, generator=torch.Generator().manual_seed(t)).to(dtype)
            model(x).float().pow(2).mean().backward()
            opt.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        full = [p.full_tensor() for p in model.parameters()]
        state = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in opt.state[p].items()}
                 for p in model.parameters()]
        runs.append((full, state, opt.memory_report()["host"]))
    (p0, s0, h0), *others = runs
    same = all(_same(p0, p1) for p1, _, _ in others)
    same_state = all(torch.equal(a[k], b[k]) for _, s1, _ in others for a, b in zip(s0, s1) for k in a)
    return same, same_state, 0 == h0 < others[1][2] < others[0][2]


@pytest.mark.parametrize("dtype, kw", [(torch.float32, {}),
                                       (torch.bfloat16, {"moments": "int8"}),
                                       (torch.bfloat16, {"master_weights": "remainder"})])
def test_fsdp2_parameters_offloaded_step_to_the_same_bits(dtype, kw):
    for rank, (same, same_state, placed) in enumerate(run_ranks(_rank_fsdp2, 2, dtype, kw,
                                                                timeout=RANK_TIMEOUT_S)):
        assert same and same_state and placed, (rank, dtype, kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (offload's pinned "
                    "buffers and its device-to-host copies)")
def test_cuda_offload_keeps_the_state_pinned_on_the_host_and_off_the_device():
    """On a GPU the host kernel (C++) and the device kernel (Triton/CUDA) compute one
    formula in different code: the parameters agree to float32 rounding, not bit for bit."""
    results = {}
    for offload in (None, "cpu", 0.5):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = _model(torch.float32).cuda()
        base = torch.cuda.memory_allocated()  # the optimizer's device bytes count from here
        opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1,
                                     **_placed(offload))
        for t in range(3):
            x = torch.randn(5, 24, generator=torch.Generator().manual_seed(t)).cuda()
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        results[offload] = (model, opt, torch.cuda.memory_allocated() - base)
    (m0, _, kept), (m1, o1, grown) = results[None], results["cpu"]
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    flat = o1._shards.groups[0][0]
    assert flat.state.moments.storage()[0].device.type == "cpu"
    assert flat.place.mirror.is_pinned() and flat.place.staging[torch.float32].is_pinned()
    assert o1.memory_report()["host"] > 0 and grown < kept  # the moments are not on the device
    # Half offloaded: the first part's state on the GPU, the rest pinned on the host, the
    # two stepped in one step (the parameters as close as the whole offload's).
    m2, o2, half = results[0.5]
    for a, b in zip(m0.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    first, second = o2._shards.groups[0][0].sides
    assert first.state.moments.storage()[0].is_cuda and not second.state.moments.storage()[0].is_cuda
    assert second.place.mirror.is_pinned() and grown < half < kept


def test_the_memory_model_splits_device_and_host_bytes():
    from zero_triton.memory.model import memory_table
    p, n = 70_000_000_000, 64
    plain = {r["stage"]: r for r in memory_table(p, n)["stages"]}
    full = {r["stage"]: r for r in memory_table(p, n, offload_fraction=1.0)["stages"]}
    half = {r["stage"]: r for r in memory_table(p, n, offload_fraction=0.5)["stages"]}
    shard = -(-p // n)
    z1 = full["zero1"]
    assert z1["device_bytes"] == plain["zero1"]["bytes_per_rank"] - 12 * shard  # no state left
    assert z1["host_bytes"] == 12 * shard + (2 + 2) * shard  # state + mirror + staging
    assert z1["bus_bytes_per_step"] == (2 + 2) * shard
    assert half["zero2"]["device_bytes"] == plain["zero2"]["bytes_per_rank"] - 6 * shard
    int8 = {r["stage"]: r for r in memory_table(p, n, "remainder", "int8", 1.0)["stages"]}
    assert int8["zero1"]["host_bytes"] == -int(-(2 + 2 + 8 / 256) * shard // 1) + 4 * shard


def test_the_memory_command_prints_offload(capsys):
    from zero_triton.tools.memory import main
    assert main(["--params", "70B", "--world-size", "64", "--offload", "--moments", "int8"]) == 0
    out = capsys.readouterr().out
    assert "device GB" in out and "host GB" in out and "offload='cpu'" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--params", "70B", "--world-size", "64", "--offload-fraction", "0.5"])
    assert exit_.value.code == 2
    assert "pass --offload too" in capsys.readouterr().err


def _rank_killed_mid_step(rank, world, path):
    import json
    import os
    model = _model(torch.float32)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, offload="cpu", bucket_cap_mb=0.002)
    if rank == 1:
        def die(ks, done=opt._shards.groups[0][0].place.done):
            os._exit(3)  # killed between its host step and the copy back
        opt._shards.groups[0][0].place.done = die
    start = time.monotonic()
    try:
        for _ in range(3):
            model(torch.randn(4, 24)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        outcome = ["trained on", time.monotonic() - start, ""]
    except RuntimeError as exc:
        outcome = ["raised", time.monotonic() - start, str(exc)[:300]]
    with open(path, "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the group cannot be torn down with a dead peer


def test_a_peer_killed_mid_step_fails_the_other_loudly_within_seconds(tmp_path):
    import json
    path = tmp_path / "rank0.json"
    with pytest.raises(RuntimeError, match="died without reporting"):
        run_ranks(_rank_killed_mid_step, 2, str(path), timeout=90, pg_timeout_s=600)
    what, seconds, message = json.loads(path.read_text())
    assert what == "raised", "rank 0 trained on without its peer"
    assert seconds < 30, seconds


def _rank_cycles(rank, world, cycles):
    import gc
    import threading
    import weakref
    threads, mirrors = threading.active_count(), []
    for c in range(cycles):
        model = _model(torch.float32)
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, stage=1 + c % 2,
                                    bucket_cap_mb=0.002, **_placed("cpu" if c % 3 else 0.5))
        model(torch.randn(4, 24)).pow(2).sum().backward()
        opt.step()
        opt.state_dict()
        torch.distributed.barrier()  # every rank's state_dict served before any drops its optimizer
        mirrors.append(weakref.ref(opt._shards.groups[0][0].place.mirror))
        hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
        del opt
        gc.collect()
        assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) < max(hooks, 1)
    gc.collect()
    return [m() is None for m in mirrors], threading.active_count() - threads


def test_ten_build_and_drop_cycles_leave_no_host_buffers_behind():
    for alive, threads in run_ranks(_rank_cycles, 2, 10, timeout=RANK_TIMEOUT_S):
        assert all(alive), alive
        assert threads <= 1, threads  # at most the shard server's thread, once


def _rank_hybrid(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    kw = dict(stage=2, bucket_cap_mb=0.002, device_mesh=mesh, moments="int8")
    a, _ = _train(rank, world, torch.float32, kw, {}, None, None)
    b, _ = _train(rank, world, torch.float32, kw, {}, "cpu", 5)
    c, _ = _train(rank, world, torch.float32, kw, {}, 0.5, 6)
    return _same(a.parameters(), b.parameters()) and _same(a.parameters(), c.parameters())


def test_hybrid_sharding_offloaded_steps_to_the_same_bits():
    assert all(run_ranks(_rank_hybrid, 4, timeout=RANK_TIMEOUT_S))


def test_a_model_cast_after_construction_is_followed_offloaded_as_on_the_device():
    """``model.to(dtype)`` after the optimizer was built re-homes its shards: the
    offloaded one builds new host buffers and carries its moments over, as the other."""
    runs = []
    for offload in (None, "cpu", 0.5):
        model = _model(torch.float32)
        opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, **_placed(offload))
        _steps(model, opt, range(2), torch.float32)
        model.to(torch.bfloat16)
        _steps(model, opt, range(2, 4), torch.bfloat16)
        runs.append((model, opt))
    (m0, o0), *others = runs
    for m1, o1 in others:
        assert _same(m0.parameters(), m1.parameters())
        assert o1._shards.groups[0][0].place.offloaded and o1._shards.groups[0][0].dtype == torch.bfloat16
        assert _same_state(o0.state_dict(), o1.state_dict())
    assert len(others[1][1]._shards.groups[0][0].sides) == 2


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes ``SLOW_S``: a bucket's average lands before
    backward reaches the next one (as on a model whose layers take time)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(SLOW_S)
        return g


SLOW_S = 0.03


class _Slow(torch.nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


# (name, ZeroAdamW keywords, what happens between backward and step): each writes the
# averages after they landed, so the copies taken then must be taken again.
EARLY_CASES = [
    ("stage 1", dict(stage=1), None),
    ("stage 2", dict(stage=2), None),
    ("stage 2, GradScaler.unscale_ then clip_grad_norm_", dict(stage=2), "unscale"),
    ("stage 1, GradScaler.unscale_", dict(stage=1), "unscale"),
    ("stage 2, two micro-batches outside no_sync", dict(stage=2), "accumulate"),
    ("stage 1, zero_grad and another backward", dict(stage=1), "again"),
    ("stage 1, a .grad written by hand", dict(stage=1), "write"),
]


def _early_train(rank, kw, what, offload):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(32, 32), _Slow()]
    model = torch.nn.Sequential(*layers)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.004, **_placed(offload), **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if what == "unscale" else None
    places = [side.place for fl in opt._shards.groups for f in fl for side in f.sides if side.place.offloaded]
    early = 0
    for t in range(3):
        before = sum(p.copies for p in places)

        def backward(s):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * t + 10 * rank + s))
            loss = model(x).pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        backward(0)
        if what == "accumulate":
            backward(1)
        elif what == "again":
            opt.zero_grad()
            backward(2)
        elif what == "write":
            model[0].weight.grad.mul_(0.5)
        copies = sum(p.copies for p in places)
        if scaler is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if t:  # the order of the buckets is learned at the first step: none launch before it
            early += copies - before
        opt.zero_grad()
    return model, opt, early


def _rank_early(rank, world):
    rows = []
    for name, kw, what in EARLY_CASES:
        plain, plain_opt, _ = _early_train(rank, kw, what, None)
        for offload in ("cpu", 0.5):
            model, opt, early = _early_train(rank, kw, what, offload)
            rows.append((f"{name}, offload {offload}", early,
                         _same(plain.parameters(), model.parameters()),
                         _same_state(plain_opt.state_dict(), opt.state_dict())))
    return rows


def test_averages_are_copied_to_the_host_as_they_land_and_again_once_written():
    """Each bucket's averaged shard is copied to the host while backward still runs (a
    backward slow enough that an average lands before the next bucket's launch); one
    written afterwards (GradScaler's unscale, another micro-batch, zero_grad and a new
    backward, a .grad edited by hand) is copied again: the same bits as no offload."""
    for rank, rows in enumerate(run_ranks(_rank_early, 2, timeout=RANK_TIMEOUT_S)):
        for name, early, params, state in rows:
            assert params and state, f"{name}, rank {rank}: parameters {params}, state {state}"
            assert early > 0, f"{name}, rank {rank}: no copy was taken during backward"
