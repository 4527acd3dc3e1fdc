"""The per-parameter view of a flat buffer's state (``zero_triton.state.param_view``):
the positions every way out of the state reads and writes it by."""
from __future__ import annotations

import random

import pytest
import torch

from zero_triton.state.flat import FlatLayout, memory_order
from zero_triton.state.param_view import ParamView, Run

SHAPES = [(3, 5), (7,), (), (0, 4), (33, 17), (1,), (2, 3, 4, 5), (300,)]


def states(layout: FlatLayout, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's state: its shard of every bucket, one after another."""
    return [torch.cat([buffer[lo:hi] for lo, hi, _ in layout.shard_segments(r)])
            for r in range(layout.world_size)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket", [None, 40, 500])
def test_the_runs_of_every_rank_hold_each_element_once_where_the_state_has_it(world, bucket):
    layout = FlatLayout.build(SHAPES, world, bucket_numel=bucket)
    buffer = torch.arange(layout.padded_numel, dtype=torch.float64)
    held = [torch.zeros(max(1, int(torch.tensor(s).prod())), dtype=torch.int64) for s in SHAPES]
    for r, state in enumerate(states(layout, buffer)):
        view = ParamView(layout, layout.shard_segments(r))
        runs = view.runs(r)
        assert runs == view.runs()  # this rank's own segments: the same runs
        assert [run.at for run in runs] == sorted(run.at for run in runs)  # state order
        for i, a, b, at in runs:
            assert 0 <= a < b <= held[i].numel() and 0 <= at and at + b - a <= state.numel()
            want = buffer[layout.offsets[i] + a:layout.offsets[i] + b]
            assert torch.equal(state[at:at + b - a], want)
            held[i][a:b] += 1
        assert view.owned(r) == {run.index: run for run in runs}
        assert len(view.owned(r)) == len(runs)  # one run per parameter per rank
    for i, shape in enumerate(SHAPES):
        n = int(torch.tensor(shape).prod()) if shape else 1
        assert torch.equal(held[i][:n], torch.ones(n, dtype=torch.int64)), (i, shape)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_runs_of_a_range_of_the_state_are_the_runs_cut_there(world):
    layout = FlatLayout.build(SHAPES, world, bucket_numel=64)
    view = ParamView(layout, layout.shard_segments(0))
    rng = random.Random(world)
    for r in range(world):
        whole = view.runs(r)
        cuts = sorted({0, layout.shard_numel, *(rng.randrange(layout.shard_numel) for _ in range(5))})
        pieces = [run for lo, hi in zip(cuts, cuts[1:]) for run in view.runs(r, lo, hi)]
        merged = []
        for run in pieces:  # a run cut at a chunk's edge continues in the next chunk
            if merged and merged[-1].index == run.index and merged[-1].b == run.a:
                last = merged.pop()
                run = Run(last.index, last.a, run.b, last.at)
            merged.append(run)
        assert merged == whole


def test_elements_are_the_flat_buffers_order_and_a_view_of_what_empty_makes():
    shapes = [(2, 3, 4, 5), (6,)]
    channels_last = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last).stride()
    layout = FlatLayout.build(shapes, strides=[channels_last, None])
    view = ParamView(layout, layout.shard_segments(0))
    value = torch.randn(2, 3, 4, 5)  # contiguous: read in channels_last order (a copy)
    assert torch.equal(view.elements(0, value), memory_order(value, channels_last))
    made = view.empty(0, torch.float32)
    assert made.stride() == channels_last
    view.elements(0, made).copy_(torch.arange(120.0))
    assert torch.equal(memory_order(made, channels_last), torch.arange(120.0))  # written through
    assert made.shape == (2, 3, 4, 5)
    flat = torch.arange(6.0)
    assert view.elements(1, flat).data_ptr() == flat.data_ptr()


def test_a_complex_parameters_elements_are_its_real_imaginary_pairs():
    layout = FlatLayout.build([(3, 2)])  # a complex (3,) parameter in its real shape
    view = ParamView(layout, layout.shard_segments(0))
    value = torch.tensor([1 + 2j, 3 + 4j, 5 + 6j], dtype=torch.complex64)
    assert view.elements(0, value).tolist() == [1, 2, 3, 4, 5, 6]
    assert view.empty(0, torch.float32).shape == (3, 2)
