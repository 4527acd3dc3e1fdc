"""The first-use build of the CPU extension and its cache (zero_triton.native.ext), in fresh
processes: a build killed part-way, a truncated cached .so, a cache that cannot be
written, no compiler, and a lock held past the bound. Every child runs under a hard
timeout, so a hang fails the test instead of hanging the suite.

Each test gets its own cache (ZERO_TRITON_EXT_DIR). The children build at -O0
(ZERO_TRITON_EXT_CFLAGS): these tests check the build's machinery (lock, kill, checksum,
rename, trust), not the kernels' speed, and -O0 compiles in about 23 s of a core against
68 at -O3. Real builds are kept to one: the module fixture's, which kills one part-way
and rebuilds a truncated .so with three processes at once.
"""
import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dist_utils import run_python

from zero_triton.native import cache as ext_cache
from zero_triton.native import ext as _ext

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 300  # one real build in a child process, on a slow shared CI machine
QUICK_TIMEOUT = 90   # a child that builds nothing: import torch, step, exit

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("zero_triton._C") is not None,
    reason="a prebuilt zero_triton._C is installed, so the first-use build is never used")

STEP = textwrap.dedent("""
    import torch
    from zero_triton import FusedAdam
    p = torch.nn.Parameter(torch.ones(8))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(8)
    opt.step()
    print("backend", opt._shards.groups[0][0].backend, round(float(p.detach()[0]), 4))
""")


FAST = {"ZERO_TRITON_EXT_CFLAGS": "-O0"}  # the children's builds (the module's docstring)


def env_for(cache, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_TRITON_")}
    env["ZERO_TRITON_EXT_DIR"] = str(cache)
    env.update(FAST)
    env.update(extra)
    return env


def run(args, cache, timeout=QUICK_TIMEOUT, prefix=(), **extra):
    """``python ARGS`` in a process of its own, where zero_triton is imported afresh: forked
    with torch imported (``dist_utils.run_python``), or a real interpreter under ``prefix``."""
    start = time.monotonic()
    if prefix:
        proc = subprocess.run([*prefix, sys.executable, *args], capture_output=True, text=True,
                              cwd=REPO, timeout=timeout, env=env_for(cache, **extra))
    else:
        proc = run_python(args, cwd=REPO, timeout=timeout, env=env_for(cache, **extra))
    proc.seconds = time.monotonic() - start
    return proc


def said(stderr):
    """zero_triton's own lines on stderr."""
    return [line for line in stderr.splitlines() if "zero_triton" in line]


def cache_dir(cache, monkeypatch):
    """The folder the child processes use for these sources, under ``cache``."""
    monkeypatch.setenv("ZERO_TRITON_EXT_DIR", str(cache))
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    root = _ext.source_dir()
    return ext_cache.cache_dir(_ext._cpu_sources(root), root)


def no_compiler_env(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), "CXX": ""}


def bound_by_permissions():
    """A command prefix under which file permissions apply: nothing for a regular user;
    for root, setpriv without the capabilities that override them."""
    if os.geteuid() != 0:
        return []
    drop = "-dac_override,-dac_read_search"
    prefix = [shutil.which("setpriv") or "setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip(reason="running as root without setpriv: read-only folders are writable")
    return prefix


def needs_compiler():
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip(reason="no C++ compiler here (c++ / $CXX): the extension cannot be built")


TRUNCATED = 100_000  # bytes of the .so left by a copy that stopped part-way


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    """A first build SIGKILLed part-way (with its compilers) beside a truncated .so (a
    whole build's first 100000 bytes), then three processes started at once on that
    cache, as torchrun ranks would be: one ``zero_triton info``, two steps. One real
    build here in all (at -O0): the truncated .so is the first 100000 bytes of the
    suite's own first-use build (its checksum beside it), which the children's flags
    do not match, so only its bytes are used."""
    needs_compiler()
    whole = Path(_ext.load().__file__)  # this process's build, in the default cache
    cache = tmp_path_factory.mktemp("killed-build")
    with pytest.MonkeyPatch.context() as patch:
        expected = cache_dir(cache, patch)  # the folder of these sources at the children's flags
    log_path = cache.parent / "killed-build.log"
    # The compilers' temporary files (a killed cc1plus leaves its .s) in a folder of its own.
    scratch = tmp_path_factory.mktemp("killed-build-tmp")
    with open(log_path, "w") as log:
        victim = subprocess.Popen([sys.executable, "-c", STEP], cwd=REPO,
                                  env=env_for(cache, TMPDIR=str(scratch)),
                                  stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + QUICK_TIMEOUT
        while "compiling" not in log_path.read_text() and victim.poll() is None:
            assert time.monotonic() < deadline, "the build did not start: " + log_path.read_text()
            time.sleep(0.1)
        time.sleep(4)  # well into the compile, well before its end
        assert victim.poll() is None, "the build ended before it could be killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)  # its own session: the compilers too
        victim.wait()
    left = sorted(p.name for p in cache.glob("*/*"))
    (build_dir,) = cache.iterdir()
    assert build_dir == expected, (build_dir, expected)  # the same sources' folder
    so = build_dir / whole.name
    shutil.copy(whole.parent / "zero_triton_C.so.sha256", build_dir)
    shutil.copy(whole, so)
    with open(so, "r+b") as f:
        f.truncate(TRUNCATED)
    start = time.monotonic()
    commands = [["-m", "zero_triton", "info"], ["-c", STEP], ["-c", STEP]]
    ranks = [subprocess.Popen([sys.executable, *command], cwd=REPO, env=env_for(cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    outputs = []
    try:
        for rank in ranks:
            remaining = max(1.0, BUILD_TIMEOUT - (time.monotonic() - start))
            outputs.append((rank.communicate(timeout=remaining), rank.returncode))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    return {"cache": cache, "left": left, "outputs": outputs, "seconds": time.monotonic() - start}


def test_killed_build_blocks_nothing_and_concurrent_ranks_build_once(recovered):
    """(With a truncated .so: formerly also ``test_truncated_cached_so_is_said_in_one_line
    _and_rebuilt``, which rebuilt one of its own.) Every process runs, ``info`` too (a
    truncated .so once killed it with SIGBUS); one line in all says the .so is damaged
    and is compiled again (the others say they wait for it); the killed build's folder is gone; the .so is whole again and
    a later start says nothing."""
    left = recovered["left"]
    assert "zero_triton_C.so" not in left, f"the kill came too late: {left}"
    lines = []
    for (out, err), returncode in recovered["outputs"]:
        assert returncode == 0, err  # SIGBUS: -7
        lines += said(err)
        assert "falling back" not in err
    (info_out, _), _ = recovered["outputs"][0]
    assert "cpu      cpu    yes" in info_out, info_out
    for (out, err), _ in recovered["outputs"][1:]:
        assert "backend cpu 0.9" in out, (out, err)
    # One build, said once by whichever process took the lock; the others say they wait.
    damaged = [line for line in lines if "damaged" in line]
    assert len(damaged) == 1 and f"{TRUNCATED} bytes" in damaged[0], lines
    assert all("waiting for pid" in line for line in lines if line not in damaged), lines
    (build_dir,) = recovered["cache"].iterdir()
    names = sorted(p.name for p in build_dir.iterdir())
    # the killed build's private folder is cleaned up; nothing half-built remains
    assert names == ["build.lock", "zero_triton_C.so", "zero_triton_C.so.sha256"], names
    # whole: the size and sha256 recorded by the build that renamed it into place
    assert (build_dir / "zero_triton_C.so").stat().st_size > TRUNCATED
    assert ext_cache.damage(build_dir) is None, ext_cache.damage(build_dir)
    step = run(["-c", STEP], recovered["cache"])
    assert step.returncode == 0, step.stderr
    assert "backend cpu 0.9" in step.stdout
    assert said(step.stderr) == [], step.stderr


def test_truncated_cached_so_in_read_only_cache_is_skipped(recovered, tmp_path):
    prefix = bound_by_permissions()
    cache = tmp_path / "cache"
    shutil.copytree(recovered["cache"], cache)
    (so,) = cache.glob("*/zero_triton_C.so")
    with open(so, "r+b") as f:
        f.truncate(100_000)
    so.parent.chmod(0o555)
    try:
        step = run(["-c", STEP], cache, prefix=prefix)
    finally:
        so.parent.chmod(0o755)
    assert step.returncode == 0, (step.returncode, step.stderr)
    assert "backend torch 0.9" in step.stdout
    lines = said(step.stderr)
    assert len(lines) == 1, lines
    assert "damaged" in lines[0] and "cannot be written" in lines[0], lines


def test_unwritable_cache_is_said_once_in_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    step = run(["-c", STEP], blocker / "cache")  # mkdir fails, whoever runs this
    assert step.returncode == 0, step.stderr
    assert "backend torch 0.9" in step.stdout
    lines = step.stderr.strip().splitlines()
    assert len(lines) == 1, step.stderr
    assert "falling back to the plain torch step" in lines[0]
    assert "cannot be written" in lines[0] and "ZERO_TRITON_EXT_DIR" in lines[0], lines


def test_no_compiler_is_said_in_one_line_recorded_and_not_retried(tmp_path):
    cache = tmp_path / "cache"
    env = no_compiler_env(tmp_path)
    first = run(["-c", STEP], cache, **env)
    assert first.returncode == 0, first.stderr
    assert "backend torch 0.9" in first.stdout
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1, first.stderr  # not torch's "!! WARNING !!" banner, not twice
    assert "no C++ compiler" in lines[0] and "ZERO_TRITON_EXT_RETRY=1" in lines[0], lines
    (record,) = cache.glob("*/build-failed.json")

    second = run(["-c", STEP], cache, **env)
    assert second.returncode == 0, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert "earlier build" in lines[0] and "not retried" in lines[0], lines
    assert "no C++ compiler" in lines[0] and str(record) in lines[0], lines

    retried = run(["-c", STEP], cache, ZERO_TRITON_EXT_RETRY="1", **env)
    assert retried.returncode == 0, retried.stderr
    lines = retried.stderr.strip().splitlines()
    assert len(lines) == 1 and "building the CPU extension failed" in lines[0], lines


def test_lock_held_past_the_bound_is_not_waited_on_forever(tmp_path, monkeypatch):
    """A live owner that never finishes (hung, or on another host): wait at most
    ZERO_TRITON_EXT_TIMEOUT, then build separately (here: no compiler, so fall back)."""
    cache = tmp_path / "cache"
    build_dir = cache_dir(cache, monkeypatch)
    build_dir.mkdir(parents=True)
    with open(build_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(f"{os.getpid()} {socket.gethostname()} {time.time()}\n")
        lock.flush()
        step = run(["-c", STEP], cache, ZERO_TRITON_EXT_TIMEOUT="3", **no_compiler_env(tmp_path))
    assert step.returncode == 0, step.stderr
    assert "backend torch 0.9" in step.stdout
    lines = said(step.stderr)
    assert len(lines) == 3, lines
    assert f"waiting for pid {os.getpid()}" in lines[0], lines
    assert "after 3 s" in lines[1] and "building separately" in lines[1], lines
    assert "no C++ compiler" in lines[2], lines


# -- another user's files in the cache are never loaded, links never followed ------------------
def other_owner(path: Path) -> None:
    """Make ``path`` another user's (uid 65534, 'nobody'): root can, others cannot."""
    if os.geteuid() != 0:
        pytest.skip(reason="making a file of another owner needs root; the mode checks below "
                           "run for every user")
    os.chown(path, 65534, 65534, follow_symlinks=False)


def planted_cache(recovered, tmp_path):
    """A cache holding a whole, correctly checksummed extension (a real build)."""
    cache = tmp_path / "cache"
    shutil.copytree(recovered["cache"], cache)
    (so,) = cache.glob("*/zero_triton_C.so")
    return cache, so


@pytest.mark.parametrize("how", ["so of another user", "build folder of another user",
                                 "build folder writable by all", "cache folder writable by all"])
def test_a_cache_another_user_could_write_is_refused_in_one_line(recovered, tmp_path, how):
    """A .so with a matching .sha256 that another user could have put there (their file,
    their folder, or a folder anyone can write) is never loaded: one line says why and
    names the fix, and the plain torch step runs."""
    cache, so = planted_cache(recovered, tmp_path)
    if how == "so of another user":
        other_owner(so)
        other_owner(so.parent / "zero_triton_C.so.sha256")
    elif how == "build folder of another user":
        other_owner(so.parent)
    elif how == "build folder writable by all":
        so.parent.chmod(0o777)
    else:
        cache.chmod(0o777)
    step = run(["-c", STEP], cache)
    assert step.returncode == 0, step.stderr
    assert "backend torch 0.9" in step.stdout, (step.stdout, step.stderr)
    lines = step.stderr.strip().splitlines()
    assert len(lines) == 1 and "not trusted" in lines[0] and "ZERO_TRITON_EXT_DIR" in lines[0], lines


def test_a_planted_lock_link_truncates_nothing(tmp_path, monkeypatch):
    """build.lock planted as a link to another file: the file is left as it was."""
    cache = tmp_path / "cache"
    build_dir = cache_dir(cache, monkeypatch)
    build_dir.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "notes.txt"
    victim.write_text("a user's notes\n")
    (build_dir / "build.lock").symlink_to(victim)
    step = run(["-c", STEP], cache, **no_compiler_env(tmp_path))
    assert step.returncode == 0, step.stderr
    assert "backend torch 0.9" in step.stdout
    assert victim.read_text() == "a user's notes\n"
    lines = step.stderr.strip().splitlines()
    assert len(lines) == 1 and "not trusted" in lines[0] and "symbolic link" in lines[0], lines


def test_the_cache_folders_it_makes_are_private(tmp_path):
    cache = tmp_path / "cache"
    step = run(["-c", STEP], cache, **no_compiler_env(tmp_path))
    assert step.returncode == 0, step.stderr
    (build_dir,) = cache.iterdir()
    assert build_dir.stat().st_mode & 0o077 == 0, oct(build_dir.stat().st_mode)
    for f in build_dir.iterdir():
        assert f.stat().st_mode & 0o022 == 0, (f, oct(f.stat().st_mode))


def test_flags_of_ones_own_get_a_folder_of_their_own_and_bad_quoting_is_said(tmp_path, monkeypatch):
    """ZERO_TRITON_EXT_CFLAGS: part of the folder key (a -O0 build is never loaded for
    the default flags, nor the other way round); flags that cannot be split fall back to
    the plain step with one line that names the variable, before any build."""
    root = _ext.source_dir()
    sources = _ext._cpu_sources(root)
    monkeypatch.setenv("ZERO_TRITON_EXT_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ZERO_TRITON_EXT_CFLAGS", raising=False)
    default = ext_cache.cache_dir(sources, root)
    monkeypatch.setenv("ZERO_TRITON_EXT_CFLAGS", "-O0")
    assert ext_cache.jit_cflags()[-1] == "-O0"
    assert ext_cache.cache_dir(sources, root) != default
    step = run(["-c", STEP], tmp_path / "cache", ZERO_TRITON_EXT_CFLAGS='-O0 "-g')
    assert step.returncode == 0, step.stderr
    assert "backend torch 0.9" in step.stdout
    lines = step.stderr.strip().splitlines()
    assert len(lines) == 1 and "ZERO_TRITON_EXT_CFLAGS" in lines[0] and "quoting" in lines[0], lines
    assert not (tmp_path / "cache").exists()  # nothing built, nothing made
