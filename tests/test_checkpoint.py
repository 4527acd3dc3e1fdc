"""Sharded checkpoints: resume exactly, reshard to any world size, survive faults.

Spawning gloo ranks costs seconds on a small CPU box, so the distributed checks are
grouped: one 8-rank run covers saving at 4 and loading at 2, 3, 4 and 8 (subgroups);
one 2-rank run covers bad input under a group; two cover killed ranks; one the soak.
"""
import errno
import io
import json
import os
import random
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402

from zero_triton import FusedAdam, ZeroAdam, checkpoint  # noqa: E402
from zero_triton.checkpoint import CheckpointError  # noqa: E402
from zero_triton.tools.checkpoint import main as checkpoint_main  # noqa: E402

N_STEPS, M_STEPS = 3, 4


class Net(torch.nn.Module):
    """Awkward sizes (91 and 65 elements), an fp32 and a bf16 layer, a frozen
    parameter and a buffer."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(7, 13)
        self.b = torch.nn.Linear(13, 5).to(torch.bfloat16)
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("scale", torch.randn(2))


def groups(net, **second):
    return [{"params": list(net.a.parameters())},
            {"params": list(net.b.parameters()) + [net.frozen], "amsgrad": True,
             "weight_decay": 0.01, **second}]


def make(cls=FusedAdam, seed=0, pg=None, **second):
    net = Net(seed)
    kw = {"process_group": pg} if cls is ZeroAdam else {}
    return net, cls(groups(net, **second), lr=1e-2, backend="torch", **kw)


def synthetic_steps(opt, start, count):
    """Gradients that depend on the step only (the same on every rank and world size)."""
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(1000 + step)
        opt.zero_grad()
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def full_state(opt):
    sd = opt.consolidated_state_dict() if isinstance(opt, ZeroAdam) else opt.state_dict()
    if sd is None:
        return None
    return {i: {k: v.detach().clone().cpu() for k, v in s.items()} for i, s in sd["state"].items()}


def params_of(net):
    return {n: t.detach().clone() for n, t in net.state_dict().items()}


def portable(obj):
    """Tensors as numpy arrays (bf16 widened exactly to fp32): torch tensors sent back
    from a spawned rank travel as shared-memory handles that die with the process."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def assert_state_equal(got, want, what, atol=0.0, rtol=0.0):
    assert got.keys() == want.keys(), f"{what}: parameters {sorted(got)} vs {sorted(want)}"
    for i in want:
        ga, wa = got[i], want[i]
        if isinstance(wa, dict):
            assert ga.keys() == wa.keys(), f"{what}: param {i} keys {sorted(ga)} vs {sorted(wa)}"
            pairs = [(f"param {i} {k}", ga[k], wa[k]) for k in wa]
        else:
            pairs = [(f"{i}", ga, wa)]
        for label, g, w in pairs:
            g, w = torch.as_tensor(g).float(), torch.as_tensor(w).float()
            if atol == 0 and rtol == 0:
                bad = (g != w).nonzero()
            else:
                bad = (~torch.isclose(g, w, atol=atol, rtol=rtol)).nonzero()
            if len(bad):
                at = tuple(bad[0].tolist())
                raise AssertionError(f"{what}: {label} differs at {at}: {g[at].item()} vs "
                                     f"{w[at].item()} (max |diff| {(g - w).abs().max().item():.3g})")


# -- one process ------------------------------------------------------------------------------
@pytest.mark.parametrize("save_at", [0, N_STEPS])
def test_resume_is_bitwise(tmp_path, save_at):
    net, opt = make()
    synthetic_steps(opt, 0, N_STEPS + M_STEPS)
    want_state, want_params = full_state(opt), params_of(net)

    net, opt = make()
    synthetic_steps(opt, 0, save_at)
    checkpoint.save(tmp_path / "ck", opt, net, extra={"epoch": 7, "rng": torch.arange(3)})
    net2, opt2 = make(seed=1)  # other initial weights: the checkpoint must overwrite them
    extra = checkpoint.load(tmp_path / "ck", opt2, net2)
    assert extra["epoch"] == 7 and torch.equal(extra["rng"], torch.arange(3))
    assert_state_equal(params_of(net2), params_of(net), "right after load")
    synthetic_steps(opt2, save_at, N_STEPS + M_STEPS - save_at)
    if save_at:
        assert_state_equal(full_state(opt2), want_state, f"state after {save_at}+{M_STEPS} steps")
    assert_state_equal(params_of(net2), want_params if save_at else params_of(net2), "params")
    # optimizer.state exposes the loaded moments as torch.optim.Adam does
    assert torch.equal(opt2.state[net2.b.weight]["max_exp_avg_sq"],
                       full_state(opt2)[2]["max_exp_avg_sq"])


def test_manifest_and_files(tmp_path):
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    checkpoint.save(tmp_path / "ck", opt, net)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["manifest.json", "model.bin", "model_extra.pt", "rank00000.bin"], names
    assert os.listdir(tmp_path) == ["ck"], "temporary directories left behind"
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert m["world_size"] == 1 and m["step"] == 2.0
    assert [p["name"] for p in m["params"]] == ["a.weight", "a.bias", "b.weight", "b.bias", "frozen"]
    assert m["params"][4]["flat"] is None and m["params"][3]["offset"] == 80
    # fp32 state of 91 + 13 and 65 + 5 elements (tail padding is not written), 3 and 4 states
    shard = m["files"]["rank00000.bin"]
    assert shard["bytes"] == 64 + 4 * (3 * (96 + 13) + 4 * (80 + 5))  # 64: the header
    head = (tmp_path / "ck" / "rank00000.bin").read_bytes()[:64]
    assert head == f"zero_triton checkpoint {m['save_id']} rank00000.bin\n".encode().ljust(64, b"\0")
    assert m["param_groups"][1]["amsgrad"] is True and m["param_groups"][1]["weight_decay"] == 0.01


def test_consolidate_and_inspect_cli(tmp_path, capsys):
    net, opt = make()
    synthetic_steps(opt, 0, 3)
    checkpoint.save(tmp_path / "ck", opt, net)
    assert checkpoint_main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "world size   1" in out and "step         3" in out and "all checksums ok" in out
    assert "b.weight" in out and "rank00000.bin" in out
    out_pt = tmp_path / "full.pt"
    assert checkpoint_main(["consolidate", str(tmp_path / "ck"), str(out_pt)]) == 0
    sd = torch.load(out_pt, weights_only=True)
    model_sd = torch.load(tmp_path / "full.model.pt", weights_only=True)
    assert_state_equal({i: s for i, s in sd["state"].items()}, full_state(opt), "consolidated")
    assert_state_equal(model_sd, params_of(net), "consolidated model")
    # torch.optim.Adam reads it (and steps from it)
    ref = Net()
    ref.b.float()
    ref.load_state_dict({k: v.float() for k, v in model_sd.items()})
    adam = torch.optim.Adam(groups(ref), lr=1e-2)
    adam.load_state_dict(sd)
    assert adam.state[ref.a.weight]["step"].item() == 3
    # and a FusedAdam loads it back exactly
    net2, opt2 = make(seed=3)
    net2.load_state_dict(model_sd)
    opt2.load_state_dict(sd)
    assert_state_equal(full_state(opt2), full_state(opt), "FusedAdam from consolidated file")


def read_blob(path):
    """A .pt file of a checkpoint: torch.save bytes after the 64-byte header."""
    return torch.load(io.BytesIO(path.read_bytes()[64:]), weights_only=True)


def reseal(ck, manifest):
    """Write ``manifest`` with a valid checksum: what validation must catch on its own."""
    manifest = {k: v for k, v in manifest.items() if k != "checksum"}
    (ck / "manifest.json").write_bytes(checkpoint.manifest.seal(manifest))


def _snapshot(net, opt):
    return params_of(net), full_state(opt), [dict((k, v) for k, v in g.items() if k != "params")
                                               for g in opt.param_groups]


def _assert_untouched(net, opt, before, what):
    params, state, hyper = _snapshot(net, opt)
    assert_state_equal(params, before[0], f"{what}: params changed")
    assert_state_equal(state, before[1], f"{what}: state changed")
    assert hyper == before[2], f"{what}: hyperparameters changed"


def test_bad_checkpoints_change_nothing(tmp_path):
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    ck = tmp_path / "ck"
    checkpoint.save(ck, opt, net)
    target_net, target = make(seed=5)
    synthetic_steps(target, 0, 1)
    before = _snapshot(target_net, target)
    shard = ck / "rank00000.bin"
    good = shard.read_bytes()

    shard.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(CheckpointError, match="checksum mismatch in checkpoint file rank00000.bin"):
        checkpoint.load(ck, target, target_net)
    _assert_untouched(target_net, target, before, "corrupted shard")
    assert checkpoint_main(["inspect", str(ck)]) == 1

    shard.write_bytes(good[:-8])
    with pytest.raises(CheckpointError, match="rank00000.bin .* is truncated"):
        checkpoint.load(ck, target, target_net)
    _assert_untouched(target_net, target, before, "truncated shard")

    shard.unlink()
    with pytest.raises(CheckpointError, match=r"rank00000.bin \(written by rank 0\) is missing"):
        checkpoint.load(ck, target, target_net)
    _assert_untouched(target_net, target, before, "missing rank file")
    shard.write_bytes(good)
    checkpoint.load(ck, target, target_net)  # intact again: loads

    other = torch.nn.Module()
    other.a = torch.nn.Linear(7, 13)
    other.b = torch.nn.Linear(13, 6).to(torch.bfloat16)
    other.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    other_opt = FusedAdam(groups(other), backend="torch")
    with pytest.raises(ValueError, match=r"different model: parameter 2 is 'b.weight' \[5, 13\]"):
        checkpoint.load(ck, other_opt, other)

    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "nowhere", target, target_net)
    (tmp_path / "notack").mkdir()
    (tmp_path / "notack" / "precious.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint.save(tmp_path / "notack", opt, net)
    assert (tmp_path / "notack" / "precious.txt").exists()


def test_other_hyperparameters_warn_once_and_checkpoint_wins(tmp_path):
    net, opt = make()
    synthetic_steps(opt, 0, 1)
    checkpoint.save(tmp_path / "ck", opt, net)
    net2, opt2 = make(lr=3e-4, weight_decay=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(tmp_path / "ck", opt2, net2)
    msgs = [str(w.message) for w in caught if "hyperparameters" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "group 1 lr: 0.01" in msgs[0] and "weight_decay: 0.01" in msgs[0]
    assert opt2.param_groups[1]["lr"] == 1e-2 and opt2.param_groups[1]["weight_decay"] == 0.01


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    ck = tmp_path / "ck"
    checkpoint.save(ck, opt, net)
    saved = full_state(opt)
    synthetic_steps(opt, 2, 2)
    real, calls = checkpoint.files._write_bytes, []

    def full_disk(f, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, data)

    monkeypatch.setattr(checkpoint.files, "_write_bytes", full_disk)
    with pytest.raises(CheckpointError, match="failed on rank 0 while writing its files: OSError: .*No space left.*untouched"):
        checkpoint.save(ck, opt, net)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ck"], "the failed save left files behind"
    net2, opt2 = make(seed=4)
    checkpoint.load(ck, opt2, net2)
    assert_state_equal(full_state(opt2), saved, "previous checkpoint after a failed save")


def test_load_falls_back_between_the_two_renames(tmp_path):
    """A kill after PATH was renamed to PATH.old-<its save id> and before the new one
    took its place: load falls back to it; the next save removes both leftovers."""
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    checkpoint.save(tmp_path / "ck", opt, net)
    save_id = json.loads((tmp_path / "ck" / "manifest.json").read_text())["save_id"]
    os.rename(tmp_path / "ck", tmp_path / f"ck.old-{save_id}")
    new = tmp_path / "ck.tmp-0123456789abcdef"  # the new one, complete but for its manifest
    new.mkdir()
    (new / ".zero_triton-save").write_text("0123456789abcdef")
    (new / "rank00000.bin").write_bytes(b"x" * 100)
    net2, opt2 = make(seed=4)
    checkpoint.load(tmp_path / "ck", opt2, net2)
    assert_state_equal(full_state(opt2), full_state(opt), "loaded from the .old directory")
    checkpoint.save(tmp_path / "ck", opt2, net2)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_consolidate_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    net, opt = make()
    synthetic_steps(opt, 0, 1)
    ck = tmp_path / "ck"
    checkpoint.save(ck, opt, net)

    def fails(argv, message):
        assert checkpoint_main([str(a) for a in argv]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err

    out = tmp_path / "new" / "dirs" / "adam.pt"  # missing parent directories are created
    assert checkpoint_main(["consolidate", str(ck), str(out)]) == 0
    assert out.exists() and (tmp_path / "new" / "dirs" / "adam.model.pt").exists()
    capsys.readouterr()
    fails(["consolidate", ck, tmp_path], "is a directory; pass a file path")
    (tmp_path / "plain").write_text("x")
    fails(["consolidate", ck, tmp_path / "plain" / "sub" / "adam.pt"], "plain is not a directory")
    fails(["consolidate", tmp_path / "nowhere", tmp_path / "out" / "b.pt"], "no checkpoint at")
    assert not (tmp_path / "out").exists(), "a failed consolidate created the output directory"
    fails(["inspect", tmp_path / "nowhere"], "no checkpoint at")
    fails(["inspect", ck / "manifest.json"], "is a file; pass the checkpoint directory")

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", disk_full)
    fails(["consolidate", ck, tmp_path / "full.pt"], "cannot write")
    monkeypatch.undo()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("full")], "a half-written file"

    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["params"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    fails(["inspect", ck], "checksum mismatch in")
    reseal(ck, manifest)  # as if the checksum had been recomputed: the structure is checked
    fails(["inspect", ck], "field params is missing")


def _compiled(net):
    return torch.compile(net)  # an OptimizedModule (names _orig_mod.*); compiles when called


def _checkpointed(net):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    net.a = checkpoint_wrapper(net.a)  # names a._checkpoint_wrapped_module.*
    return net


def _compiled_checkpointed(net):
    return _compiled(_checkpointed(net))


def _ddp_both_ways(rank, world_size, path):
    """Save through DDP (names module.*), and load the bare model's checkpoint into DDP."""
    from torch.nn.parallel import DistributedDataParallel
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    checkpoint.save(os.path.join(path, "ddp"), opt, DistributedDataParallel(net))
    net2, opt2 = make(seed=1)
    checkpoint.load(os.path.join(path, "bare"), opt2, DistributedDataParallel(net2))
    return portable({"params": params_of(net2), "state": full_state(opt2)})


# importing torch.compile warns about torch.jit internals
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning")
def test_wrapped_and_bare_models_load_each_other(tmp_path):
    net, opt = make()
    synthetic_steps(opt, 0, 2)
    want_params, want_state = params_of(net), full_state(opt)
    checkpoint.save(tmp_path / "bare", opt, net)

    def loads_into_bare(ck, what):
        m = json.loads((ck / "manifest.json").read_text())
        assert [p["name"] for p in m["params"]] == ["a.weight", "a.bias", "b.weight", "b.bias",
                                                   "frozen"], what
        extra = read_blob(ck / "model_extra.pt")
        assert sorted(extra) == ["frozen", "scale"], f"{what}: {sorted(extra)}"
        net2, opt2 = make(seed=1)
        checkpoint.load(ck, opt2, net2)
        assert_state_equal(params_of(net2), want_params, f"{what} -> bare: params")
        assert_state_equal(full_state(opt2), want_state, f"{what} -> bare: state")

    for wrap in (_compiled, _checkpointed, _compiled_checkpointed):
        what = wrap.__name__.strip("_")
        net_w, opt_w = make()
        synthetic_steps(opt_w, 0, 2)
        checkpoint.save(tmp_path / what, opt_w, wrap(net_w))
        loads_into_bare(tmp_path / what, what)
        net3, opt3 = make(seed=2)
        checkpoint.load(tmp_path / "bare", opt3, wrap(net3))
        assert_state_equal(params_of(net3), want_params, f"bare -> {what}: params")
        assert_state_equal(full_state(opt3), want_state, f"bare -> {what}: state")

    # names as a wrapped model's were recorded before they were stripped at save
    m = json.loads((tmp_path / "bare" / "manifest.json").read_text())
    for p in m["params"]:
        p["name"] = "module._orig_mod." + p["name"]
    reseal(tmp_path / "bare", m)
    net4, opt4 = make(seed=4)
    checkpoint.load(tmp_path / "bare", opt4, net4)
    assert_state_equal(params_of(net4), want_params, "prefixed names -> bare")

    (got,) = run_ranks(_ddp_both_ways, 1, str(tmp_path))
    loads_into_bare(tmp_path / "ddp", "DDP")
    assert_state_equal(got["params"], portable(want_params), "bare -> DDP: params")
    assert_state_equal(got["state"], portable(want_state), "bare -> DDP: state")


def test_model_file_holds_only_each_tensors_own_bytes(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.emb = torch.nn.Embedding(1000, 64)
            self.body = torch.nn.Linear(256, 256)
            self.head = torch.nn.Linear(64, 1000, bias=False)
            self.head.weight = self.emb.weight  # tied: a view of the flat buffer once stepped
            self.register_buffer("window", torch.randn(4096)[:8])  # a view of a larger tensor

    net = Tied(0)
    opt = FusedAdam(net.parameters(), lr=1e-2, backend="torch")
    synthetic_steps(opt, 0, 1)
    checkpoint.save(tmp_path / "ck", opt, net)
    saved = read_blob(tmp_path / "ck" / "model_extra.pt")
    assert sorted(saved) == ["head.weight", "window"]
    own = sum(t.numel() * t.element_size() for t in saved.values())
    size = os.path.getsize(tmp_path / "ck" / "model_extra.pt")
    assert own <= size <= own + 4096, f"{size} bytes on disk for {own} bytes of tensors"
    net2 = Tied(1)
    checkpoint.load(tmp_path / "ck", FusedAdam(net2.parameters(), lr=1e-2, backend="torch"), net2)
    assert_state_equal(params_of(net2), params_of(net), "tied model after load")
    owner = torch.randn(3)
    assert checkpoint.target.own_bytes(owner).data_ptr() == owner.data_ptr(), "copied an owner"


# -- several ranks --------------------------------------------------------------------------------
def _reshard_ranks(rank, world_size, path):
    """Save at 4 ranks (subgroup 0-3), load at 2, 3, 4 and 8; every subgroup created by all."""
    subgroups = {n: dist.new_group(list(range(n))) for n in (2, 3, 4)}
    subgroups[8] = None
    results = {}
    if rank < 4:
        net, opt = make(ZeroAdam, pg=subgroups[4])
        synthetic_steps(opt, 0, N_STEPS)
        opt._GATHER_CHUNK = 5  # many rounds of the piecewise gather, chunks straddling params
        results["consolidated_at_save"] = full_state(opt)
        checkpoint.save(path, opt, net, extra={"step": N_STEPS})
        synthetic_steps(opt, N_STEPS, M_STEPS)
        results["uninterrupted"] = full_state(opt)
        results["uninterrupted_params"] = params_of(net)
    dist.barrier()
    for n in (2, 3, 4, 8):
        if rank < n:
            net, opt = make(ZeroAdam, seed=9, pg=subgroups[n])
            assert checkpoint.load(path, opt, net) == {"step": N_STEPS}
            synthetic_steps(opt, N_STEPS, M_STEPS)
            results[f"resumed_at_{n}"] = full_state(opt)
            results[f"resumed_params_at_{n}"] = params_of(net)
        dist.barrier()
    if rank < 2:  # ZeroAdam.load_state_dict from a full torch.optim.Adam-format state
        opt_sd, model_sd = checkpoint.consolidate(path)
        net, opt = make(ZeroAdam, seed=9, pg=subgroups[2])
        net.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        synthetic_steps(opt, N_STEPS, M_STEPS)
        results["load_state_dict_at_2"] = full_state(opt)
        bad = {"state": opt_sd["state"], "param_groups": opt_sd["param_groups"][:1]}
        before = full_state(opt)
        try:
            opt.load_state_dict(bad)
        except ValueError as exc:
            results["bad_load_state_dict"] = str(exc)
        after = full_state(opt)  # collective: every rank calls it
        if rank == 0:
            assert_state_equal(after, before, "rejected load_state_dict")
    return portable(results) if rank == 0 else None


def test_reshard_to_any_world_size(tmp_path):
    path = str(tmp_path / "ck4")
    r = run_ranks(_reshard_ranks, 8, path, timeout=240)[0]
    m = json.loads((tmp_path / "ck4" / "manifest.json").read_text())
    assert m["world_size"] == 4 and sorted(f for f in m["files"] if f.startswith("rank")) == [
        f"rank0000{i}.bin" for i in range(4)]
    # Each rank wrote only its shard: the four shard files add up to one copy.
    assert sum(m["files"][f"rank0000{i}.bin"]["bytes"] for i in range(4)) == \
        4 * 64 + 4 * (3 * 109 + 4 * 85)  # a 64-byte header each

    want, want_params = r["uninterrupted"], r["uninterrupted_params"]
    assert_state_equal(r["resumed_at_4"], want, "save at 4, load at 4")
    assert_state_equal(r["resumed_params_at_4"], want_params, "params, save at 4, load at 4")
    # Other world sizes average identical gradients in another order: rounding in the
    # gradient's dtype (fp32 for a.*, params 0-1; bf16 for b.*, params 2-3, where 3x
    # rounds to 8 bits), (dtype, atol, rtol) as the contract allows.
    for n in (2, 3, 8):
        for ids, atol, rtol in (((0, 1), 1e-6, 1e-5), ((2, 3), 1e-2, 2e-2)):
            assert_state_equal({i: r[f"resumed_at_{n}"][i] for i in ids}, {i: want[i] for i in ids},
                               f"save at 4, load at {n}", atol=atol, rtol=rtol)
    assert_state_equal(r["load_state_dict_at_2"], r["resumed_at_2"], "ZeroAdam.load_state_dict")
    assert "param groups" in r["bad_load_state_dict"]

    # One process reads the 4-rank checkpoint; its consolidation equals the ranks' own.
    opt_sd, _ = checkpoint.consolidate(path)
    assert_state_equal(opt_sd["state"], r["consolidated_at_save"], "consolidate vs consolidated_state_dict")
    net, opt = make(seed=9)
    checkpoint.load(path, opt, net)
    synthetic_steps(opt, N_STEPS, M_STEPS)
    assert_state_equal(full_state(opt), want, "save at 4, load in FusedAdam", atol=1e-6, rtol=1e-5)
    # ... and the reverse: FusedAdam's checkpoint loads into ZeroAdam (part of the 2-rank run).


def _group_faults(rank, world_size, path, fused_path):
    out = {}
    net, opt = make(ZeroAdam, pg=None)
    checkpoint.load(fused_path, opt, net)  # a FusedAdam checkpoint into ZeroAdam at 2
    out["from_fused"] = full_state(opt)
    synthetic_steps(opt, 0, 2)
    checkpoint.save(path, opt, net)
    saved = full_state(opt)
    synthetic_steps(opt, 2, 1)
    before = full_state(opt)

    real = checkpoint.files._write_bytes
    if rank == 1:
        def full_disk(f, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        checkpoint.files._write_bytes = full_disk
    try:
        checkpoint.save(path, opt, net)
    except CheckpointError as exc:
        out["enospc"] = str(exc)
    checkpoint.files._write_bytes = real

    dist.barrier()
    if rank == 0:  # rank 1's file goes bad; only rank 1 reads it at world size 2
        shard = os.path.join(path, "rank00001.bin")
        data = bytearray(open(shard, "rb").read())
        data[-5] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    dist.barrier()
    try:
        checkpoint.load(path, opt, net)
    except CheckpointError as exc:
        out["corrupt"] = str(exc)
    out["untouched"] = _equal(full_state(opt), before)
    return portable((out, saved))


def _equal(a, b):
    if a is None and b is None:
        return True
    try:
        assert_state_equal(a, b, "")
        return True
    except AssertionError:
        return False


def test_faults_under_a_process_group(tmp_path):
    net, opt = make()
    synthetic_steps(opt, 0, 1)
    checkpoint.save(tmp_path / "fused", opt, net)
    (r0, saved), (r1, _) = run_ranks(_group_faults, 2, str(tmp_path / "ck"), str(tmp_path / "fused"))
    assert_state_equal(r0["from_fused"], full_state(opt), "FusedAdam checkpoint into ZeroAdam")
    for r in (r0, r1):
        assert "failed on rank 1 while writing its files: OSError" in r["enospc"] and "No space left" in r["enospc"], r["enospc"]
        assert r["untouched"], "a rejected load changed the optimizer"
    assert "checksum mismatch in checkpoint file rank00001.bin" in r1["corrupt"], r1["corrupt"]
    assert "failed on rank 1" in r0["corrupt"] and "rank00001.bin" in r0["corrupt"], r0["corrupt"]
    # the checkpoint the failed save would have replaced (corrupted later by the test) is there
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["step"] == 3.0  # 1 + 2
    assert sorted(os.listdir(tmp_path)) == ["ck", "fused"]


def _killed_during_save(rank, world_size, path, report):
    net, opt = make(ZeroAdam)
    synthetic_steps(opt, 0, 2)
    checkpoint.save(path, opt, net)
    if rank == 0:
        torch.save(params_of(net), report + ".params")
    synthetic_steps(opt, 2, 2)
    if rank == 1:
        real = checkpoint.files._write_bytes

        def die(f, data):
            real(f, bytes(data)[:len(data) // 2])
            f.flush()
            os._exit(3)
        checkpoint.files._write_bytes = die
    try:
        checkpoint.save(path, opt, net)
    except RuntimeError as exc:
        with open(report, "w") as f:
            f.write(str(exc))
        raise


def _resume_then_die_mid_step(rank, world_size, path, report):
    net, opt = make(ZeroAdam, seed=2)
    checkpoint.load(path, opt, net)
    result = params_of(net)
    dist.barrier()
    if rank == 1:
        os._exit(3)
    try:
        synthetic_steps(opt, 2, 1)
    except RuntimeError as exc:
        with open(report, "w") as f:
            f.write(str(exc))
        torch.save(result, report + ".params")
        raise


def test_rank_killed_during_save_then_mid_step(tmp_path):
    path, report = str(tmp_path / "ck"), str(tmp_path / "report")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died without reporting"):
        run_ranks(_killed_during_save, 2, path, report, timeout=90, pg_timeout_s=20)
    msg = open(report).read()
    assert "zero_triton: checkpoint save to" in msg and "(writing its files) failed on rank 0" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["ck", "report", "report.params"]
    saved_params = torch.load(report + ".params", weights_only=True)

    # A fresh group loads the previous checkpoint; then a rank dies before a step.
    report2 = str(tmp_path / "report2")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died without reporting"):
        run_ranks(_resume_then_die_mid_step, 2, path, report2, timeout=90, pg_timeout_s=20)
    assert_state_equal(torch.load(report2 + ".params", weights_only=True), saved_params,
                       "params loaded after the killed save")
    msg = open(report2).read()
    # The step's agreement (zero_triton.comm.agreement) is its first exchange: it fails first.
    assert msg.startswith("zero_triton: step failed on rank 0: a peer rank did not join") and \
        "died" in msg, msg


# -- soak -----------------------------------------------------------------------------------------
SOAK_STEPS, SAVE_EVERY = 500, 50


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _soak_model(seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return net, ZeroAdam(net.parameters(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True,
                         backend="torch")


def _soak_train(net, opt, start, stop, rank, on_step=None):
    x = torch.empty(8, 16)
    y = torch.empty(8, 4)
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step * 16 + rank)  # data depends on (step, rank)
        torch.randn(8, 16, generator=g, out=x)
        torch.randn(8, 4, generator=g, out=y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if on_step is not None:
            on_step(step + 1)


def _soak_ranks(rank, world_size, root, seed):
    net, opt = _soak_model(0)
    rss = {}

    def on_step(step):
        if step % SAVE_EVERY == 0:
            checkpoint.save(os.path.join(root, f"step{step}"), opt, net, extra={"step": step})
        if step in (100, SOAK_STEPS):
            rss[step] = _rss_bytes()
    _soak_train(net, opt, 0, SOAK_STEPS, rank, on_step)
    final = params_of(net)

    restart = random.Random(seed).choice(range(SAVE_EVERY, SOAK_STEPS, SAVE_EVERY))
    net2, opt2 = _soak_model(1)
    step = checkpoint.load(os.path.join(root, f"step{restart}"), opt2, net2)["step"]
    _soak_train(net2, opt2, step, SOAK_STEPS, rank)
    return portable((final, params_of(net2), restart, rss))


def test_soak_500_steps_restart_and_flat_memory(tmp_path, monkeypatch):
    # torch.distributed's flight recorder keeps its last 2000 collectives (their stacks
    # included): its ring fills over the first few hundred steps and then stays, which
    # would read as growth here. Off, so that the window sees our memory only.
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    results = run_ranks(_soak_ranks, 2, str(tmp_path), 1234, timeout=200)
    for rank, (final, resumed, restart, rss) in enumerate(results):
        grow = rss[SOAK_STEPS] - rss[100]
        print(f"rank {rank}: restart from step {restart}; RSS at step 100 {rss[100] / 2**20:.1f} MiB, "
              f"at step {SOAK_STEPS} {rss[SOAK_STEPS] / 2**20:.1f} MiB (+{grow / 2**20:.2f} MiB)")
        assert_state_equal(resumed, final, f"rank {rank}: resumed from step {restart} vs uninterrupted")
        assert grow <= 2**20, f"rank {rank}: RSS grew {grow / 2**20:.2f} MiB from step 100 to {SOAK_STEPS}"
    assert_state_equal(results[0][0], results[1][0], "ranks disagree on the final parameters")


# -- compact files: int8 moments as their codes and scales ------------------------------
def _int8_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 300), torch.nn.Linear(300, 5),
                               torch.nn.Linear(5, 600)).to(torch.bfloat16)


def _compact_ranks(rank, world_size, path, compact, bucket_cap_mb, save):
    net = _int8_net()
    opt = ZeroAdam(net.parameters(), lr=1e-2, moments="int8", bucket_cap_mb=bucket_cap_mb)
    if save:
        for t in range(3):
            x = torch.randn(4, 37, generator=torch.Generator().manual_seed(10 * t + rank))
            net(x.to(torch.bfloat16)).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(path, opt, net, compact=compact)
    else:
        checkpoint.load(path, opt, net)
    return portable(opt.state_dict()["state"])


@pytest.mark.parametrize("compact", [False, True])
def test_compact_files_hold_the_codes_and_load_bit_for_bit_at_another_world_size(tmp_path, compact):
    """``save(..., compact=True)``: each rank writes its int8 codes and scales as the
    store keeps them; loaded at 3 ranks (another bucket size) from 2, and consolidated
    offline into torch's format, the state is what was saved, bit for bit."""
    path = str(tmp_path / "ck")
    saved = run_ranks(_compact_ranks, 2, path, compact, 0.002, True, timeout=180)[0]
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    names = ["master", "exp_avg_codes", "exp_avg_sq_codes", "moment_scales"] if compact \
        else ["master", "exp_avg", "exp_avg_sq"]
    assert manifest["flats"][0]["states"] == names
    loaded = run_ranks(_compact_ranks, 3, path, compact, 0.003, False, timeout=180)[0]
    assert_state_equal(loaded, saved, "loaded at 3 ranks")
    offline, _ = checkpoint.consolidate(path)
    assert_state_equal(portable(offline["state"]), saved, "consolidated")
    # Bytes of the moments in the rank files: one per element per moment, two scales per
    # block, against float32's eight per element.
    moments = sum(seg["end"] - seg["start"] for rec in manifest["files"].values()
                  for seg in rec.get("segments", ()) if seg.get("state") in ("exp_avg", "exp_avg_codes"))
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("rank"))
    master = moments * 4
    if compact:
        assert on_disk - master < moments * (2 + 8 / 256) + 64 * 2 + 8 * 2 * 4
    else:
        assert on_disk - master >= moments * 8


def test_a_compact_manifest_is_checked_whole(tmp_path):
    """A compact manifest that names both kinds of moments, or a scales segment off a
    block, is refused before a byte of data is read."""
    path = tmp_path / "ck"
    run_ranks(_compact_ranks, 2, str(path), True, 0.002, True, timeout=180)
    good = json.loads((path / "manifest.json").read_text())
    both = json.loads(json.dumps(good))
    both["flats"][0]["states"].append("exp_avg")
    off = json.loads(json.dumps(good))
    seg = next(s for rec in off["files"].values() for s in rec.get("segments", ())
               if s.get("state") == "moment_scales" and s["start"] > 0)
    seg["start"] += 16
    for bad, match in ((both, "compact"), (off, "starts on a block")):
        reseal(path, bad)
        with pytest.raises(CheckpointError, match=match):
            checkpoint.consolidate(path)
