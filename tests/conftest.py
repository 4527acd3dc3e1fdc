"""Shared test setup.

Triton kernels run on CPU tensors only under the interpreter, which Triton reads when
a kernel is decorated: set it before anything imports zero_triton.kernels. A GPU run
that wants compiled kernels sets TRITON_INTERPRET=0 explicitly (bench/gpu_check.sh).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The commands' CPU ranks (demo, profile, bench/e2e.py, memory --measure) fork from a
# server that imported torch once instead of importing it each (~4 s of a core a rank):
# the tests check what the commands print and write, not resident sets against a fresh
# process. test_memory's measurement spawns them as the command does by default.
os.environ.setdefault("ZERO_TRITON_RANK_START", "forkserver")
# torch.compile's inductor compiles in worker processes it starts as fresh interpreters
# (a dozen per compiled test, ~2.5 s of a core each to import torch): compile in the
# process instead. The compiled code is the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import faulthandler  # noqa: E402
import fnmatch  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A test that runs longer than this (setup, call and teardown) hangs: its name and every
# thread's stack go to stderr and its process ends, which fails it by name (under
# pytest-xdist the worker is replaced and the run goes on). The slowest test takes ~70 s
# on two busy cores; every wait inside the tests has a bound of its own below this.
HANG_S = float(os.environ.get("ZT_TEST_HANG_S", "600"))
# What a test leaves behind: processes still running after it (beyond LINGER_S), and
# files in the repository's folders that .gitignore does not name.
LINGER_S = 5.0
WATCHED = ("", "tests", "bench", "docs", "zero_triton")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    def hung():
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # the real stderr, not the test's captured one
            capture.suspend_global_capture(in_=False)
        sys.stderr.write(f"\n{item.nodeid} ran past {HANG_S:g} s (ZT_TEST_HANG_S): it hangs; "
                         "its threads' stacks follow and its process ends\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)
    watch = threading.Timer(HANG_S, hung)
    watch.daemon = True
    watch.start()
    # Where the watch cannot run (a thread holding the GIL forever): the stacks alone.
    faulthandler.dump_traceback_later(HANG_S + 30, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        watch.cancel()


# The longest files first (seconds on two busy cores, slowest first), so that the
# workers, which take a file at a time in this order, end together.
LONGEST_FIRST = ("test_overlap.py", "test_reliability.py", "test_ext_cache.py", "test_serve.py",
                 "test_offload.py", "test_ecosystem.py", "test_fsdp2_blocks.py", "test_drop_in.py",
                 "test_e2e_bench.py", "test_exit.py", "test_profile.py", "test_lowbit_bench.py",
                 "test_hybrid.py", "test_cli.py", "test_bench.py", "test_dtensor.py", "test_zero.py",
                 "test_user_scripts.py", "test_compressed.py", "test_checkpoint.py",
                 "test_checkpoint_hardening.py", "test_cli_errors.py", "test_int8.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def _ignored() -> list:
    lines = (REPO / ".gitignore").read_text().splitlines() if (REPO / ".gitignore").exists() else []
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


_IGNORED = _ignored()


def _repo_files() -> set:
    names = set()
    for folder in WATCHED:
        try:
            entries = os.listdir(REPO / folder)
        except OSError:
            continue
        for name in entries:
            path = f"{folder}/{name}" if folder else name
            if not any(fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(path, pat) for pat in _IGNORED):
                names.add(path)
    return names


def _descendants(pid: int) -> dict:
    """pid -> command line of every live (not zombie) process below ``pid``."""
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                if state != "Z":
                    found[child] = cmd.decode(errors="replace").strip()[:160]
                todo.append(child)
    return found


def _helpers() -> set:
    """multiprocessing's forkserver and resource tracker: started once, kept for the run
    (the ranks the forkserver forks are not helpers)."""
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt
    pids = {getattr(fs._forkserver, "_forkserver_pid", None),
            getattr(rt._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


@pytest.fixture(autouse=True)
def _leaves_nothing(request):
    """Fails a test that leaves a process running (it is killed) or a file in the
    repository (tests write under tmp_path)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    procs, files = set(_descendants(os.getpid())), _repo_files()
    yield
    deadline = time.monotonic() + LINGER_S
    while True:
        left = {p: c for p, c in _descendants(os.getpid()).items()
                if p not in procs and p not in _helpers()}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    written = sorted(_repo_files() - files)
    problems = [f"left {len(left)} process(es) running (killed now): {sorted(left.values())}"] if left else []
    problems += [f"wrote into the repository: {written}"] if written else []
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)


def cuda_present() -> bool:
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")


def devices():
    """cpu always, cuda when there."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def protocol_methods(protocol) -> list:
    """The public methods a typing Protocol declares."""
    import inspect
    return [name for name, member in vars(protocol).items()
            if inspect.isfunction(member) and not name.startswith("_")]


def assert_signature(impl, protocol, method: str) -> None:
    """``impl.method`` takes exactly the parameters (names, kinds, defaults) that
    ``protocol.method`` declares."""
    import inspect
    want = inspect.signature(getattr(protocol, method))
    got = inspect.signature(getattr(impl, method))
    strip = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
    assert strip(got) == strip(want), \
        f"{impl.__name__}.{method}{got} is not {protocol.__name__}.{method}{want}"
