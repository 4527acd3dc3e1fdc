"""Low-bit state on FSDP2's and tensor parallel's DTensors is the parameter's, not the
shard's: the format chosen from the global shape (parameters whose rows are not whole int8
blocks keep fp32 moments at every layout), int8 blocks runs of 256 of a row whose scales
the ranks that share a block agree on, stochastic rounding keyed by the element's global
index, so FusedAdamW over ``fully_shard`` gives the same bits at 2 and 3 ranks (an empty
local shard included), at 2x2, 1x4 and dp4 under tensor parallelism, and a DCP
checkpoint reshards exactly (``bench/fsdp2_reshard.py`` and ``bench/tp_layouts.py`` are
the full tables)."""
from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from zero_triton.optim.engine_home import keeps_blocks  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _param(shape, placements, mesh):
    """What ``keeps_blocks`` reads of a DTensor: its global shape, placements and mesh."""
    return SimpleNamespace(shape=torch.Size(shape), placements=tuple(placements),
                           device_mesh=SimpleNamespace(size=lambda d: mesh[d]))


@pytest.mark.parametrize("shape, placements, mesh, kept", [
    ((50257, 768), [Shard(0)], (8,), True),           # rows of 3 blocks, any world size
    ((7, 512), [Shard(0)], (3,), True),               # uneven and empty last shards
    ((11008, 4096), [Replicate(), Shard(0)], (2, 4), True),  # HSDP
    ((768,), [Shard(0)], (2,), False),                # a bias: no rows to keep
    ((40, 24), [Shard(0)], (2,), False),              # thin rows: 24 elements
    ((3072, 768), [Shard(1)], (3,), True),            # a column split: 256 columns each
    ((4096, 4096), [Shard(0), Shard(1)], (2, 4), True),   # FSDP + TP: 1024 columns each
    ((4096, 1000), [Shard(1)], (4,), False),          # 250 columns each
    ((4096, 2048, 3), [Shard(0)], (2,), True),        # rows of 6144
    ((16, 32, 16), [Shard(1)], (2,), True),           # 16 x 16 = 256 per rank's part of a row
    ((512, 512), [Shard(0), Shard(1)], (1, 4), False),  # 128 of a row each: blocks shared
])
def test_the_rule_that_keeps_blocks_whole(shape, placements, mesh, kept):
    assert keeps_blocks(_param(shape, placements, mesh), 256) is kept
    assert keeps_blocks(_param(shape, placements, mesh), 1)  # unblocked formats keep all


@pytest.mark.parametrize("formats", ["int8,stochastic+int8", "bf16,remainder+int8"])
def test_low_bit_state_on_fsdp2_is_the_same_bits_at_another_world_size(formats, capsys):
    """Trained at 2 and 3 ranks on the same global gradients: the same parameters and
    state; saved by DCP at 2 and loaded at 3: what was saved. At 3 ranks the last
    layer's 2 rows leave rank 2 an empty shard."""
    sys.path.insert(0, str(BENCH))
    import fsdp2_reshard
    assert fsdp2_reshard.main(["--formats", formats, "--pairs", "2:3", "--steps", "2"]) == 0, \
        capsys.readouterr().out


def _rank_bytes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zero_triton
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 40))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = zero_triton.FusedAdamW(model.parameters(), moments="int8")
    shards = [(f.spec.moments, [tuple(p.shape) for p in f.params]) for fl in opt._shards.groups for f in fl]
    return shards, opt.memory_report()["moments"]


def test_thin_parameters_keep_fp32_moments_in_a_shard_of_their_own():
    from dist_utils import run_ranks
    for shards, moments in run_ranks(_rank_bytes, 2, timeout=120):
        assert shards == [("int8", [(1024, 512), (40, 1024)]),
                          ("fp32", [(1024,), (40,)])], shards
        # int8: 2 bytes and two scales per 256 of this rank's half; fp32: 8 bytes (the
        # biases' slots padded to 16 elements)
        quantized = (1024 * 512 + 40 * 1024) // 2
        thin = -(-(1024 // 2 + 40 // 2) // 16) * 16
        assert moments == quantized * 2 + quantized // 256 * 8 + 8 * thin


def _reshard():
    sys.path.insert(0, str(BENCH))
    import fsdp2_reshard
    return fsdp2_reshard


def test_a_compact_dcp_checkpoint_is_about_a_quarter_and_reshards_exactly():
    """``zero_triton.compact_state_dicts``: DCP saves int8 codes and scales as DTensors of
    the parameters' placements; loaded at 3 ranks from 2 under the same context, the
    state is what was saved, bit for bit, in about a quarter of fp32's bytes."""
    bench = _reshard()
    plain = bench.pair("int8", 2, 3, steps=2, wide=4)
    small = bench.pair("int8", 2, 3, steps=2, wide=4, compact=True)
    for row in (plain, small):
        assert row["trained"][0] == row["trained"][1] and row["resumed"][0] == row["resumed"][1], row
    assert small["bytes"] < 0.30 * plain["bytes"], (small["bytes"], plain["bytes"])


def test_a_compact_dcp_checkpoint_expands_to_torch_format(tmp_path):
    """The documented way to torch's AdamW: ``dcp_to_torch_save`` and ``expand``; the
    moments are those the optimizer held (torch's AdamW then loads them)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from dist_utils import run_ranks
    from zero_triton.optim.compact import expand
    bench = _reshard()
    full = torch.load(io.BytesIO(run_ranks(bench._train, 2, "int8", 2, False, str(tmp_path),
                                           True, timeout=300)[0]))
    dcp_to_torch_save(tmp_path / "optim", tmp_path / "optim.pt")
    osd = expand(torch.load(tmp_path / "optim.pt", weights_only=False)["optim"])
    moments = {f"{k}.{n}": v for k, e in osd["state"].items() for n, v in e.items() if n.startswith("exp_avg")}
    assert moments and all(torch.equal(v, full[k]) for k, v in moments.items()), sorted(moments)
    assert any(k.endswith("exp_avg") and full[k].abs().sum() > 0 for k in moments)
    model = bench.model(torch.float32)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_optimizer_state_dict(model, adamw, osd, options=StateDictOptions(full_state_dict=True))
    first = adamw.state[model[0].weight]["exp_avg"]
    assert torch.equal(first, full["0.weight.exp_avg"])


def _rank_tensor_parallel(rank, world, fmt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import zero_triton
    bench = _reshard()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dtype, kw = bench.FORMATS[fmt]
    model = model.to(dtype)
    opt = zero_triton.FusedAdamW(model.parameters(), lr=1e-2, **kw)
    for t in range(3):
        for i, p in enumerate(model.parameters()):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * t + i)).to(dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()
    return bench._full(model, opt)


def test_tensor_parallel_column_and_row_splits_keep_the_blocks():
    """Tensor parallel at 1 and 2 ranks: ColwiseParallel's Shard(0) and RowwiseParallel's
    Shard(1) (512 columns a rank) keep each int8 block whole, so the state and parameters
    are the same bits."""
    from dist_utils import run_ranks
    bench = _reshard()
    one, two = (torch.load(io.BytesIO(run_ranks(_rank_tensor_parallel, w, "int8", timeout=180)[0]))
                for w in (1, 2))
    same, total, worst = bench.compare(one, two)
    assert same == total, (same, total, worst)


def _layouts():
    sys.path.insert(0, str(BENCH))
    import tp_layouts
    return tp_layouts


def test_every_layout_steps_and_loads_the_same_bits(tmp_path):
    """FSDP2 over tensor parallelism at 4 ranks: a RowwiseParallel weight whose int8
    blocks two ranks share at tp=4 (128 of each 512-element row a rank), a strided
    ColwiseParallel weight, empty local shards. At 2x2, 1x4 and dp4, fed the same global
    gradients: the same parameters and state, bit for bit (int8, stochastic rounding
    with int8, int8 offloaded; before, 1x4 held fp32 moments for that weight and keyed
    stochastic rounding by local position: 27 and 21 of 30 tensors); DCP checkpoints
    saved at 2x2 and 1x4 load at the other, compact and torch's format, the state what
    was saved and two more steps the same bits (before: 'Missing key' for compact)."""
    from dist_utils import run_ranks
    bench = _layouts()
    layouts, formats = ["2x2", "1x4", "dp4"], ["int8", "stochastic+int8", "int8 offloaded"]
    trained = {k: torch.load(io.BytesIO(v)) for k, v in run_ranks(
        bench._train, 4, layouts, formats, 2, str(tmp_path), timeout=600)[0].items()}
    for fmt in formats:
        for layout in layouts[1:]:
            for when in (0, 1):
                same, total, differ = bench.compare(trained["2x2", fmt][when], trained[layout, fmt][when])
                assert same == total, (fmt, layout, when, differ)
    same, total, differ = bench.compare(trained["2x2", "int8"][1], trained["2x2", "int8 offloaded"][1])
    assert same == total, ("offloaded", differ)
    loaded = run_ranks(bench._load, 4, ["1x4", "2x2"], ["2x2", "1x4"], ["int8", "stochastic+int8"],
                       ["compact", "torch"], 2, str(tmp_path), timeout=600)[0]
    assert len(loaded) == 16
    for (layout, fmt, source, kind), got in loaded.items():
        assert not isinstance(got, str), (layout, fmt, source, kind, got)
        got = torch.load(io.BytesIO(got))
        for when, want in ((0, trained[source, fmt][0]), (1, trained["2x2", fmt][1])):
            same, total, differ = bench.compare(want, got[when])
            assert same == total, (source, layout, fmt, kind, when, differ)


def _rank_loaded_then_saved_compact(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    bench = _layouts()

    def load(layout, kind, path):
        net = bench.build(layout, torch.float32)
        opt = bench._optimizer(net, "int8")
        msd, osd = bench._state_dicts(net, opt, kind)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return net, opt
    net = bench.build("2x2", torch.float32)
    opt = bench._optimizer(net, "int8")
    for t in range(2):
        bench._grads(net, t, torch.float32)
        opt.step()
        opt.zero_grad()
    msd, osd = bench._state_dicts(net, opt, "torch")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/torch")
    saved = bench._full(net, opt)
    net, opt = load("1x4", "torch", f"{root}/torch")  # held as float32 until agreed
    msd, osd = bench._state_dicts(net, opt, "compact")  # agreed here, before any step
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/compact")
    net, opt = load("dp4", "compact", f"{root}/compact")
    return bench.compare(saved, bench._full(net, opt))


def test_a_torch_format_load_saved_compact_before_any_step_keeps_the_bits(tmp_path):
    """Loaded in torch's format at 1x4, where a RowwiseParallel weight's int8 blocks are
    shared by two ranks (its moments held as float32 until the next step agrees on their
    scales), and saved in the compact form at once (the agreement runs then): loaded at
    dp4, the state is what 2x2 saved, bit for bit."""
    from dist_utils import run_ranks
    same, total, differ = run_ranks(_rank_loaded_then_saved_compact, 4, str(tmp_path), timeout=300)[0]
    assert same == total, differ


def _rank_refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import zero_triton
    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 8, 256), mesh, [Shard(2)]))
    try:
        zero_triton.FusedAdamW([p], moments="int8")
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = None
    q = torch.nn.Parameter(distribute_tensor(torch.randn(4, 8, 256), mesh, [Shard(1)]))
    opt = zero_triton.FusedAdamW([q], moments="int8")  # each part of a row one run
    q.grad = distribute_tensor(torch.ones(4, 8, 256), mesh, [Shard(1)])
    opt.step()
    return refused


def test_a_layout_whose_rows_are_not_one_run_a_rank_is_refused_naming_the_fix():
    """int8 blocks are runs of 256 of a row; a placement that cuts a row into several runs
    on a rank (a 3-D weight's Shard(2) after a dimension of 8) is refused when the
    optimizer is built, naming the parameter, its placements and the fix, on every rank,
    at every mesh size; a Shard(1) whose preceding dimension is the rows steps."""
    from dist_utils import run_ranks
    for refused in run_ranks(_rank_refused, 2, timeout=120):
        assert refused is not None and "(4, 8, 256)" in refused and "Shard(dim=2)" in refused, refused
        assert "moments='fp32'" in refused, refused


def test_compact_state_dicts_refuses_an_optimizer_that_is_not_ours():
    import zero_triton
    adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="zero_triton optimizer"):
        with zero_triton.compact_state_dicts(adamw):
            pass
    opt = zero_triton.FusedAdamW(torch.nn.Linear(2, 2).parameters(), moments="int8")
    with zero_triton.compact_state_dicts(opt):
        assert opt.state_dict()["compact"]["moments"] == "int8"
    assert "compact" not in opt.state_dict()  # the context is over
