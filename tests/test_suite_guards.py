"""The suite's own guards (tests/conftest.py): a test that hangs fails in bounded time by
name, and one that leaves a process running or a file in the repository fails."""
import shutil
import textwrap
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"


def _project(pytester, body):
    """A project of one test file beside a copy of this conftest."""
    (pytester.path / "tests").mkdir()
    shutil.copy(CONFTEST, pytester.path / "tests" / "conftest.py")
    (pytester.path / "tests" / "test_inner.py").write_text(textwrap.dedent(body))


def test_a_leaked_process_and_a_file_in_the_repository_fail_the_test_by_name(pytester):
    _project(pytester, """
        import subprocess, time
        from pathlib import Path

        def test_leaves_a_process():
            subprocess.Popen(["sleep", "60"])

        def test_writes_into_the_repository():
            (Path(__file__).resolve().parents[1] / "stray.txt").write_text("x")

        def test_cleans_up():
            proc = subprocess.Popen(["sleep", "60"])
            proc.kill(); proc.wait()
    """)
    result = pytester.runpytest_subprocess("tests", "-p", "no:cacheprovider", "-p", "no:xdist")
    out = result.stdout.str()
    result.assert_outcomes(passed=3, errors=2)
    assert "test_leaves_a_process left 1 process(es) running (killed now): ['sleep 60']" in out, out
    assert "test_writes_into_the_repository wrote into the repository: ['stray.txt']" in out, out


def test_a_hung_test_fails_by_name_within_its_bound(pytester, monkeypatch):
    _project(pytester, """
        import threading

        def test_waits_forever():
            threading.Event().wait()
    """)
    monkeypatch.setenv("ZT_TEST_HANG_S", "2")
    result = pytester.runpytest_subprocess("tests", "-p", "no:cacheprovider", "-p", "no:xdist",
                                           timeout=60)
    err = result.stderr.str()
    assert result.ret != 0
    assert "tests/test_inner.py::test_waits_forever ran past 2 s (ZT_TEST_HANG_S): it hangs" in err, err
    assert "test_waits_forever" in err.split("ran past", 1)[1], err  # its stack
