"""The bench's measuring processes end with the bench: a bench killed from outside (``kill -9``, a CI timeout)
leaves neither its warm helper nor the run the helper forked computing on (``benchmarks.workers``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.workers import checkout_root

pytestmark = pytest.mark.slow

SLEEPER = textwrap.dedent("""
    import os, time

    def sleep(pid_file):
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(f"{os.getppid()} {os.getpid()}")
        os.replace(pid_file + ".tmp", pid_file)
        time.sleep(600)
""")

BENCH = textwrap.dedent("""
    import sys
    from benchmarks.workers import Workers

    Workers(threads=1).call("sleeper:sleep", {"pid_file": sys.argv[1]}, "a run that never ends")
""")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_bench_killed_from_outside_takes_its_helper_and_run_with_it(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "bench.py").write_text(BENCH)
    pid_file = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout_root()), str(tmp_path)]))
    bench = subprocess.Popen([sys.executable, str(tmp_path / "bench.py"), str(pid_file)], cwd=checkout_root(),
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists():
            assert bench.poll() is None, "the bench ended before its run started"
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        pids = [int(p) for p in pid_file.read_text().split()]  # the helper, the run it forked
        assert all(_alive(pid) for pid in pids)
        bench.kill()  # SIGKILL: the bench runs no cleanup of its own
        bench.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if _alive(pid)], "left running after the bench was killed"
    finally:
        for pid in [*pids, bench.pid]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_environment_given_reaches_every_run():
    """What the loss-limit section relies on: ``THP_MEM_ALLOC_ENABLE`` is in the environment torch starts with."""
    from benchmarks.workers import Workers

    workers = Workers(threads=1, env={"THP_MEM_ALLOC_ENABLE": "1"})
    try:
        assert workers.call("os:getenv", {"key": "THP_MEM_ALLOC_ENABLE"}, "getenv") == "1"
        assert workers.call("os:getenv", {"key": "OMP_NUM_THREADS"}, "getenv") == "1"
    finally:
        workers.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_run_goes_on_under_the_parent_it_was_given_and_ends_under_another():
    """The check compares with the parent's pid the caller knows (a bench may be pid 1 in a container: comparing
    with 1 would end every run there); a process already re-parented ends at once, with status 1."""
    from benchmarks.workers import die_with_parent

    def exit_status(expected_parent) -> int:
        pid = os.fork()
        if pid == 0:
            die_with_parent(expected_parent(os.getppid(), os.getpid()))
            os._exit(0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert exit_status(lambda parent, own: parent) == 0
    assert exit_status(lambda parent, own: own) == 1  # not its parent: as if re-parented already
