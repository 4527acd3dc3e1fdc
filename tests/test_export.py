"""The one export of the state (``zero_triton.optim.export``) and the two directions of
the per-parameter view it stands on (``ParamView.unpack`` / ``pack``): every element
moves between the ranks' states and whole per-parameter values at any layout, and every
way out of torch's format keeps what the user put in ``opt.state`` beside our keys."""
from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_ranks
from zero_triton.state.flat import FlatLayout
from zero_triton.state.param_view import ParamView, Pieces

SHAPES = [(3, 5), (7,), (), (0, 4), (33, 17), (1,), (2, 3, 4, 5), (300,)]


@pytest.mark.parametrize("world,bucket", [(1, None), (3, 40), (4, 500), (7, None)])
def test_unpack_then_pack_moves_every_element_at_any_layout(world, bucket):
    layout = FlatLayout.build(SHAPES, world, bucket_numel=bucket)
    buffer = torch.randn(layout.padded_numel, dtype=torch.float64)
    views = [ParamView(layout, layout.shard_segments(r)) for r in range(world)]
    states = [torch.cat([buffer[lo:hi] for lo, hi, _ in layout.shard_segments(r)]) for r in range(world)]
    values = [views[0].empty(i, torch.float64).fill_(float("nan")) for i in range(len(SHAPES))]
    rng = random.Random(world)
    for r, state in enumerate(states):  # in chunks cut anywhere, as the gathers send them
        cuts = sorted({0, state.numel(), *(rng.randrange(state.numel()) for _ in range(4))})
        for c, end in zip(cuts, cuts[1:]):
            views[0].unpack(r, c, state[c:end], values)
    for i, (value, whole) in enumerate(zip(values, layout.views(buffer))):
        assert torch.equal(value.reshape(-1), whole.reshape(-1)), i  # each element, once
    for r, view in enumerate(views):
        packed = torch.zeros_like(states[r])
        view.pack(values, packed)
        mask = torch.zeros(states[r].numel(), dtype=torch.bool)
        for _, a, b, at in view.runs():
            mask[at:at + b - a] = True
        assert torch.equal(packed[mask], states[r][mask]) and not packed[~mask].any()
        # This rank's runs as a DCP load gives them: the same elements in; one missing is named.
        pieces = [None] * len(SHAPES)
        for i, a, b, at in view.runs():
            pieces[i] = Pieces(SHAPES[i], [(a, states[r][at:at + b - a].clone())])
        again = torch.zeros_like(packed)
        assert view.uncovered(pieces) is None
        view.pack(pieces, again)
        assert torch.equal(again, packed)
        short = next((run for run in view.runs() if run.b - run.a > 1), None)
        if short is not None:
            i, a, b, at = short
            pieces[i] = Pieces(SHAPES[i], [(a, states[r][at:at + b - a - 1])])
            assert view.uncovered(pieces) == (i, a, b)


def _extras_in_every_way_out(rank, world):
    import torch.distributed.checkpoint.state_dict as dcp_sd

    from zero_triton import ZeroAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = ZeroAdamW(model.parameters(), lr=0.1, stage=1)
    torch.manual_seed(1 + rank)  # each rank its own batch
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    p = model[0].weight
    opt.state[p]["ema"] = torch.full_like(p, 2.0 + rank)  # a wrapper's key, this rank's
    opt.state["note"] = "kept"
    got = {}
    got["edited"] = opt.state_dict()  # gathered: opt.state was edited on this rank
    opt.step()
    got["served"] = opt.state_dict()  # no collective
    got["consolidated"] = opt.consolidated_state_dict(to_rank=None)
    del opt.state["note"]  # DCP names every state key by a parameter, for torch's optimizers too
    got["dcp"] = dcp_sd.get_optimizer_state_dict(model, opt)
    seen = {}
    for way, sd in got.items():
        state = sd["state"]
        key = "0.weight" if way == "dcp" else 0
        seen[way] = (float(state[key]["ema"][0, 0]), state.get("note"),
                     sorted(k for k in state[key] if k != "ema"))
    fresh = ZeroAdamW(model.parameters(), lr=0.1, stage=1)
    fresh.load_state_dict(got["served"])
    seen["loaded"] = float(fresh.state[p]["ema"][0, 0])
    return seen


def test_every_way_out_keeps_what_the_user_put_in_opt_state_at_two_ranks():
    """torch keeps a parameter's extra keys and entries that are not parameters in its
    state dict; so does each of ours, gathered, served, consolidated and DCP's, on each
    rank its own (as ``opt.state`` is), and a load puts them back."""
    results = run_ranks(_extras_in_every_way_out, 2)
    for rank, seen in enumerate(results):
        ours = ["exp_avg", "exp_avg_sq", "step"]
        for way in ("edited", "served", "consolidated", "dcp"):
            note = None if way == "dcp" else "kept"  # deleted before: DCP names keys by parameter
            assert seen[way] == (2.0 + rank, note, ours), (rank, way, seen[way])
        assert seen["loaded"] == 2.0 + rank


def test_a_load_whose_pieces_lack_this_ranks_elements_is_refused_before_anything_changes():
    """A DCP load gives each rank ``Pieces`` of a state tensor; one that lacks elements this
    rank owns (loaded into a state dict of another layout) is refused, naming the
    parameter, the range and the fix, and the state is as it was."""
    from zero_triton import FusedAdamW
    p = torch.nn.Parameter(torch.randn(4, 5))
    opt = FusedAdamW([p], lr=0.1)
    p.grad = torch.randn(4, 5)
    opt.step()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    sd = opt.state_dict()
    sd["state"][0] = dict(sd["state"][0], exp_avg=Pieces((4, 5), [(0, torch.zeros(12))]))
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 in param group 0: the "
                                         r"loaded shards lack elements of \[0, 20\).*dcp.load"):
        opt.load_state_dict(sd)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in before.items())
