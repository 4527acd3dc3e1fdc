"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel, 2-D and HSDP) on gloo ranks.

FusedAdamW steps each parameter's local shard where the engine keeps it, with state of
its own (``zero_triton.optim.engine_home``): it matches torch.optim.AdamW(fused=True) on
the same DTensors, keeps an fp32 master for bf16 shards, clips by the norm over each
mesh as torch does, and its state dict goes through torch.distributed.checkpoint as
torch's does. ZeroAdam refuses DTensors with the fix (the engine shards them already).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402

pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed.fsdp (FSDP2)")
pytest.importorskip("torch.distributed.tensor.parallel", reason="needs tensor parallel")


def _mlp(dtype=torch.float32, blocks=2):
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8)]
    return torch.nn.Sequential(*layers).to(dtype)


def _fsdp2(mesh, dtype=torch.float32, **kwargs):
    from torch.distributed.fsdp import fully_shard
    model = _mlp(dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _tp(mesh, dtype=torch.float32):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = _mlp(dtype)
    plan = {}
    for i in range(0, len(model), 3):
        plan[str(i)], plan[str(i + 2)] = ColwiseParallel(), RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _train(pairs, steps, seed, clip=None):
    """Step every (model, optimizer) pair on the same batches; returns the norms clipping
    reported, per pair."""
    g = torch.Generator().manual_seed(seed)
    norms = [[] for _ in pairs]
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        for k, (model, opt) in enumerate(pairs):
            dtype = next(model.parameters()).dtype
            model(x.to(dtype)).float().square().mean().backward()
            if clip is not None:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) \
                    if isinstance(opt, torch.optim.AdamW) else opt.clip_grad_norm_(clip)
                norms[k].append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
            opt.step()
            opt.zero_grad()
    return norms


def _max_diff(a, b):
    return max((p.full_tensor().float() - q.full_tensor().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def _locals(model):
    return [(p._local_tensor.data_ptr(), p._local_tensor.untyped_storage().data_ptr())
            for p in model.parameters()]


def _matches_torch(rank, world_size, engine, options):
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    kwargs = {}
    if options.get("mp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "reshard" in options:
        kwargs["reshard_after_forward"] = options["reshard"]
    build = (lambda: _fsdp2(mesh, **kwargs)) if engine == "fsdp2" else (lambda: _tp(mesh))
    ours, ref = build(), build()
    before = _locals(ours)
    cls = zero_triton.FusedAdamW if options.get("adamw", True) else zero_triton.FusedAdam
    hyper = dict(lr=1e-2, weight_decay=0.1, amsgrad=options.get("amsgrad", False))
    launches = []
    if options.get("backend") == "triton":  # count the kernel's launches
        from zero_triton.kernels import adam as kadam
        for name in ("adam_step", "adam_step_list"):
            def counted(*args, _launch=getattr(kadam, name), _name=name, **kwargs):
                launches.append(_name)
                return _launch(*args, **kwargs)
            setattr(kadam, name, counted)
    opt = cls(ours.parameters(), backend=options.get("backend", "auto"), **hyper)
    assert _locals(ours) == before, "the engine's parameters were moved"
    torch_cls = torch.optim.AdamW if options.get("adamw", True) else torch.optim.Adam
    norms = _train([(ours, opt), (ref, torch_cls(ref.parameters(), fused=True, **hyper))], 4,
                   seed=1, clip=options.get("clip"))
    assert _locals(ours) == before, "the step moved the engine's parameters"
    kinds = {}
    for p in ours.parameters():  # DTensors with the parameter's placements, as torch's
        for k, v in opt.state[p].items():
            same = k == "step" or (tuple(v.placements) == tuple(p.placements) and v.shape == p.shape)
            kinds[k] = (type(v).__name__, kinds.get(k, (None, True))[1] and same)
    return _max_diff(ours, ref), norms, kinds, launches


@pytest.mark.parametrize("engine,options", [
    ("fsdp2", {"backend": "triton", "amsgrad": True}),
    ("fsdp2", {"backend": "torch", "amsgrad": True}),
    ("fsdp2", {"reshard": True}),
    ("fsdp2", {"reshard": False, "amsgrad": True, "adamw": False}),
    ("fsdp2", {"mp": True, "clip": 0.05}),
    ("tp", {"clip": 0.05}),
])
def test_fused_adamw_on_dtensors_matches_torch_adamw(engine, options):
    """FSDP2 per block and root (resharding after forward or not, under a bf16
    MixedPrecisionPolicy) and tensor parallel (Colwise/Rowwise): the same parameters as
    torch.optim.AdamW(fused=True) on the same DTensors to fp32 rounding, the same clipped
    norms, state as DTensors with the parameters' placements, and the engine's storage
    never moved. The Triton kernel steps every local shard of the group in one launch."""
    for diff, norms, kinds, launches in run_ranks(_matches_torch, 2, engine, options, timeout=600):
        assert diff < 1e-6, diff
        if options.get("backend") == "triton":
            assert launches == ["adam_step_list"] * 4, launches  # one per step
        if "clip" in options:
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), norms
        assert kinds["exp_avg"][0] == "DTensor" and kinds["exp_avg_sq"][0] == "DTensor", kinds
        assert kinds["exp_avg"][1] and kinds["exp_avg_sq"][1], kinds
        assert kinds["step"][0] == "Tensor"


def _bf16_master(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    ours, ref = _fsdp2(mesh, torch.bfloat16), _fsdp2(mesh, torch.bfloat16)
    hyper = dict(lr=1e-3, weight_decay=0.1)
    opt = zero_triton.FusedAdamW(ours.parameters(), **hyper)
    # torch's way to a master: fp32 DTensor copies stepped by its fused AdamW, the bf16
    # gradients cast up before and the parameters copied down after.
    params = list(ref.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    torch_opt = torch.optim.AdamW(masters, fused=True, **hyper)
    g = torch.Generator().manual_seed(3)
    worst_master, worst_param = 0.0, 0.0
    for _ in range(5):
        x = torch.randn(4, 8, generator=g).bfloat16()
        for model in (ours, ref):
            model(x).float().square().mean().backward()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
            torch_opt.step()
            for m, p in zip(masters, params):
                p.copy_(m)
        opt.zero_grad()
        ref.zero_grad()
        for p, m in zip(ours.parameters(), masters):
            mine = opt.state[p]["master_param"]
            assert mine.dtype == torch.float32 and tuple(mine.placements) == tuple(p.placements)
            assert mine._local_tensor.numel() == p._local_tensor.numel()  # a shard, not a full copy
            worst_master = max(worst_master, (mine.full_tensor() - m.full_tensor()).abs().max().item())
        worst_param = max(worst_param, _max_diff(ours, ref))
    return worst_master, worst_param


def test_bf16_sharded_parameters_keep_an_fp32_master():
    """A model cast to bf16 before fully_shard: FusedAdamW keeps an fp32 master per local
    shard, and steps as torch's composite does (fp32 master DTensors stepped by
    AdamW(fused=True), copied down to bf16) to fp32 rounding of the master."""
    for worst_master, worst_param in run_ranks(_bf16_master, 2, timeout=600):
        assert worst_master < 1e-6, worst_master
        assert worst_param <= 2 ** -8, worst_param  # at most a bf16 rounding apart


def _scaled(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in ("ours", "torch"):
        model = _fsdp2(mesh)
        opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2) if name == "ours" else \
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        g = torch.Generator().manual_seed(1)
        for i in range(3):
            scaler.scale(model(torch.randn(4, 8, generator=g)).square().mean()).backward()
            if i == 1 and rank == 0:  # an inf on one rank: the step is skipped
                next(model.parameters()).grad._local_tensor[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out[name] = (model, scaler.get_scale())
    return _max_diff(out["ours"][0], out["torch"][0]), out["ours"][1], out["torch"][1]


def test_grad_scaler_on_fsdp2_matches_torch():
    """torch.amp.GradScaler over FSDP2 (an inf on one rank's shard skips the step):
    FusedAdamW ends where torch's fused AdamW ends, with the same scale."""
    for diff, ours, theirs in run_ranks(_scaled, 2, timeout=300):
        assert diff < 1e-6 and ours == theirs == 2.0 ** 9, (diff, ours, theirs)


def _edited(rank, world_size):
    """opt.state of DTensor parameters edited by hand, the same way on both optimizers."""
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    ours, ref = _fsdp2(mesh), _fsdp2(mesh)
    opt = zero_triton.FusedAdamW(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    pairs = [(ours, opt), (ref, torch_opt)]
    _train(pairs, 2, seed=1)
    for model, o in pairs:
        first, second, third = list(model.parameters())[:3]
        with torch.no_grad():
            o.state[first]["exp_avg"].mul_(0.5)  # in place, through the DTensor
        o.state[second]["exp_avg_sq"] = o.state[second]["exp_avg_sq"] * 2  # a new DTensor
        del o.state[third]  # this parameter starts over
    _train(pairs, 2, seed=2)
    return _max_diff(ours, ref)


def _copied(rank, world_size):
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp2(mesh, torch.bfloat16)
    opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2)
    _train([(model, opt)], 2, seed=1)
    twin = copy.deepcopy(opt)
    want = {k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in e.items()}
            for k, e in opt.state_dict()["state"].items()}
    _train([(model, opt)], 1, seed=2)  # the original moves on; the copy keeps its own state
    got = twin.state_dict()["state"]
    same = all(torch.equal(got[k][n].full_tensor() if hasattr(got[k][n], "full_tensor") else got[k][n], v)
               for k, e in want.items() for n, v in e.items())
    kinds = {type(p).__name__ for p in twin.param_groups[0]["params"]}
    return same, kinds


def test_a_deep_copy_of_fused_adamw_over_dtensors_keeps_its_own_state():
    """copy.deepcopy (torch's optimizer tests do it) of a FusedAdamW over bf16 FSDP2
    parameters: the copy's parameters are DTensors, its state (master included) is the
    original's at the copy, and stays so when the original steps."""
    for same, kinds in run_ranks(_copied, 2, timeout=300):
        assert same and kinds == {"DTensor"}, (same, kinds)


def test_opt_state_edits_of_dtensor_parameters_are_followed_as_torch_follows_them():
    """An in-place change through opt.state's DTensor, a new DTensor assigned, an entry
    deleted: the next steps go as torch's fused AdamW's go after the same edits."""
    for diff in run_ranks(_edited, 2, timeout=300):
        assert diff < 1e-6, diff


def _accelerate_fsdp2(rank, world_size, which, stepped):
    """accelerate's FSDP2 prepare, as Accelerator._prepare_fsdp2 runs it on GPUs (on CPU
    accelerate applies no FSDP): the optimizer is built over the plain model, each of its
    parameters is swapped for a placeholder, the model is fully_shard-ed, and accelerate's
    own fsdp2_switch_optimizer_parameters puts the DTensors in param_groups."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    model = _mlp()
    if which == "zero":
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2)
    else:
        opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2) if which == "ours" else \
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if stepped:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    old = dict(model.named_parameters())
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype)
            group["params"][i].data_ptr = p.data_ptr()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(opt, {old[n].data_ptr(): new[n] for n in old})
    try:
        _train([(model, opt)], 3, seed=1)
    except RuntimeError as exc:
        return str(exc)
    return [p.full_tensor().detach().tolist() for p in model.parameters()]


def test_accelerate_fsdp2_prepare_swaps_the_parameters_and_fused_adamw_follows():
    """accelerate replaces each parameter in param_groups by its DTensor after the
    optimizer was built. FusedAdamW rebuilds the group over the DTensors (it has not
    stepped yet) and trains them as torch's fused AdamW does; before, it kept stepping
    the plain parameters it was given, which had no gradients: the model never trained,
    silently. After a step the swap is refused with the fix, nothing changed."""
    pytest.importorskip("accelerate.utils.fsdp_utils", reason="needs accelerate")
    ours = run_ranks(_accelerate_fsdp2, 2, "ours", False, timeout=300)
    theirs = run_ranks(_accelerate_fsdp2, 2, "torch", False, timeout=300)
    for a, b in zip(ours[0], theirs[0]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
    assert any(torch.tensor(a).ne(torch.tensor(b0)).any()
               for a, b0 in zip(ours[0], [p.detach().tolist() for p in _mlp().parameters()]))
    for message in run_ranks(_accelerate_fsdp2, 2, "ours", True, timeout=300):
        assert "were replaced in param_groups after the optimizer stepped" in message, message
    for message in run_ranks(_accelerate_fsdp2, 2, "zero", False, timeout=300):
        assert "with FSDP2 or DeepSpeed use zero_triton.FusedAdamW" in message, message


def _two_d(rank, world_size, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zero_triton
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if layout == "hsdp":  # FSDP2's replicate all-reduce averages with ReduceOp.AVG
        try:
            torch.distributed.all_reduce(torch.ones(1), op=torch.distributed.ReduceOp.AVG)
        except (RuntimeError, ValueError) as exc:
            return f"this torch's gloo has no ReduceOp.AVG, which FSDP2's HSDP uses ({exc})"

    def build():
        if layout == "fsdp2+tp":  # torchtitan's 2-D: tensor parallel inside, FSDP2 across
            model = _tp(mesh["tp"])
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh["dp"])
            return fully_shard(model, mesh=mesh["dp"])
        model = _mlp()  # HSDP: replicate over dp, shard over tp
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    ours, ref = build(), build()
    hyper = dict(lr=1e-2, weight_decay=0.1)
    opt = zero_triton.FusedAdamW(ours.parameters(), **hyper)
    norms = _train([(ours, opt), (ref, torch.optim.AdamW(ref.parameters(), fused=True, **hyper))],
                   3, seed=rank // 2, clip=0.05)  # the same batch within each dp replica
    placements = {str(tuple(p.placements)) for p in ours.parameters()}
    return _max_diff(ours, ref), norms, placements


@pytest.mark.parametrize("layout", ["fsdp2+tp", "hsdp"])
def test_two_dimensional_meshes_match_torch_adamw(layout):
    """A 2x2 mesh on 4 gloo ranks: FSDP2 over tensor parallel (torchtitan's 2-D) and HSDP
    (replicate x shard). Parameters and clipped norms as torch's fused AdamW gives them."""
    results = run_ranks(_two_d, 4, layout, timeout=900)
    if isinstance(results[0], str):
        pytest.skip(results[0])
    for diff, norms, placements in results:
        assert diff < 1e-6, diff
        assert norms[0] == pytest.approx(norms[1], rel=1e-5), norms
        assert any("," in p for p in placements), placements  # 2-D placements


def _through_dcp(rank, world_size, path, dtype):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    hyper = dict(lr=1e-2, weight_decay=0.1)
    model = _fsdp2(mesh, dtype)
    opt = zero_triton.FusedAdamW(model.parameters(), **hyper)
    _train([(model, opt)], 3, seed=1)
    saved = get_optimizer_state_dict(model, opt)
    entry = next(iter(saved["state"].values()))
    kinds = {k: type(v).__name__ for k, v in entry.items()}
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=path)

    def resumed(cls):
        new = _fsdp2(mesh, dtype)
        new_opt = cls(new.parameters(), **hyper) if cls is zero_triton.FusedAdamW else \
            cls(new.parameters(), fused=True, **hyper)
        _train([(new, new_opt)], 1, seed=99)  # state of its own first, then overwritten
        sd = {"model": get_model_state_dict(new), "optim": get_optimizer_state_dict(new, new_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(new, sd["model"])
        set_optimizer_state_dict(new, new_opt, sd["optim"])
        return new, new_opt

    ours, ours_opt = resumed(zero_triton.FusedAdamW)
    _train([(model, opt), (ours, ours_opt)], 3, seed=2)
    bitwise = all(torch.equal(p.full_tensor(), q.full_tensor())
                  for p, q in zip(model.parameters(), ours.parameters()))
    torch_diff = None
    if dtype == torch.float32:  # torch's AdamW resumes from our checkpoint as from its own
        theirs, theirs_opt = resumed(torch.optim.AdamW)
        _train([(theirs, theirs_opt)], 3, seed=2)
        torch_diff = _max_diff(model, theirs)
    return kinds, bitwise, torch_diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_through_distributed_checkpoint(tmp_path, dtype):
    """get_optimizer_state_dict holds DTensors; dcp.save, then dcp.load +
    set_optimizer_state_dict into a new FSDP2 model's FusedAdamW (which had stepped on
    its own) resumes bitwise, and torch's AdamW resumes from the same checkpoint to fp32
    rounding."""
    for kinds, bitwise, torch_diff in run_ranks(_through_dcp, 2, str(tmp_path / "ckpt"), dtype,
                                                timeout=600):
        assert kinds["exp_avg"] == "DTensor", kinds
        assert ("master_param" in kinds) == (dtype == torch.bfloat16), kinds
        assert bitwise
        if torch_diff is not None:
            assert torch_diff < 1e-6, torch_diff


def _titan(rank, world_size, path, stop_at, resume_from):
    """torchtitan's loop in small: FSDP2 per block, clip, warmup scheduler, a DCP
    checkpoint every 2 steps through Stateful wrappers; ``stop_at``: the step after
    which this run ends (a kill), ``resume_from``: the checkpoint it starts from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp2(mesh)
    opt = zero_triton.FusedAdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

    class App(Stateful):
        def state_dict(self):
            return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                    "sched": sched.state_dict()}

        def load_state_dict(self, sd):
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
            sched.load_state_dict(sd["sched"])

    start = 0
    if resume_from is not None:
        state = {"app": App()}
        dcp.load(state, checkpoint_id=f"{path}/step{resume_from}")
        start = resume_from
    g = torch.Generator().manual_seed(5)
    for step in range(1, stop_at + 1):
        x = torch.randn(4, 8, generator=g)  # the same data stream for every run
        if step <= start:
            continue
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 2 == 0:
            dcp.save({"app": App()}, checkpoint_id=f"{path}/step{step}")
    return [p.full_tensor().detach().tolist() for p in model.parameters()]


def test_a_torchtitan_shaped_loop_resumes_where_it_left_off(tmp_path):
    """Killed after step 5 (its last checkpoint at step 4), resumed from it in new
    processes, the run ends at step 8 where the uninterrupted run ends, bitwise."""
    whole = run_ranks(_titan, 2, str(tmp_path / "a"), 8, None, timeout=600)
    run_ranks(_titan, 2, str(tmp_path / "b"), 5, None, timeout=600)
    resumed = run_ranks(_titan, 2, str(tmp_path / "b"), 8, 4, timeout=600)
    for a, b in zip(whole[0], resumed[0]):
        assert a == b


def _refused(rank, world_size, engine):
    from torch.distributed.device_mesh import init_device_mesh

    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp2(mesh) if engine == "fsdp2" else _tp(mesh)
    before = [(p._local_tensor.data_ptr(), p._local_tensor.clone()) for p in model.parameters()]
    clip = torch.nn.utils.clip_grad_norm_
    try:
        zero_triton.ZeroAdamW(model.parameters(), lr=1e-2)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError("ZeroAdamW took DTensor parameters")
    after = [(p._local_tensor.data_ptr(), p._local_tensor) for p in model.parameters()]
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(before, after)), \
        "the engine's parameters were moved or changed"
    assert torch.nn.utils.clip_grad_norm_ is clip and not getattr(
        clip, "_zero_triton_routes", False), "a patch was applied by a refused optimizer"
    # zero_triton.checkpoint sends FusedAdamW over DTensors to DCP
    opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2)
    import zero_triton.checkpoint
    try:
        zero_triton.checkpoint.save(f"/nonexistent-{rank}", opt)
    except TypeError as exc:
        checkpoint_message = str(exc)
    else:
        raise AssertionError("zero_triton.checkpoint saved a DTensor optimizer")
    return message, checkpoint_message


@pytest.mark.parametrize("engine", ["fsdp2", "tp"])
def test_zero_adam_refuses_dtensors_with_the_fix(engine):
    """ZeroAdam would shard what the engine shards already: refused before anything is
    built or communicated, pointing to FusedAdamW; zero_triton.checkpoint points to DCP."""
    for message, checkpoint_message in run_ranks(_refused, 2, engine, timeout=300):
        assert "parameter 0 of param group 0 is a DTensor" in message, message
        assert "would shard it again" in message and "zero_triton.FusedAdamW" in message, message
        assert "torch.distributed.checkpoint" in checkpoint_message, checkpoint_message


_CUDA_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import zero_triton
from zero_triton.kernels import adam as kadam
mesh = init_device_mesh("cuda", (1,))
launches = []
listed = kadam.adam_step_list
kadam.adam_step_list = lambda *a, **k: (launches.append(1), listed(*a, **k))[1]
worst = {}
for dtype in (torch.float32, torch.bfloat16):
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to("cuda", dtype)
        for layer in m:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)
    ours, ref = build(), build()
    opt = zero_triton.FusedAdamW(ours.parameters(), lr=1e-3)  # auto: Triton on CUDA
    params = list(ref.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    torch_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
    for step in range(5):
        x = torch.randn(8, 256, device="cuda", dtype=dtype)
        for m in (ours, ref):
            m(x).float().square().mean().backward()
        opt.step(); opt.zero_grad()
        with torch.no_grad():
            for m_, p in zip(masters, params):
                m_.grad = p.grad.float()
            torch_opt.step()
            for m_, p in zip(masters, params):
                p.copy_(m_)
        ref.zero_grad()
    worst[str(dtype)] = max((p.full_tensor().float() - q.full_tensor().float()).abs().max().item()
                            for p, q in zip(ours.parameters(), ref.parameters()))
print("RESULT", worst, len(launches), opt.backend)
assert opt.backend == "triton", opt.backend
assert len(launches) == 10, launches
assert worst["torch.float32"] < 1e-5 and worst["torch.bfloat16"] <= 2 ** -7, worst
dist.destroy_process_group()
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fsdp2_on_cuda_steps_with_one_compiled_launch_per_group(tmp_path):
    """On a GPU (NCCL at world size 1): FSDP2 + FusedAdamW with the compiled Triton list
    kernel, one launch per step for the group, matches torch's fused AdamW on fp32 masters
    (fp32 and bf16 parameters)."""
    import subprocess

    from dist_utils import free_port
    script = tmp_path / "fsdp2_cuda.py"
    script.write_text(_CUDA_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(script), str(free_port())], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "RESULT" in run.stdout
