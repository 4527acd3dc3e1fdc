"""capturable=True: a warmed-up step that a CUDA graph can capture, proven on CPU by what
it dispatches (``zero_triton.tools.dispatch``): no op allocates, none reads a value on
the host, and two steps run the same ops on the same addresses; over the state formats,
stage 1 and 2, int8 collectives, hybrid sharding, clipping (``max_grad_norm=`` and
torch's ``clip_grad_norm_`` through the optimizer), GradScaler and a scheduler writing a
tensor lr. The results are the bits of the same training without capturable=True; the
recorder catches an allocation, a host read and a changed step planted in a step; the
ranks' device agreement skips the steps of ranks that went apart and the next call that
agrees on the host raises."""
from __future__ import annotations

import pytest
import torch

import zero_triton
from dist_utils import run_ranks
from zero_triton.tools.dispatch import record

RANK_TIMEOUT_S = 240
STEPS = 5  # the last two are recorded (the first ones build what the step keeps)

# (name, dtype, keywords, extra): ZeroAdamW's matrix at 2 ranks.
ZERO_CASES = [
    ("fp32 stage 1", torch.float32, dict(stage=1), {}),
    ("fp32 stage 2", torch.float32, dict(stage=2), {}),
    ("fp32 stage 1, max_grad_norm", torch.float32, dict(stage=1, max_grad_norm=0.05), {}),
    ("fp32 stage 2, torch's clip_grad_norm_", torch.float32, dict(stage=2), {"clip": 0.05}),
    ("fp32 stage 1, a scheduler writing a tensor lr", torch.float32, dict(stage=1), {"schedule": True}),
    ("fp32 stage 2, GradScaler, clipped", torch.float32, dict(stage=2, max_grad_norm=0.05),
     {"scaler": True}),
    ("bf16 fp32 master, int8 moments, stage 2", torch.bfloat16, dict(stage=2, moments="int8"), {}),
    ("bf16 remainder, int8 moments", torch.bfloat16,
     dict(master_weights="remainder", moments="int8"), {}),
    ("bf16 stochastic, bf16 moments", torch.bfloat16,
     dict(master_weights="stochastic", moments="bf16"), {}),
    ("bf16 int8 collectives, stage 1, clipped", torch.bfloat16,
     dict(reduce_dtype="int8", gather_dtype="int8", max_grad_norm=0.05), {}),
    ("fp32 int8 average, stage 2", torch.float32, dict(stage=2, reduce_dtype="int8"), {}),
    ("fp32 amsgrad, some parameters frozen", torch.float32, dict(amsgrad=True), {"frozen": True}),
]
# FusedAdamW on one process.
FUSED_CASES = [
    ("fp32", torch.float32, {}, {}),
    ("fp32, max_grad_norm", torch.float32, dict(max_grad_norm=0.05), {}),
    ("fp32, torch's clip_grad_norm_ and a scheduler", torch.float32, {}, {"clip": 0.05, "schedule": True}),
    ("bf16 fp32 master, int8 moments", torch.bfloat16, dict(moments="int8"), {}),
    ("bf16 remainder, bf16 moments", torch.bfloat16, dict(master_weights="remainder", moments="bf16"), {}),
    ("bf16 remainder8, int8 moments", torch.bfloat16, dict(master_weights="remainder8", moments="int8"), {}),
    ("bf16 stochastic, int8 moments", torch.bfloat16, dict(master_weights="stochastic", moments="int8"), {}),
    ("fp32, GradScaler", torch.float32, {}, {"scaler": True}),
]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dtype)


def _train(rank, cls, dtype, kw, extra, capturable, plant=None):
    """STEPS steps; returns the model, the optimizer and the recordings of the last two
    (of ``opt.step()`` alone: GradScaler's own ``unscale_`` and ``step`` make their inf
    flags afresh each step, outside the optimizer)."""
    model = _model(dtype)
    if extra.get("frozen"):
        model[2].requires_grad_(False)
    lr = torch.tensor(2e-2) if capturable else 2e-2
    bucket = dict(bucket_cap_mb=0.01) if cls is zero_triton.ZeroAdamW else {}
    opt = cls(model.parameters(), lr=lr, capturable=capturable, **bucket, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)) \
        if extra.get("schedule") else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=2) \
        if extra.get("scaler") else None
    if plant is not None:
        opt.register_step_pre_hook(plant)
    recordings = []
    for t in range(STEPS):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * t + rank)).to(dtype)
        loss = model(x).float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if extra.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), extra["clip"])
        if scaler is not None:  # scaler.step(opt) sets the flags, then calls opt.step
            step, held = opt.step, []
            opt.step = lambda: held.append(record(step) if t >= STEPS - 2 else step())
            scaler.step(opt)
            del opt.step
            recordings.append(held[0])
            scaler.update()
        else:
            recordings.append(record(opt.step) if t >= STEPS - 2 else opt.step())
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay where backward writes them
    return model, opt, recordings[-2:]


def _problems(first, second, extra) -> list:
    """What stops a capture of the step. With GradScaler, the inf flag the step reads is
    one GradScaler makes afresh each step (torch's code, outside the optimizer): a graph
    that captures ``scaler.step`` replays that allocation at the same address, two eager
    steps do not, so its steps are compared by their ops alone, and the allocations
    counted are the optimizer's."""
    if not extra.get("scaler"):
        return first.problems(second)
    return [p for p in first.problems(second, addresses=False)
            if not (p.startswith("allocates") and p.endswith(" at "))]


def _check(rank, cls, name, dtype, kw, extra):
    plain, _, _ = _train(rank, cls, dtype, kw, extra, False)
    model, opt, (first, second) = _train(rank, cls, dtype, kw, extra, True)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    return (name, same, _problems(first, second, extra), len(first.ops))


def _rank_zero(rank, world, cases):
    return [_check(rank, zero_triton.ZeroAdamW, *case) for case in cases]


@pytest.mark.parametrize("half", [0, 1])
def test_zero_adamw_capturable_steps_allocate_nothing_read_nothing_and_repeat(half):
    cases = ZERO_CASES[half::2]
    for rank, rows in enumerate(run_ranks(_rank_zero, 2, cases, timeout=RANK_TIMEOUT_S)):
        for name, same, problems, n in rows:
            assert not problems, f"{name}, rank {rank} ({n} ops): " + "; ".join(problems)
            assert same, f"{name}, rank {rank}: capturable=True changed the parameters"


def _rank_hybrid(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return [_check(rank, zero_triton.ZeroAdamW, name, torch.float32, dict(device_mesh=mesh, **kw), {})
            for name, kw in [("hybrid 2x2, stage 2, clipped", dict(stage=2, max_grad_norm=0.05)),
                             ("hybrid 2x2, int8 average", dict(reduce_dtype="int8"))]]


def test_hybrid_sharding_capturable_steps_allocate_nothing_and_repeat():
    for rank, rows in enumerate(run_ranks(_rank_hybrid, 4, timeout=RANK_TIMEOUT_S)):
        for name, same, problems, n in rows:
            assert not problems, f"{name}, rank {rank} ({n} ops): " + "; ".join(problems)
            assert same, f"{name}, rank {rank}"


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_adamw_capturable_step_allocates_nothing_reads_nothing_and_repeats(case):
    name, same, problems, n = _check(0, zero_triton.FusedAdamW, *case)
    assert not problems, f"{name} ({n} ops): " + "; ".join(problems)
    assert same, name


def _plant_allocation(opt, args, kwargs):
    torch.zeros(3)


def _plant_host_read(opt, args, kwargs):
    torch.ones(1).add_(1).item()


class _PlantEveryOther:
    def __init__(self):
        self.calls = 0

    def __call__(self, opt, args, kwargs):
        self.calls += 1
        if self.calls % 2:
            opt.param_groups[0]["params"][0].detach().add_(0)


@pytest.mark.parametrize("plant, expect", [(_plant_allocation, "allocates"),
                                           (_plant_host_read, "reads a value on the host"),
                                           (_PlantEveryOther(), "steps differ")])
def test_the_recorder_catches_what_is_planted(plant, expect):
    _, _, (first, second) = _train(0, zero_triton.FusedAdamW, torch.float32, {}, {}, True, plant=plant)
    problems = first.problems(second)
    assert any(p.startswith(expect) for p in problems), problems
    _, _, (first, second) = _train(0, zero_triton.FusedAdamW, torch.float32, {}, {}, True)
    assert not first.problems(second)


def test_without_capturable_the_step_allocates_and_the_recorder_says_where():
    """The default step agrees on the host (its rows made from host values, the answer
    read back): what capturable=True moves to the device, as the recorder sees it."""
    rows = run_ranks(_rank_default, 2, timeout=RANK_TIMEOUT_S)
    problems = rows[0]
    assert any("allocates" in p and "agreement.py" in p for p in problems), problems
    assert any("reads a value on the host" in p for p in problems), problems


def _rank_default(rank, world):
    _, _, (first, second) = _train(rank, zero_triton.ZeroAdamW, torch.float32, {}, {}, False)
    return first.problems(second)


def _rank_diverged(rank, world):
    model = _model(torch.float32)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=torch.tensor(1e-2), capturable=True,
                                bucket_cap_mb=0.01)
    for t in range(3):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
    if rank == 1:  # a scheduler stepped on one rank only
        opt.param_groups[0]["lr"].fill_(5e-3)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()  # no host read: the device agreement skips it on every rank
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    try:
        opt.state_dict()  # the next call that agrees on the host reads what it found
    except RuntimeError as exc:
        return unchanged, str(exc)
    return unchanged, None


def test_ranks_that_go_apart_skip_their_steps_and_the_next_host_agreement_raises():
    for rank, (unchanged, error) in enumerate(run_ranks(_rank_diverged, 2, timeout=RANK_TIMEOUT_S)):
        assert unchanged, f"rank {rank} stepped with ranks apart"
        assert error is not None and "different step counts, lrs" in error, (rank, error)


@pytest.mark.parametrize("kw, match", [
    (dict(offload="cpu"), "offload='cpu' cannot be used with capturable=True"),
    (dict(differentiable=True), "capturable=True cannot be used with differentiable=True"),
])
def test_what_cannot_be_captured_is_refused_at_construction(kw, match):
    model = _model(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        zero_triton.FusedAdamW(model.parameters(), capturable=True, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _rank_served(rank, world):
    import torch.distributed as dist
    sds = []
    for capturable in (False, True):
        model, opt, _ = _train(rank, zero_triton.ZeroAdamW, torch.float32, dict(stage=2), {}, capturable)
        sds.append(opt.state_dict() if rank == 0 else None)  # rank 1's server answers
        dist.barrier()
    if rank:
        return True
    plain, captured = sds
    return all(torch.equal(plain["state"][k][n], captured["state"][k][n])
               for k in plain["state"] for n in plain["state"][k] if n != "step")


def test_a_peer_reads_a_capturable_optimizers_state_from_its_shard_server():
    """The shard server answers rank 0's state_dict() from a capturable optimizer's
    state: no version or event follows a replayed step, so it waits for the device and
    copies afresh; the state is the one the default optimizer holds."""
    assert all(run_ranks(_rank_served, 2, timeout=RANK_TIMEOUT_S))


def _rank_join(rank, world):
    from torch.distributed.algorithms.join import Join
    model = _model(torch.float32)
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=torch.tensor(1e-2), capturable=True)
    try:
        with Join([opt]):
            pass
    except ValueError as exc:
        return str(exc)
    return None


def test_join_is_refused_with_the_reason():
    for message in run_ranks(_rank_join, 2, timeout=RANK_TIMEOUT_S):
        assert message is not None and "capturable=True) under torch's Join" in message, message


def _rank_fsdp2(rank, world, kw):
    from torch.distributed.fsdp import fully_shard
    out = []
    for capturable in (False, True):
        model = _model(torch.float32)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = zero_triton.FusedAdamW(model.parameters(), lr=torch.tensor(1e-2),
                                     capturable=capturable, **kw)
        recordings = []
        for t in range(STEPS):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * t + rank))
            model(x).pow(2).mean().backward()
            recordings.append(record(opt.step) if t >= STEPS - 2 else opt.step())
            opt.zero_grad(set_to_none=False)
        out.append(([p.full_tensor() for p in model.parameters()], recordings[-2:]))
    (plain, _), (captured, (first, second)) = out
    return all(torch.equal(a, b) for a, b in zip(plain, captured)), first.problems(second)


@pytest.mark.parametrize("kw", [dict(max_grad_norm=0.05), dict(moments="int8")],
                         ids=["clipped", "int8 moments"])
def test_fsdp2_dtensors_capturable_step_allocates_nothing_and_repeats(kw):
    """FusedAdamW over FSDP2's DTensors at 2 ranks: the list launch, and clipping by the
    norm over each parameter's mesh in kept buffers."""
    for rank, (same, problems) in enumerate(run_ranks(_rank_fsdp2, 2, kw, timeout=RANK_TIMEOUT_S)):
        assert not problems, f"rank {rank}: " + "; ".join(problems)
        assert same, f"rank {rank}: capturable=True changed the parameters"


def _rank_rows(rank, world, dtype, kw, scaler):
    """Tensor parallel at 2 ranks: a RowwiseParallel weight of 256 columns keeps 128 of
    each row a rank, so its int8 blocks are cut and it is stepped through its rows
    (``RowsLaunch``: scales agreed by a MAX all-reduce, rounding keyed element by
    element); the ColwiseParallel weight's rows are whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for capturable in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 16))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model = model.to(dtype)
        opt = zero_triton.FusedAdamW(model.parameters(), lr=torch.tensor(1e-2), capturable=capturable, **kw)
        assert any(type(side.launch).__name__ == "RowsLaunch"
                   for group in opt._shards.groups for shard in group for side in shard.sides)
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=2) if scaler else None
        recordings = []
        for t in range(STEPS):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * t)).to(dtype)
            loss = model(x).float().pow(2).mean()
            if grad_scaler is None:
                loss.backward()
                recordings.append(record(opt.step) if t >= STEPS - 2 else opt.step())
            else:
                grad_scaler.scale(loss * (float("inf") if t == 1 else 1.0)).backward()  # step 1 skipped
                step, held = opt.step, []
                opt.step = lambda: held.append(record(step) if t >= STEPS - 2 else step())
                grad_scaler.step(opt)
                del opt.step
                recordings.append(held[0] if held else None)
                grad_scaler.update()
            opt.zero_grad(set_to_none=False)
        state = [v.full_tensor() if hasattr(v, "full_tensor") else torch.as_tensor(v)
                 for entry in opt.state_dict()["state"].values() for v in entry.values()]
        out.append(([p.full_tensor() for p in model.parameters()] + state, recordings[-2:]))
    (plain, _), (captured, (first, second)) = out
    same = len(plain) == len(captured) and all(torch.equal(a, b) for a, b in zip(plain, captured))
    return same, _problems(first, second, {"scaler": scaler})


@pytest.mark.parametrize("dtype, kw, scaler", [
    (torch.float32, dict(moments="int8"), True),
    (torch.bfloat16, dict(master_weights="stochastic", moments="int8"), False),
    (torch.bfloat16, dict(master_weights="stochastic", moments="bf16"), False),
], ids=["fp32 int8 moments, GradScaler (one step skipped)", "bf16 stochastic, int8 moments",
        "bf16 stochastic, bf16 moments"])
def test_tensor_parallel_cut_blocks_capturable_step_allocates_nothing_and_repeats(dtype, kw, scaler):
    """(Refused with capturable=True before.) A parameter stepped through its rows under
    capturable=True: its intermediates are kept buffers, its rounding keys come from the
    step count on the device, GradScaler's skip is decided on the device, its scales'
    all-reduce runs on kept tensors: a warmed-up step allocates nothing, reads nothing
    on the host and repeats, and the parameters and state are the bits of the default
    step."""
    for rank, (same, problems) in enumerate(run_ranks(_rank_rows, 2, dtype, kw, scaler,
                                                      timeout=RANK_TIMEOUT_S)):
        assert not problems, f"rank {rank}: " + "; ".join(problems)
        assert same, f"rank {rank}: capturable=True changed the parameters or the state"


@pytest.mark.parametrize("kw, dtype", [(dict(backend="torch"), torch.float32), ({}, torch.float64)],
                         ids=["torch backend", "float64"])
def test_a_step_that_reads_its_scalars_on_the_host_is_refused(kw, dtype):
    """torch's ops (backend='torch', or float64 parameters) read lr and the step count on
    the host: refused with the reason, the parameters untouched."""
    model = _model(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="read lr, the step count"):
        zero_triton.FusedAdamW(model.parameters(), capturable=True, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_codes_and_rounding_in_kept_scratch_are_the_bits_of_fresh_tensors():
    """The rows path's capturable step writes the int8 codes and the stochastic rounding
    (``kernels.quant``, ``kernels.rounding``) into one kept scratch, reused call after
    call, and keys the rounding from the step count on the device: the same bits as
    fresh tensors and the host key, over NaN, infinities, signed zeros, subnormals,
    zero and NaN scales."""
    from zero_triton.kernels import quant, rounding
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * torch.logspace(-40, 38, 3000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.3e38])])
    scale = x.abs() * torch.rand(x.shape, generator=g) * 3
    scale[::7], scale[::11], scale[::13] = 0.0, float("nan"), float("inf")
    kept = {}

    def tmp(slot, dtype):
        return kept.setdefault((slot, dtype), torch.empty(x.shape, dtype=dtype))
    for fmt in (quant.FIRST, quant.SECOND):
        xs = x if fmt.signed else x.abs()
        codes = quant.encode_each(xs, scale, fmt)
        out = torch.empty(x.shape, dtype=fmt.dtype)
        assert torch.equal(quant.encode_each(xs, scale, fmt, out=out, tmp=tmp), codes)
        values = torch.empty(x.shape)
        got = quant.decode_each(codes, scale, fmt, out=values, tmp=tmp)
        assert torch.equal(got.view(torch.int32), quant.decode_each(codes, scale, fmt).view(torch.int32))
    index = torch.randint(0, 2 ** 40, x.shape, generator=g)
    key, t = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for step in (1, 2, 999, 2 ** 24):
        for stream in (rounding.FIRST_STREAM, rounding.PARAM_STREAM):
            host = rounding.key(5, step, stream)
            assert int(rounding.key_at(torch.tensor([float(step)]), 5, stream, key, t)) == host
            bits = rounding.random_bits_at(key, index, out=torch.empty_like(index), tmp=tmp)
            assert torch.equal(bits, rounding.random_bits_at(host, index))
            rounded = rounding.to_bf16_stochastic(x, bits, out=torch.empty(x.shape, dtype=torch.bfloat16), tmp=tmp)
            assert torch.equal(rounded.view(torch.int16), rounding.to_bf16_stochastic(x, bits).view(torch.int16))
