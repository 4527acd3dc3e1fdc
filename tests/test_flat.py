"""The flat layout, zero_triton/state/flat.py: offsets, alignment, padding, shards, views."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from zero_triton.state.flat import ALIGN, FlatLayout, flatten_params, unflatten_into

# One element, below the alignment, a prime, exactly one alignment unit, multi-dim,
# a zero-size parameter between others.
AWKWARD = [(1,), (7,), (1009,), (16,), (13, 17), (0,), (3, 1, 5)]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def check_layout(layout, shapes, world_size):
    """Every invariant of a layout, with messages that say which one broke."""
    assert layout.shapes == tuple(tuple(s) for s in shapes)
    assert layout.align == ALIGN == 16
    end = 0
    for i, (o, s) in enumerate(zip(layout.offsets, shapes)):
        assert o % ALIGN == 0, f"parameter {i} {s}: offset {o} not aligned to {ALIGN} elements"
        assert o >= end, f"parameter {i} {s} at {o} overlaps the previous one ending at {end}"
        assert o - end < ALIGN, f"parameter {i}: a gap of {o - end} elements, more than alignment needs"
        end = o + numel(s)
    assert layout.numel == end, f"numel {layout.numel} is not the end of the last parameter {end}"
    assert layout.padded_numel >= max(layout.numel, 1)
    assert layout.padded_numel % (world_size * ALIGN) == 0, \
        f"padded size {layout.padded_numel} not a multiple of world_size*{ALIGN} = {world_size * ALIGN}"
    # (An all-empty layout still gets one alignment unit per rank: no empty buffers.)
    assert layout.padded_numel - max(layout.numel, 1) < world_size * ALIGN, "more tail padding than needed"
    assert layout.padding == layout.padded_numel - sum(numel(s) for s in shapes)
    # Shards: equal sizes, contiguous, covering the buffer exactly.
    ranges = [layout.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    for r, ((lo, hi), nxt) in enumerate(zip(ranges, ranges[1:] + [None])):
        assert hi - lo == layout.shard_numel, f"rank {r}: shard [{lo}, {hi}) has another size"
        if nxt is not None:
            assert hi == nxt[0], f"rank {r}: gap or overlap before rank {r + 1}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
def test_layout_awkward_shapes(world_size):
    check_layout(FlatLayout.build(AWKWARD, world_size), AWKWARD, world_size)


@given(shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=8),
       world_size=st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_layout_invariants_property(shapes, world_size):
    check_layout(FlatLayout.build(shapes, world_size), [tuple(s) for s in shapes], world_size)


def test_offsets_do_not_depend_on_world_size():
    # A checkpoint written at one world size maps onto any other: only the tail differs.
    base = FlatLayout.build(AWKWARD, 1)
    for ws in (2, 3, 7):
        other = base.with_world_size(ws)
        assert other.offsets == base.offsets and other.numel == base.numel
        assert other.world_size == ws


def test_more_ranks_than_elements():
    layout = FlatLayout.build([(1,)], world_size=5)
    check_layout(layout, [(1,)], 5)
    assert layout.shard_numel == ALIGN
    # Rank 0 holds the only element; ranks_in sees it there and nowhere else.
    owners = [r for r in range(5) if list(layout.ranges_in(*layout.shard_range(r)))]
    assert owners == [0]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_ranges_in_partition_every_parameter(world_size):
    layout = FlatLayout.build(AWKWARD, world_size)
    covered = [0] * len(AWKWARD)
    for r in range(world_size):
        lo, hi = layout.shard_range(r)
        for i, a, b in layout.ranges_in(lo, hi):
            assert 0 <= a < b <= numel(AWKWARD[i]), f"rank {r}: parameter {i} range [{a}, {b})"
            assert layout.offsets[i] + a >= lo and layout.offsets[i] + b <= hi
            covered[i] += b - a
    assert covered == [numel(s) for s in AWKWARD], "shards do not cover each parameter exactly once"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world_size", [1, 4])
def test_flatten_round_trip(dtype, world_size):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype) for s in AWKWARD]
    originals = [p.clone() for p in params]
    flat, layout = flatten_params(params, world_size=world_size)
    assert flat.dtype == dtype and flat.dim() == 1 and flat.numel() == layout.padded_numel
    check_layout(layout, AWKWARD, world_size)
    for i, (view, p) in enumerate(zip(layout.views(flat), originals)):
        assert view.shape == p.shape and torch.equal(view, p), f"parameter {i}: view differs"
    # Padding (alignment gaps and tail) is zero.
    mask = torch.ones(layout.padded_numel, dtype=torch.bool)
    for o, s in zip(layout.offsets, AWKWARD):
        mask[o:o + numel(s)] = False
    assert int(mask.sum()) == layout.padding
    assert not flat[mask].any(), "padding is not zero"
    # Not rehomed: the parameters keep their own storage.
    assert all(p.data_ptr() != v.data_ptr() for p, v in zip(params, layout.views(flat)) if p.numel())
    # unflatten_into copies values back out.
    targets = [torch.zeros_like(p) for p in params]
    flat.mul_(2)
    unflatten_into(targets, flat, layout)
    for i, (t, p) in enumerate(zip(targets, originals)):
        assert torch.equal(t, p * 2), f"parameter {i}: unflatten_into"


def test_unflatten_into_default_layout_and_module():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    flat, layout = flatten_params(model)
    assert layout == FlatLayout.build([p.shape for p in model.parameters()])
    new = torch.randn(layout.padded_numel)
    unflatten_into(model, new)  # layout rebuilt from the module's parameters
    for i, (p, v) in enumerate(zip(model.parameters(), layout.views(new))):
        assert torch.equal(p.detach(), v), f"parameter {i}"


def test_rehome_makes_data_views():
    model = nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 1))
    before = [p.detach().clone() for p in model.parameters()]
    flat, layout = flatten_params(model, rehome=True)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for i, (p, b, o) in enumerate(zip(model.parameters(), before, layout.offsets)):
        assert isinstance(p, nn.Parameter) and p.requires_grad
        assert start <= p.data_ptr() < end, f"parameter {i} does not live in the flat buffer"
        assert p.data_ptr() == flat[o:].data_ptr(), f"parameter {i} is not at its offset"
        assert torch.equal(p.detach(), b), f"parameter {i} changed value"
    # Writing the buffer writes the parameters, and autograd still sees leaves.
    with torch.no_grad():
        flat.zero_()
    assert all(not p.any() for p in model.parameters())
    model(torch.ones(2, 7)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # unflatten_into leaves parameters that already live in the buffer alone.
    unflatten_into(model, flat, layout)


@pytest.mark.parametrize("params, match", [
    (lambda: [torch.zeros(3), torch.zeros(3, dtype=torch.float16)],
     "one dtype and device: parameter 1 is torch.float16.*flatten each kind separately"),
    (lambda: [torch.zeros(3), torch.zeros(3, device="meta")],
     "one dtype and device: parameter 1 is torch.float32 on meta"),
    (lambda: [], "got no parameters"),
])
def test_flatten_errors(params, match):
    ps = params()
    before = [p.clone() for p in ps if p.device.type != "meta"]
    with pytest.raises(ValueError, match=match):
        flatten_params(ps, rehome=True)
    for p, b in zip([p for p in ps if p.device.type != "meta"], before):
        assert torch.equal(p, b)


def test_layout_and_unflatten_errors():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        FlatLayout.build([(3,)], world_size=0)
    layout = FlatLayout.build([(3,), (4,)])
    with pytest.raises(ValueError, match="layout has 2 parameters, got 1"):
        unflatten_into([torch.zeros(3)], torch.zeros(64), layout)
    with pytest.raises(ValueError, match="flat has 5 elements, the layout needs 20"):
        unflatten_into([torch.zeros(3), torch.zeros(4)], torch.zeros(5), layout)
    with pytest.raises(ValueError, match=r"parameter 1 has shape \(2, 2\), the layout says \(4,\)"):
        unflatten_into([torch.zeros(3), torch.zeros(2, 2)], torch.zeros(64), layout)


# -- buckets --------------------------------------------------------------------------------
def check_buckets(layout, shapes, world_size, bucket_numel):
    """Buckets tile the parameters in order, each padded to a multiple of world_size *
    align and sharded on its own; offsets are the canonical ones shifted per bucket; the
    ranks' canonical segments cover every element of the data exactly once."""
    n = len(shapes)
    canonical = FlatLayout.build(shapes, 1)
    assert layout.canonical_offsets == canonical.offsets and layout.numel == canonical.numel
    first, start, state = 0, 0, 0
    for k, b in enumerate(layout.buckets):
        assert b.first == first and b.end > b.first or n == 0, f"bucket {k} does not follow bucket {k - 1}"
        assert b.start == start and b.numel % (world_size * ALIGN) == 0 and b.numel > 0
        assert b.shard_numel * world_size == b.numel and b.shard_start == state
        size = sum(numel(s) for s in shapes[b.first:b.end])
        if bucket_numel is not None and b.end - b.first > 1:
            assert size <= bucket_numel, f"bucket {k} holds {size} elements, the cap is {bucket_numel}"
        for i in range(b.first, b.end):
            assert layout.offsets[i] - b.start == canonical.offsets[i] - b.canonical_start
            assert layout.offsets[i] + numel(shapes[i]) <= b.start + b.numel
        first, start, state = b.end, b.start + b.numel, state + b.shard_numel
    assert first == n and start == layout.padded_numel and state == layout.shard_numel
    if bucket_numel is not None:  # filled from the back: each bucket but the first is full
        for b in layout.buckets[1:]:
            size = sum(numel(s) for s in shapes[b.first:b.end])
            prev = numel(shapes[b.first - 1])
            assert size + prev > bucket_numel or b.end - b.first == 0, "a bucket could take one more"
    covered = torch.zeros(max(layout.numel, 1), dtype=torch.int32)
    for r in range(world_size):
        segs = layout.shard_segments(r)
        assert [hi - lo for lo, hi, _ in segs] == [b.shard_numel for b in layout.buckets]
        for lo, hi, s0 in layout.canonical_segments(r):
            covered[lo:hi] += 1
    assert bool((covered[:layout.numel] == 1).all()), "canonical segments miss or repeat an element"


@given(shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=10),
       world_size=st.integers(1, 6), bucket_numel=st.one_of(st.none(), st.integers(1, 400)))
@settings(max_examples=300, deadline=None)
def test_bucketed_layout_invariants_property(shapes, world_size, bucket_numel):
    shapes = [tuple(s) for s in shapes]
    check_buckets(FlatLayout.build(shapes, world_size, bucket_numel=bucket_numel), shapes,
                  world_size, bucket_numel)


def test_bucketed_views_round_trip_through_the_canonical_layout():
    shapes = AWKWARD
    layout = FlatLayout.build(shapes, 3, bucket_numel=20)
    assert len(layout.buckets) > 2
    params = [torch.randn(s) for s in shapes]
    flat, got = flatten_params(params, world_size=3, bucket_numel=20)
    assert got == layout
    canonical = torch.cat(layout.to_canonical(flat))
    assert canonical.numel() == layout.numel
    out = [torch.zeros(s) for s in shapes]
    unflatten_into(out, canonical, layout.canonical)
    for i, (a, b) in enumerate(zip(out, params)):
        assert torch.equal(a, b), f"parameter {i} did not survive buffer -> canonical -> parameter"
    with pytest.raises(ValueError, match="shard_segments"):
        layout.shard_range(0)
    with pytest.raises(ValueError, match="bucket_numel"):
        FlatLayout.build(shapes, 2, bucket_numel=0)
