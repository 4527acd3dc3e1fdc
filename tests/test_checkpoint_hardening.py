"""Checkpoints under adversarial use: what save may delete, what load verifies, what is
refused. One test per kind of attack or accident; the numbers are the hardening list's
(data loss 1-3, silent corruption 4-6, reaching outside / hangs / unclear errors 7-10)."""
import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_python, run_ranks  # noqa: E402
from test_checkpoint import (_assert_untouched, _snapshot, assert_state_equal,  # noqa: E402
                             full_state, make, synthetic_steps)

from zero_triton import ZeroAdam, checkpoint  # noqa: E402
from zero_triton.checkpoint import CheckpointError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def hard_timeout():
    """A load that waits on a FIFO or reads /dev/zero used to hang: fail instead (SIGALRM
    interrupts a blocking open or read in this process)."""
    def expired(signum, frame):
        raise TimeoutError("the test ran past its hard timeout of 240 s (a hang)")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def saved(tmp_path, name="ck", steps=2, **kw):
    net, opt = make()
    synthetic_steps(opt, 0, steps)
    checkpoint.save(tmp_path / name, opt, net, **kw)
    return net, opt


def manifest_of(ck):
    return json.loads((ck / "manifest.json").read_text())


def reseal(ck, manifest):
    """Write ``manifest`` with a valid checksum, as an adversary who knows the format
    would: what validation must catch on its own."""
    manifest = {k: v for k, v in manifest.items() if k != "checksum"}
    (ck / "manifest.json").write_bytes(checkpoint.manifest.seal(manifest))


def target(seed=5):
    net, opt = make(seed=seed)
    synthetic_steps(opt, 0, 1)
    return net, opt, _snapshot(net, opt)


def cli(*args, timeout=60):
    """``python -m zero_triton checkpoint ...`` in a process of its own with a hard timeout
    (forked with torch imported: ``dist_utils.run_python``)."""
    return run_python(["-m", "zero_triton", "checkpoint", *args], timeout=timeout, cwd=ROOT)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


# -- 1. save replaces only what is provably a checkpoint ---------------------------------------
def test_1_save_never_replaces_a_directory_it_did_not_write(tmp_path):
    net, opt = make()
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text("{}")
    (app / "src.py").write_text("x")
    with pytest.raises(CheckpointError, match="not a valid zero_triton checkpoint manifest"):
        checkpoint.save(app, opt, net)
    assert (app / "src.py").read_text() == "x" and (app / "manifest.json").read_text() == "{}"

    # a real checkpoint with one file of the user's in it is not ours any more
    ck = tmp_path / "ck"
    saved(tmp_path)
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds entries a checkpoint does not \(notes.txt\)"):
        checkpoint.save(ck, opt, net)
    assert (ck / "notes.txt").read_text() == "mine"
    # a directory where a data file should be, holding the user's files
    (ck / "notes.txt").unlink()
    (ck / "extra.pt").mkdir()
    (ck / "extra.pt" / "keep").write_text("k")
    with pytest.raises(CheckpointError, match=r"holds entries a checkpoint does not \(extra.pt\)"):
        checkpoint.save(ck, opt, net)
    assert (ck / "extra.pt" / "keep").exists()
    shutil.rmtree(ck / "extra.pt")
    # a symlink to a directory is not replaced either (the rename would replace the link)
    (tmp_path / "link").symlink_to(ck)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        checkpoint.save(tmp_path / "link", opt, net)
    # an empty directory and an intact checkpoint are replaced
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", opt, net)
    checkpoint.save(ck, opt, net)
    assert sorted(os.listdir(tmp_path)) == ["app", "ck", "empty", "link"]

    # a checkpoint of format version 1 (before the seal) is ours too: a save replaces it;
    # load refuses it, saying how to carry it over
    m = manifest_of(ck)
    m["version"] = 1
    for key in ("checksum", "save_id", "time", "model_extra", "extra"):
        m.pop(key)
    (ck / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="format version 1; .* with the zero_triton that wrote it"):
        checkpoint.load(ck, opt, net)
    checkpoint.save(ck, opt, net)
    assert manifest_of(ck)["version"] == checkpoint.VERSION


# -- 2. what save removes and what load falls back to --------------------------------------------
def test_2_cleanup_and_fallback_touch_only_our_own_leftovers(tmp_path):
    net, opt = saved(tmp_path)
    ck = tmp_path / "ck"
    users = {"ck.old-backup-2024": "a backup", "ck.tmp-1234": "a work dir",
             "ck.old-0123456789abcdef": "named like ours, holding a user's file",
             "ck.tmp-fedcba9876543210": "named like ours, no marker"}
    for name, text in users.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text(text)
    (tmp_path / "ck.tmp-fedcba9876543210" / "rank00000.bin").write_bytes(b"?")
    checkpoint.save(ck, opt, net)
    checkpoint.save(ck, opt, net)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", *users]), os.listdir(tmp_path)
    for name, text in users.items():
        assert (tmp_path / name / "data.txt").read_text() == text

    # load never falls back to a user's copy, even one holding a valid checkpoint
    shutil.copytree(ck, tmp_path / "ck.old-backup-2024" / "inner")
    for f in os.listdir(ck):
        shutil.copy(ck / f, tmp_path / "ck.old-backup-2024" / f)
    os.remove(tmp_path / "ck.old-backup-2024" / "data.txt")
    shutil.rmtree(tmp_path / "ck.old-backup-2024" / "inner")
    shutil.rmtree(ck)
    net2, opt2 = make(seed=3)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(ck, opt2, net2)

    # ... but does fall back to ours: PATH.old-<its save id>, left between the two renames
    checkpoint.save(ck, opt, net)
    sid = manifest_of(ck)["save_id"]
    os.rename(ck, tmp_path / f"ck.old-{sid}")
    checkpoint.load(ck, opt2, net2)
    assert_state_equal(full_state(opt2), full_state(opt), "fallback to ck.old-<save id>")
    # a directory that exists without a manifest is not a reason to fall back
    ck.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(ck, opt2, net2)
    checkpoint.save(ck, opt, net)  # replaces the empty one, removes our ck.old-<sid>
    assert not (tmp_path / f"ck.old-{sid}").exists()
    assert (tmp_path / "ck.old-backup-2024" / "manifest.json").exists()


# -- 3. extra that load could not read is refused before anything is written ----------------------
def test_3_extra_that_would_not_load_is_refused_up_front(tmp_path):
    net, opt = saved(tmp_path, extra={"epoch": 1})
    ck = tmp_path / "ck"
    before = (ck / "manifest.json").read_bytes()
    args = argparse.Namespace(lr=0.1, name="run")
    cases = [({"args": args}, r"extra\['args'\] \(Namespace\)"),
             ({"cfg": {"deep": [1, args]}}, r"extra\['cfg'\]\['deep'\]\[1\] \(Namespace\)"),
             ({"f": lambda: 1}, r"extra\['f'\] \(function\)")]
    for extra, where in cases:
        with pytest.raises(CheckpointError, match=where + ".*vars\\(args\\).*nothing was written"):
            checkpoint.save(ck, opt, net, extra=extra)
        assert (ck / "manifest.json").read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["ck"]
    with pytest.raises(CheckpointError, match=r"extra \(Namespace\)"):
        checkpoint.save(tmp_path / "new", opt, net, extra=args)
    assert not (tmp_path / "new").exists()
    # plain data (vars(args)) saves and loads
    checkpoint.save(ck, opt, net, extra={"args": vars(args), "rng": torch.get_rng_state()})
    net2, opt2 = make(seed=1)
    assert checkpoint.load(ck, opt2, net2)["args"] == {"lr": 0.1, "name": "run"}


# -- 4. the manifest seals itself; files are tied to their save --------------------------------------
def test_4_tampered_manifest_and_mixed_files_are_refused(tmp_path):
    net, opt = saved(tmp_path, extra={"epoch": 1})
    ck = tmp_path / "ck"
    tnet, topt, before = target()
    good = (ck / "manifest.json").read_bytes()

    m = manifest_of(ck)
    seg = m["files"]["rank00000.bin"]["segments"][1]
    seg["offset"] -= 100  # the "offset": 332 -> 232
    (ck / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="checksum mismatch in .*manifest.json"):
        checkpoint.load(ck, topt, tnet)
    _assert_untouched(tnet, topt, before, "changed offset")
    assert_one_line_error(cli("inspect", ck), "checksum mismatch in", "manifest.json")

    for record in ("model_extra.pt", "extra.pt"):  # renaming a record hid a file
        m = manifest_of(ck)
        m["files"]["renamed.pt"] = m["files"].pop(record)
        (ck / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            checkpoint.load(ck, topt, tnet)
        reseal(ck, m)
        with pytest.raises(CheckpointError, match="field files"):
            checkpoint.load(ck, topt, tnet)
    _assert_untouched(tnet, topt, before, "renamed records")

    # a file of another save of the same model, its record copied too and the manifest resealed
    (ck / "manifest.json").write_bytes(good)
    saved(tmp_path, "other", steps=3)
    other = manifest_of(tmp_path / "other")
    m = manifest_of(ck)
    m["files"]["rank00000.bin"] = other["files"]["rank00000.bin"]
    shutil.copy(tmp_path / "other" / "rank00000.bin", ck / "rank00000.bin")
    reseal(ck, m)
    with pytest.raises(CheckpointError, match="rank00000.bin .* belongs to another save"):
        checkpoint.load(ck, topt, tnet)
    _assert_untouched(tnet, topt, before, "a file from another save")
    assert cli("inspect", ck).returncode == 1


def test_4_single_bit_flips_of_the_manifest_never_load_a_wrong_state(tmp_path):
    net, opt = saved(tmp_path)
    ck = tmp_path / "ck"
    want = full_state(opt)
    good = (ck / "manifest.json").read_bytes()
    rng = random.Random(0)
    flips = rng.sample(range(len(good) * 8), 400)
    loaded = refused = 0
    for bit in flips:
        data = bytearray(good)
        data[bit // 8] ^= 1 << (bit % 8)
        (ck / "manifest.json").write_bytes(bytes(data))
        tnet, topt = make(seed=5)
        try:
            checkpoint.load(ck, topt, tnet)
        except CheckpointError:
            refused += 1
            continue
        loaded += 1  # e.g. 1e-05 -> 1E-05: the same JSON; the state must be the exact one
        assert_state_equal(full_state(topt), want, f"flip of bit {bit}")
    assert refused >= 390, (loaded, refused)


# -- 5. the whole manifest is checked against itself and the optimizer ---------------------------------
def test_5_inconsistent_manifests_are_refused_before_reading(tmp_path):
    net, opt = saved(tmp_path)
    ck = tmp_path / "ck"
    tnet, topt, before = target()
    good = manifest_of(ck)

    def refused(edit, match):
        m = json.loads(json.dumps(good))
        edit(m)
        reseal(ck, m)
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError, match=match):
            checkpoint.load(ck, topt, tnet)
        assert time.perf_counter() - t0 < 10
        _assert_untouched(tnet, topt, before, match)

    segs = lambda m: m["files"]["rank00000.bin"]["segments"]  # noqa: E731
    refused(lambda m: segs(m)[1].update(start=-4), r"segments\[1\].start is -4")
    refused(lambda m: m["flats"][0].update(states=["master"] * 10**6), r"flats\[0\].states has 1000000")
    refused(lambda m: m["flats"][0].update(states=["master", "master", "exp_avg"]), r"flats\[0\].states")

    def drop_exp_avg_sq(m):
        m["flats"][0]["states"].remove("exp_avg_sq")
        kept = [s for s in segs(m) if not (s["flat"] == 0 and s["state"] == "exp_avg_sq")]
        segs(m)[:] = kept
    refused(drop_exp_avg_sq, r"flats\[0\].states .* must name each of")

    def twice(m):  # exp_avg_sq covered twice, exp_avg not at all
        segs(m)[1]["state"] = "exp_avg_sq"
    refused(twice, r"covered twice|exp_avg of flat buffer 0 only up to element 0")
    refused(lambda m: segs(m)[0].update(start=1), r"segments\[1\].offset|not covered")
    refused(lambda m: m["params"][0].update(offset=1), r"params\[0\]|different model")
    refused(lambda m: m["flats"][0].update(numel=m["flats"][0]["numel"] + 1), r"files|numel|segments")


# -- 6. all or nothing, hyperparameters included ----------------------------------------------------
def test_6_load_is_all_or_nothing_and_checks_hyperparameters(tmp_path):
    net, opt = make()
    opt.param_groups[0]["lr"] = 0.01
    synthetic_steps(opt, 0, 2)
    checkpoint.save(tmp_path / "ck", opt, net)
    ck = tmp_path / "ck"
    good = manifest_of(ck)
    tnet, topt = make(seed=5)
    topt.param_groups[0]["lr"] = 5e-4
    synthetic_steps(topt, 0, 5)
    before = _snapshot(tnet, topt)

    def refused(edit, match):
        m = json.loads(json.dumps(good))
        edit(m)
        reseal(ck, m)
        with pytest.raises(CheckpointError, match=match):
            checkpoint.load(ck, topt, tnet)
        _assert_untouched(tnet, topt, before, match)
        assert topt.param_groups[0]["lr"] == 5e-4

    def weights_numel(m):
        m["files"]["model.bin"]["segments"][0]["numel"] += 1
    refused(weights_numel, r"model.bin.*segments\[0\]")
    refused(lambda m: m["param_groups"][0].update(lr="0.01"), r"param_groups\[0\].lr must be")
    refused(lambda m: m["param_groups"][0].update(lr=float("nan")), r"param_groups\[0\].lr is nan")
    refused(lambda m: m["param_groups"][0].update(lr=-1), r"param_groups\[0\].lr is -1")
    refused(lambda m: m["param_groups"][1].update(betas=[0.9]), r"param_groups\[1\].betas has 1")
    refused(lambda m: m["param_groups"][1].update(betas=[0.9, 1.5]), r"betas\[1\] is 1.5")
    refused(lambda m: m["param_groups"][1].update(amsgrad="yes"), r"amsgrad must be bool")
    refused(lambda m: m["flats"][1].update(step=float("inf")), r"flats\[1\].step")


# -- 7. nothing outside the directory, regular files only --------------------------------------------
@pytest.mark.parametrize("tool", ["load", "inspect", "consolidate"])
def test_7_names_links_fifos_and_devices_are_refused(tmp_path, tool):
    saved(tmp_path)
    ck = tmp_path / "ck"
    good = manifest_of(ck)
    rank0 = (ck / "rank00000.bin").read_bytes()
    (tmp_path / "outside.bin").write_bytes(rank0)

    def attempt(match):
        if tool == "load":
            tnet, topt, before = target()
            with pytest.raises(CheckpointError, match=match):
                checkpoint.load(ck, topt, tnet)
            _assert_untouched(tnet, topt, before, match)
        elif tool == "inspect" and "manifest" not in match:  # a FAILED row, exit status 1
            proc = cli("inspect", ck, timeout=60)  # a FIFO or /dev/zero used to hang here
            assert proc.returncode == 1 and "FAILED" in proc.stdout, (proc.stdout, proc.stderr)
            assert re.search(match, proc.stdout), (match, proc.stdout)
        else:
            args = [tool, ck] + ([tmp_path / "out.pt"] if tool == "consolidate" else [])
            proc = cli(*args, timeout=60)
            assert_one_line_error(proc)
            assert re.search(match, proc.stderr), (match, proc.stderr)

    for name in ("../outside.bin", str(tmp_path / "outside.bin"), "/etc/passwd", "sub/rank00000.bin"):
        m = json.loads(json.dumps(good))
        m["files"][name] = m["files"].pop("rank00000.bin")
        reseal(ck, m)
        if tool == "inspect":  # inspect refuses before printing any size of such a file
            proc = cli("inspect", ck)
            assert_one_line_error(proc, "field files")
            assert "passwd" not in proc.stdout
        else:
            attempt("field files")
    reseal(ck, good)

    (ck / "rank00000.bin").unlink()
    (ck / "rank00000.bin").symlink_to(tmp_path / "outside.bin")
    attempt("rank00000.bin .* is a symbolic link")
    (ck / "rank00000.bin").unlink()
    os.mkfifo(ck / "rank00000.bin")
    attempt("rank00000.bin .* is a FIFO")
    (ck / "rank00000.bin").unlink()
    (ck / "rank00000.bin").symlink_to("/dev/zero")
    attempt("rank00000.bin .* is a symbolic link")
    (ck / "rank00000.bin").unlink()
    (ck / "rank00000.bin").write_bytes(rank0)
    (ck / "manifest.json").rename(tmp_path / "manifest.json")
    os.mkfifo(ck / "manifest.json")
    attempt("manifest .* is a FIFO")


# -- 8. crafted manifests: a CheckpointError naming the field, never a raw exception ------------------
CRAFTED = [
    (lambda m: m["files"]["rank00000.bin"].update(chunk_bytes=0), r"chunk_bytes is 0"),
    (lambda m: m["files"]["rank00000.bin"].update(chunk_bytes=10**15), r"chunk_bytes is 1000000000000000"),
    (lambda m: m["files"]["rank00000.bin"].update(chunk_bytes=4.5), r"chunk_bytes must be int"),
    (lambda m: m["flats"][0].update(numel=10**12), r"numel|offset|segments|files"),
    (lambda m: m["params"][0].update(shape=[10**6, 10**6]), r"params\[0\]"),
    (lambda m: m["files"]["rank00000.bin"]["segments"][0].update(offset=-5), r"segments\[0\].offset"),
    (lambda m: m["files"]["model.bin"].pop("segments"), r"model.bin'\]\.segments is missing"),
    (lambda m: m.pop("flats"), r"field flats is missing"),
    (lambda m: m.update(params={"a": 1}), r"field params must be list"),
    (lambda m: m["params"].append(3), r"params\[5\]"),
    (lambda m: m["files"]["rank00000.bin"].update(chunk_crc32=[]), r"chunk_crc32 has 0 entries"),
    (lambda m: m["files"]["rank00000.bin"].update(rank="0"), r"rank must be int"),
    (lambda m: m["flats"][0].update(dtype="int8"), r"flats\[0\].dtype"),
    (lambda m: m["params"][0].update(dtype="os.system"), r"params\[0\].dtype"),
    (lambda m: m.update(world_size=0), r"world_size is 0"),
    (lambda m: m.update(save_id=None), r"save_id must be str"),
    (lambda m: m["flats"][1].update(param_steps=[1]), r"param_steps"),
]


def test_8_crafted_manifests_raise_checkpoint_errors_naming_the_field(tmp_path):
    saved(tmp_path)
    ck = tmp_path / "ck"
    good = manifest_of(ck)
    tnet, topt, before = target()
    for edit, match in CRAFTED:
        m = json.loads(json.dumps(good))
        edit(m)
        reseal(ck, m)
        with pytest.raises(CheckpointError, match=match) as info:
            checkpoint.load(ck, topt, tnet)
        assert "manifest.json" in str(info.value), str(info.value)
        with pytest.raises(CheckpointError, match=match):
            checkpoint.consolidate(ck)
        with pytest.raises(CheckpointError, match=match):
            checkpoint.verify(ck)
    _assert_untouched(tnet, topt, before, "crafted manifests")
    # the command line: one line each, no traceback (a subprocess for two of them)
    for edit, match in CRAFTED[:2]:
        m = json.loads(json.dumps(good))
        edit(m)
        reseal(ck, m)
        assert_one_line_error(cli("consolidate", ck, tmp_path / "o.pt"), "field")
    (ck / "manifest.json").write_text("[1, 2")
    assert_one_line_error(cli("consolidate", ck, tmp_path / "o.pt"), "cannot read", "manifest.json")
    (ck / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    assert_one_line_error(cli("inspect", ck), "manifest.json")


# -- 9. any exception on any rank reaches every rank ---------------------------------------------------
def _errors_on_one_rank(rank, world_size, path):
    out = {}
    net, opt = make(ZeroAdam)
    synthetic_steps(opt, 0, 1)
    checkpoint.save(path, opt, net, extra={"epoch": 1})
    t0 = time.monotonic()
    try:  # rank 0 alone pickles extra: a lambda used to leave rank 1 in all_gather_object
        checkpoint.save(path, opt, net, extra={"f": lambda: 1} if rank == 0 else None)
    except CheckpointError as exc:
        out["lambda"] = (str(exc), time.monotonic() - t0)
    dist.barrier()
    if rank == 0:  # rank 1's record goes bad (resealed): only rank 1 reads it at world size 2
        ck = checkpoint.resolve(path)[0]
        m = json.loads(open(os.path.join(ck, "manifest.json")).read())
        m["files"]["rank00001.bin"]["chunk_crc32"] = []
        m.pop("checksum")
        open(os.path.join(ck, "manifest.json"), "wb").write(checkpoint.manifest.seal(m))
    dist.barrier()
    t0 = time.monotonic()
    try:
        checkpoint.load(path, opt, net)
    except CheckpointError as exc:
        out["crc"] = (str(exc), time.monotonic() - t0)
    checkpoint.save(path, opt, net)  # a good one again
    dist.barrier()
    real = checkpoint.protocol.read_model_flat
    if rank == 1:  # an exception of a type nobody expects, on one rank
        def broken(*args):
            raise IndexError("list index out of range")
        checkpoint.protocol.read_model_flat = broken
    t0 = time.monotonic()
    try:
        checkpoint.load(path, opt, net)
    except CheckpointError as exc:
        out["index"] = (str(exc), time.monotonic() - t0)
    checkpoint.protocol.read_model_flat = real
    return out


def test_9_any_error_on_any_rank_reaches_every_rank_fast(tmp_path):
    # the process group's own timeout is 10 minutes: only the protocol can end these quickly
    r0, r1 = run_ranks(_errors_on_one_rank, 2, str(tmp_path / "ck"), timeout=120, pg_timeout_s=600)
    for rank, out in enumerate((r0, r1)):
        assert set(out) == {"lambda", "crc", "index"}, (rank, out)
        for key, (msg, seconds) in out.items():
            assert seconds < 20, (rank, key, seconds)
        assert "extra['f'] (function)" in out["lambda"][0], out["lambda"]
        assert "chunk_crc32 has 0 entries" in out["crc"][0], out["crc"]
        assert ("failed on rank 1 while reading" in out["index"][0]
                and "IndexError" in out["index"][0]), out["index"]
    assert "failed on rank 0 while starting" in r1["lambda"][0], r1["lambda"]


# -- 10. two jobs, one path -------------------------------------------------------------------------------
def _saver(path, count, seed, queue):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    failures = []
    net, opt = make(seed=seed)
    for i in range(count):
        synthetic_steps(opt, i, 1)
        try:
            checkpoint.save(path, opt, net, extra={"who": seed, "i": i})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            failures.append(f"{type(exc).__name__}: {exc}")
    queue.put(("saver", seed, failures))


def _loader(path, seconds, queue):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    net, opt = make(seed=9)
    ok, failures, deadline = 0, [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            checkpoint.load(path, opt, net)
            ok += 1
        except CheckpointError as exc:
            failures.append(str(exc))
    queue.put(("loader", ok, failures))


def test_10_concurrent_saves_are_serialised_and_loads_never_see_a_mix(tmp_path):
    path = str(tmp_path / "ck")
    saved(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_saver, args=(path, 12, seed, queue)) for seed in (1, 2)]
    procs.append(ctx.Process(target=_loader, args=(path, 6, queue)))
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for kind, who, failures in results:
        if kind == "saver":
            assert failures == [], failures[:3]
        else:
            assert who > 0, "the loader never loaded"
            # a swap under a load is retried; what cannot be is said as such, never as corruption
            assert not [f for f in failures if "corrupt" in f or "checksum" in f], failures[:3]
    assert sorted(os.listdir(tmp_path)) == ["ck"], os.listdir(tmp_path)
    net, opt = make(seed=3)
    assert checkpoint.load(path, opt, net)["i"] == 11

    # a save that cannot get the lock in time says who holds it
    from zero_triton.checkpoint.directory import SaveLock
    with SaveLock(path, timeout=1):
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"another save to .*ck is in progress \(process "
                                                  rf"{os.getpid()} on"):
            checkpoint.save(path, opt, net, lock_timeout=0.5)
        assert time.monotonic() - t0 < 5
    checkpoint.save(path, opt, net)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
