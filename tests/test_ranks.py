"""How an optimizer meets the other ranks (``zero_triton.optim.protocol.Ranks``): one
rank (``OneRank``) and a group (``AgreedRanks``, ``CapturedRanks`` under capturable=True)
implement the protocol signature by
signature, ZeroAdam changes FusedAdam's step by the part it is built with (it overrides
none of FusedAdam's private hooks), and the user's ``opt.state`` edits reach a store
whose export is a copy (``MomentStore.commit``), as a quantized format's is."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_signature, protocol_methods
from zero_triton import FusedAdam, FusedAdamW, ZeroAdam
from zero_triton.optim import ranks
from zero_triton.optim.protocol import Ranks
from zero_triton.state import moments

IMPLS = [ranks.OneRank, ranks.AgreedRanks, ranks.CapturedRanks]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", protocol_methods(Ranks))
def test_each_ranks_part_has_the_protocols_signature(impl, method):
    assert_signature(impl, Ranks, method)


def test_zero_adam_overrides_no_private_hook_of_fused_adam():
    """ZeroAdam's difference from FusedAdam is the parts it is built with (communicator,
    ranks part, spec); what it defines beside them is its own public face."""
    overridden = {name for name, member in vars(ZeroAdam).items() if name in vars(FusedAdam)
                  and callable(member) and name.startswith("_") and not name.startswith("__")}
    assert overridden == set(), overridden


def test_one_rank_is_what_fused_adam_is_built_with():
    opt = FusedAdamW([torch.nn.Parameter(torch.ones(3))], backend="torch")
    assert isinstance(opt._ranks, ranks.OneRank) and isinstance(opt._ranks, Ranks)


class _CopyingMoments(moments.Fp32Moments):
    """fp32 moments whose export is a copy that ``commit`` takes back: what a quantized
    format does (its export dequantizes, its commit re-encodes)."""

    format = "copying"

    def export(self) -> dict:
        return {k: v.clone() for k, v in super().export().items()}

    def commit(self, exported: dict) -> None:
        for k, v in super().export().items():
            v.copy_(exported[k])


def _with_copying_store(p):
    opt = FusedAdamW([p], lr=0.1, backend="torch")
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    state = opt._shards.groups[0][0].state
    old = state.moments
    state.moments = _CopyingMoments(old.numel, old.dtype, old.device)
    state.moments.carry_over(old)
    return opt, state.moments


def test_an_assigned_moment_is_committed_to_a_store_whose_export_is_a_copy():
    p = torch.nn.Parameter(torch.ones(6))
    opt, store = _with_copying_store(p)
    opt.state[p]["exp_avg"] = torch.full((6,), 7.0)
    opt.state_dict()  # a call that reads the state follows the edit
    assert store.exp_avg[:6].tolist() == [7.0] * 6


def test_a_deleted_entry_zeroes_a_store_whose_export_is_a_copy():
    p = torch.nn.Parameter(torch.ones(6))
    opt, store = _with_copying_store(p)
    assert store.exp_avg_sq[:6].abs().sum() > 0
    del opt.state[p]
    opt.state_dict()
    assert not store.exp_avg[:6].any() and not store.exp_avg_sq[:6].any()
    assert float(opt.state_dict()["state"][0]["step"]) == 0.0
