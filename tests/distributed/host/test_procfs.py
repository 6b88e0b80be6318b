"""host/procfs.py: a process's state, children and command line as /proc gives them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")


def _wait_for(check, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, "the state was not reached"
        time.sleep(0.01)


def test_a_child_is_seen_running_stopped_and_then_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**os.environ, "TP_PROCFS_MARK": "yes"})
    try:
        assert procfs.alive(child.pid) and not procfs.stopped(child.pid)
        assert child.pid in procfs.children(os.getpid())
        # the child's words are its own once it has run exec (empty for a moment before)
        _wait_for(lambda: procfs.cmdline(child.pid)[1:] == ["-c", "import time; time.sleep(30)"])
        assert procfs.environ(child.pid)["TP_PROCFS_MARK"] == "yes"
        assert procfs.comm(child.pid) == Path(sys.executable).name[:15]
        child.send_signal(signal.SIGSTOP)
        _wait_for(lambda: procfs.stopped(child.pid))
        child.send_signal(signal.SIGKILL)
        _wait_for(lambda: procfs.state(child.pid) == "Z")  # ended, not yet reaped
        assert not procfs.alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert procfs.state(child.pid) is None and not procfs.alive(child.pid)
    assert procfs.children(child.pid) == [] and procfs.cmdline(child.pid) == []


def test_a_command_name_with_spaces_and_parentheses_is_split_at_its_last_parenthesis(tmp_path):
    odd = tmp_path / "a (b) c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        _wait_for(lambda: procfs.state(child.pid) in ("S", "R"))
        assert procfs.stat_fields(child.pid)[1] == str(os.getpid())  # the parent pid
    finally:
        child.kill()
        child.wait()


def test_cpu_time_is_counted_for_a_process_and_its_descendants():
    # a child that starts a grandchild spinning for 0.3 s of CPU, then both sleep
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time\\n"
            "while time.process_time() < 0.3: pass\\ntime.sleep(30)'])\n"
            "time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(lambda: procfs.children(child.pid))
        grandchild = procfs.children(child.pid)[0]
        _wait_for(lambda: procfs.cpu_seconds(grandchild) >= 0.25)  # ticks of 10 ms: 0.29 too
        assert procfs.tree_cpu_seconds(child.pid) >= 0.25 + procfs.cpu_seconds(child.pid)
        assert procfs.cpu_seconds(child.pid) < 0.3  # the child itself only slept
        assert procfs.cpu_seconds(2**22 + 1) == 0.0  # no such process
    finally:
        for pid in procfs.children(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
