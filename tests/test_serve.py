"""The shard server and the side channel (docs/checkpoints.md, "State dicts on one rank"): any ranks
call ``state_dict()`` in any order at any moment and get the whole state; idle costs one
blocked store read; a request costs one queue entry per peer; nothing outlives its
process group or its optimizer; a failed answer says why, at once.

The multi-rank tests run on gloo ranks with a hard timeout (``dist_utils.run_ranks``): a
wait cycle fails them by it. ``python bench/serve_soak.py`` plays many more schedules.
"""
import gc
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import requires_cuda
from dist_utils import free_port, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve_soak  # noqa: E402


# -- no wait cycles: random schedules ------------------------------------------------------
# Seeds drawn so that the shards go in one chunk (101, 105) or in chunks of 5 or 16
# elements (102, 107, 109): a large model's many chunks, at 4 and 8 ranks too.
@pytest.mark.parametrize("world,seed,stage", [(2, 101, 1), (3, 102, 2), (4, 107, 1), (5, 105, 2),
                                              (8, 109, 1)])
def test_any_ranks_in_any_order_at_any_moment_get_the_whole_state(world, seed, stage):
    """Rounds drawn from ``seed``: a step, then none, one, some or all ranks call
    ``state_dict()`` (some twice; the shards in chunks of the seed's size) after random
    delays of 0-60 ms, ending in a barrier,
    in nothing (the next step) or in lockstep. Every call returns the collective
    gather's bits. (Every rank's call a few ms apart hung at 4 ranks: each rank's main
    thread waited for a peer's server, which was sending to a rank that waited too.)"""
    rounds = 8
    _every_call_got_the_gather(run_ranks(serve_soak.play, world, seed, rounds, stage,
                                         timeout=240, pg_timeout_s=240))


def _every_call_got_the_gather(results) -> None:
    calls = 0
    for rank, per_rank in enumerate(results):
        for k, (got, ref, _) in enumerate(per_rank):
            assert all(d == ref for d in got), f"rank {rank} round {k}: {got} != {ref}"
            calls += len(got)
    assert calls > 0


def _numbered(fn):
    """Run ``fn`` with the shard servers' mailboxes in numbered keys (``Store.wait``), the
    form a torch whose stores have no queues (2.7) gets."""
    def run(*args):
        import functools

        from zero_triton.comm import mailbox, serve
        serve.open_mailbox = functools.partial(mailbox.open_mailbox, queues=False)
        return fn(*args)
    return run


def _play_numbered(*args):
    return _numbered(serve_soak.play)(*args)


@pytest.mark.parametrize("world,seed,stage", [(3, 102, 2), (4, 107, 1)])
def test_stores_without_queues_serve_through_numbered_keys(world, seed, stage):
    """The same random schedules with the mailboxes in numbered keys and a blocked
    ``Store.wait`` (torch 2.7's stores have no queues): the same bits."""
    _every_call_got_the_gather(run_ranks(_play_numbered, world, seed, 6, stage, timeout=240,
                                         pg_timeout_s=240))


# -- idle costs nothing; a request costs O(world size) -----------------------------------
def _trained(steps=2, device="cpu"):
    """A small model and its ZeroAdamW after ``steps`` steps."""
    from zero_triton import ZeroAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).to(device)
    opt = ZeroAdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 16, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class _Counting:
    """A store that counts the calls made on it by name."""

    def __init__(self, store, counts):
        self._store, self._counts = store, counts

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self._counts[name] = self._counts.get(name, 0) + 1
            return method(*args, **kwargs)
        return counted


def _store_calls(rank, world, queues):
    import torch.distributed as dist

    from zero_triton.comm import mailbox, serve
    counts = {"pusher": {}, "reader": {}}
    kinds = []
    opened = mailbox.open_mailbox

    def counting(*args):
        box = opened(*args, queues=queues)
        kinds.append(type(box).__name__)
        box.store, box.own = _Counting(box.store, counts["pusher"]), _Counting(box.own, counts["reader"])
        return box
    serve.open_mailbox = counting
    model, opt = _trained()
    time.sleep(2.0)  # idle: ~40 polls of the store in the old server
    idle = {k: dict(v) for k, v in counts.items()}
    dist.barrier()
    if rank == 0:
        opt.state_dict()
    dist.barrier()
    time.sleep(0.2)  # the peers' servers went back to their mailboxes
    asked = {k: dict(v) for k, v in counts.items()}
    return kinds, idle, asked


# Store operations of one mailbox form (zero_triton.comm.mailbox): the server's blocked
# read; what it does per entry read; what a requester does per peer.
_OPS = {"Queues": ({"queue_pop": 1}, {"queue_pop": 1}, {"queue_push": 1}),
        "Numbered": ({"wait": 1}, {"wait": 1, "get": 1, "delete_key": 1}, {"add": 1, "set": 1})}


@pytest.mark.parametrize("queues", [True, False], ids=["queues", "numbered"])
def test_idle_is_one_blocked_store_read_and_a_request_one_entry_per_peer(queues):
    world = 4
    results = run_ranks(_store_calls, world, queues, timeout=120)
    for rank, (kinds, idle, asked) in enumerate(results):
        assert len(kinds) == 1, (rank, kinds)  # one mailbox per rank for the group
        blocked, per_read, per_peer = _OPS[kinds[0]]
        # Idle: one read, blocked since; nothing pushed.
        assert idle == {"pusher": {}, "reader": blocked}, (rank, idle)
        if rank == 0:  # one entry per peer, nothing read
            assert asked["pusher"] == {k: n * (world - 1) for k, n in per_peer.items()}, (rank, asked)
            assert asked["reader"] == blocked, (rank, asked)
        else:  # one entry read, one read blocked again
            again = {k: per_read.get(k, 0) + blocked.get(k, 0) for k in {*per_read, *blocked}}
            assert asked == {"pusher": {}, "reader": again}, (rank, asked)


# -- lifetime ------------------------------------------------------------------------------
def _threads_and_files():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _settled(before=None):
    """The counts once a thread that is ending has ended. ``Thread.join`` returns when the
    thread's Python state is released, a moment before the system thread leaves
    /proc/self/task; on a loaded machine that moment was seen (a cycle at 2 threads and
    13 files, the next at 1 and 13). Waits at most 5 s for the counts to be no more than
    ``before`` (without it, for two reads 50 ms apart to agree): a thread or file that
    stays is still counted."""
    counts = _threads_and_files()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if before is not None and all(now <= was for now, was in zip(counts, before)):
            break
        time.sleep(0.05)
        again, counts = counts, _threads_and_files()
        if before is None and again == counts:
            break
    return counts


def _cycles(rank, world, ports):
    """The harness's group destroyed; then, per port but the last, init -> ZeroAdamW ->
    2 steps -> rank 0's state_dict() -> destroy_process_group(), the count of threads and
    open files after each; a group made again at the end, on the last port, for the
    harness to destroy."""
    import datetime

    import torch.distributed as dist
    dist.destroy_process_group()
    counts = []
    # The harness's own timeout: a rank whose peer failed to join fails, not waits 30 min.
    timeout = datetime.timedelta(seconds=60)
    for port in ports[:-1]:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timeout)
        model, opt = _trained()
        if rank == 0:
            opt.state_dict()
        dist.destroy_process_group()
        del model, opt
        gc.collect()
        counts.append(_settled(counts[0] if counts else None))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[-1]}", rank=rank,
                            world_size=world)
    return counts


def _cycles_numbered(*args):
    return _numbered(_cycles)(*args)


@pytest.mark.parametrize("queues", [True, False], ids=["queues", "numbered"])
def test_init_destroy_cycles_hold_threads_and_open_files_flat(queues):
    """(Five cycles went from 2 to 6 threads and 33 to 93 open files per process: each
    destroyed group's server thread, its gloo group and its store connection stayed.
    Numbered: a caught exception kept in a local held the group's store past
    ``destroy_process_group``, so the second cycle's rank did not wait for its peer.)"""
    # Six ports the system handed out as free, all different: five cycles (each leak
    # showed from the second) and the harness's group at the end (a port next to a free
    # one may be any socket's).
    ports = [free_port() for _ in range(6)]
    while len(set(ports)) < 6:
        ports = [free_port() for _ in range(6)]
    results = run_ranks(_cycles if queues else _cycles_numbered, 2, ports, timeout=240)
    for rank, counts in enumerate(results):
        assert all(c == counts[0] for c in counts[1:]), (rank, counts)


def _dropped(rank, world):
    from zero_triton.comm import side
    before = _threads_and_files()
    model, opt = _trained(1)
    during = _threads_and_files()
    names = [t.name for t in threading.enumerate()]
    del opt
    gc.collect()
    after = _settled(before)
    return before, during, after, names, len(side.open_channels())


def test_a_dropped_optimizer_stops_its_server_and_side_group():
    for rank, (before, during, after, names, channels) in enumerate(run_ranks(_dropped, 2, timeout=120)):
        assert any("shard server" in n for n in names), names
        assert during[0] > before[0], (rank, before, during)
        # Threads back to what they were; files too (or fewer: something else closed one).
        assert after[0] == before[0] and after[1] <= before[1] and channels == 0, \
            (rank, before, during, after, channels)


def _dropped_on_one_rank(rank, world):
    """Rank 0's first optimizer is collected (its side channel closes), rank 1's is not
    yet (garbage the collector has not reached, kept here): a new optimizer on the same
    group must make one channel with every rank, then train and serve."""
    from zero_triton.comm import side
    model, opt = _trained(1)
    kept = opt if rank == 1 else None
    del opt
    gc.collect()
    closed = not side.open_channels()
    model, opt = _trained(2)
    state = opt.state_dict()  # the other rank's shard through the new channel's server
    del kept
    return closed, len(state["state"])


def test_a_new_optimizer_agrees_on_its_side_channel_when_the_old_one_is_gone_on_some_ranks():
    """Before the channel was agreed, rank 0 made a new one and waited for rank 1 in it
    for ever, while rank 1 took its old one."""
    (closed0, n0), (closed1, n1) = run_ranks(_dropped_on_one_rank, 2, timeout=60)
    assert closed0 and not closed1 and n0 == n1 == 4


# -- failures are loud and quick ------------------------------------------------------------
def _provider_fails(rank, world):
    import torch.distributed as dist

    from zero_triton.optim.served import ServedState
    if rank == 1:
        def failing(self, words):
            raise OSError("the disk under rank 1 is full")
        ServedState.answer = failing
    model, opt = _trained(1)
    message = _refused_in(opt) if rank == 0 else None
    dist.barrier()
    return message


def _refused_in(opt):
    """(seconds, message) of ``opt.state_dict()``'s error; None if it returned."""
    start = time.monotonic()
    try:
        opt.state_dict()
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc)
    return None


def test_a_failed_answer_raises_on_the_asking_rank_with_the_reason_at_once():
    seconds, message = run_ranks(_provider_fails, 2, timeout=120, pg_timeout_s=120)[0]
    assert seconds < 10 and "the disk under rank 1 is full" in message, (seconds, message)


# -- GPUs: a copy after the state's event, never a device-wide synchronize -------------------
@requires_cuda
def test_cuda_host_copy_waits_for_the_states_event_not_for_the_device():
    """The main stream writes the state, records the event, then spins (an NCCL barrier
    waiting for the asking rank, say): the server's copy lands while the spin runs."""
    from zero_triton.comm import serve
    state = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    state.mul_(2)
    ready = torch.cuda.Event()
    ready.record()
    torch.cuda._sleep(int(3e9))  # ~1-2 s of spinning on the current stream
    server = serve.ShardServer.__new__(serve.ShardServer)
    server.copies, server.streams = {}, {}
    start = time.monotonic()
    host = server._host_copy(0, [state[: 1 << 19], state[1 << 19:]],
                             serve.Answer([serve.OK], ready=[ready], version=1))
    took = time.monotonic() - start
    spinning = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert spinning, f"the copy took {took:.2f} s: it waited for the spin"
    expect = torch.arange(1 << 20, dtype=torch.float32) * 2
    assert torch.equal(torch.cat(host), expect)
    again = server._host_copy(0, [state], serve.Answer([serve.OK], ready=[ready], version=1))
    assert again is host  # one copy per version, shared by the requesters


def _served_on_gpu(rank, world):
    import torch.distributed as dist
    torch.cuda.set_device(0)  # one GPU: both gloo ranks on it (NCCL refuses two)
    _, opt = _trained(3, "cuda")
    every = serve_soak.digest(opt.consolidated_state_dict(None))
    alone = serve_soak.digest(opt.state_dict()) if rank == 0 else None
    dist.barrier()  # rank 1 waits here while its server copies its shard from the GPU
    return every, alone


@requires_cuda
def test_cuda_state_dict_on_one_rank_of_two_gloo_ranks_on_the_gpu():
    results = run_ranks(_served_on_gpu, 2, timeout=180)
    assert results[0][1] == results[0][0] == results[1][0], results


# -- what a GPU copy is keyed by, on CPU ------------------------------------------------------
def _versions(rank, world):
    """The provider's answer: a new state version after each write (a step, a load, an
    agreed entry), the same one between writes, so that one host copy of a GPU shard
    serves every requester of it and none is served a stale one."""
    from zero_triton.comm import serve
    from zero_triton.optim import state_dict as adam_state
    model, opt = _trained(1)
    steps = opt._ranks.agreement.steps
    digest = adam_state.layout_digest([f for _, f in opt._shards.listed(opt.param_groups)])
    first = opt._ranks.served.answer([steps, digest, 0])
    again = opt._ranks.served.answer([steps, digest, 0])
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    stepped = opt._ranks.served.answer([steps + 1, digest, 0])
    opt.load_state_dict(opt.consolidated_state_dict(None))
    loaded = opt._ranks.served.answer([steps + 1, digest, 1])
    stale = opt._ranks.served.answer([steps, digest, 1])
    unloaded = opt._ranks.served.answer([steps + 1, digest, 0])
    return ([a.header[0] for a in (first, again, stepped, loaded, stale, unloaded)],
            [a.version for a in (first, again, stepped, loaded)],
            (serve.OK, serve.STEPS, serve.LOADS))


def test_the_shard_answer_is_keyed_by_a_version_every_write_changes():
    """... and a peer at another count of steps or loads is refused (a load's copies run
    after its last collective: a peer whose load ended first waits for this rank's)."""
    for statuses, versions, (ok, steps, loads) in run_ranks(_versions, 2, timeout=120):
        assert statuses == [ok, ok, ok, ok, steps, loads], statuses
        assert versions[0] == versions[1] < versions[2] < versions[3], versions


def _load_then_ask(rank, world):
    """Every rank loads a state dict; rank 1's copies of it take a second after the
    load's last collective (a large state); rank 0, done first, asks at once."""
    import torch.distributed as dist

    from zero_triton.optim import state_dict as adam_state
    model, opt = _trained(2)
    target = opt.consolidated_state_dict(None)
    for entry in target["state"].values():
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], 0.25)
    if rank == 1:
        apply = adam_state.apply_load

        def slow(*args):
            time.sleep(1.0)
            apply(*args)
        adam_state.apply_load = slow
    opt.load_state_dict(target)
    got = opt.state_dict() if rank == 0 else None
    dist.barrier()
    return None if got is None else sorted({float(e["exp_avg"].min()) for e in got["state"].values()})


def test_a_state_dict_right_after_a_load_waits_for_the_peers_copies():
    """(It answered at once with rank 1's shard from before the load: the copies of a
    load run after its last collective, and only the step's tail was waited for.)"""
    assert run_ranks(_load_then_ask, 2, timeout=120)[0] == [0.25]


def _peer_destroyed(rank, world, port):
    """Rank 1 destroys the group while handling an exception (it failed: its channel
    closes at once); rank 0 then asks it for its shards."""
    import torch.distributed as dist
    _, opt = _trained(1)
    result = None
    if rank == 1:
        try:
            raise RuntimeError("rank 1 fails")
        except RuntimeError:
            dist.destroy_process_group()
        time.sleep(3.0)
    else:
        time.sleep(1.0)
        result = _refused_in(opt)
        dist.destroy_process_group()
    # a group again, for the harness to destroy
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return result


def test_a_peer_that_destroyed_its_group_fails_the_request_at_once():
    """(The request's own lock was released twice on that path, which raised "release
    unlocked lock" in place of the reason.)"""
    seconds, message = run_ranks(_peer_destroyed, 2, free_port(), timeout=120)[0]
    assert seconds < 5 and "asked rank 1 for its shards" in message and \
        "connection closed" in message, (seconds, message)
