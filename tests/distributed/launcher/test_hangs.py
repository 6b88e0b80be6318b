"""Ranks alive but stuck: stopped by a signal, or with a main thread that does not move."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tensorplay.distributed.launcher import hangs as _hangs
from tests import spawn, timing

LAUNCHER = [sys.executable, "-m", "tensorplay.distributed.run"]


def test_a_stopped_process_is_seen_stopped_and_a_running_one_is_not():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not procfs.stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not procfs.stopped(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watch = _hangs.HangWatch(stopped_s=2.0, hang_s=None)
        assert watch.hung({0: proc.pid}, now=100.0) == {}  # first seen stopped
        assert watch.hung({0: proc.pid}, now=101.9) == {}
        assert watch.hung({0: proc.pid}, now=102.5) == {
            0: "its process was stopped (SIGSTOP) for 2.5 s"}
    finally:
        proc.kill()
        proc.wait()


def test_the_beat_counts_the_collectives_made_in_the_current_world(monkeypatch):
    import numpy as np

    import tensorplay.distributed as dist
    from tensorplay.distributed.job import lifecycle
    from tensorplay.distributed.launcher import rank_main as _rank_main

    assert _rank_main._collectives_made() == 0  # no world
    dist.init_process_group("fake", rank=0, world_size=2)
    world = lifecycle._WORLD
    try:
        for _ in range(3):
            dist.all_reduce(np.ones(2))
        assert _rank_main._collectives_made() == 3
    finally:
        dist.destroy_process_group()
    # the beat thread may read a world the main thread is tearing down: its registry
    # released, it counts 0, with no error to catch
    monkeypatch.setattr(lifecycle, "_WORLD", world)
    assert world is not None and world.registry.released
    assert _rank_main._collectives_made() == 0


def test_beats_name_a_main_thread_that_does_not_move_or_a_rank_that_gives_no_sign():
    watch = _hangs.HangWatch(stopped_s=10.0, hang_s=5.0)
    pid = os.getpid()  # running, not stopped
    watch.beat(3, still=1.0, where="job.py:7 in <module>")
    now = time.monotonic()
    assert watch.hung({3: pid}, now=now + 1.0) == {}
    assert watch.hung({3: pid}, now=now + 4.5) == {
        3: "its main thread has not moved for 5.5 s at job.py:7 in <module> (limit 5 s, "
           "--hang-timeout-s)"}
    # judged once: until its exit is heard the process is not killed and reported again
    assert watch.hung({3: pid}, now=now + 9.0) == {}
    restarted = os.getppid()  # rank 3 again, in another (running) process
    watch.beat(3, still=0.0, where="job.py:9 in step")
    assert watch.hung({3: restarted}, now=time.monotonic() + 1.0) == {}
    assert watch.hung({3: restarted}, now=time.monotonic() + 6.0) == {
        3: "it gave no sign of life for 6.0 s"}


def _launch(tmp: Path, body: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp / "job.py"
    script.write_text("import os, signal, threading, time\nRANK = int(os.environ['RANK'])\n"
                      + body)
    start = time.monotonic()
    res = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", *flags, str(script)],
                         capture_output=True, text=True, timeout=timing.guard(60),
                         env={**os.environ, "PYTHONPATH": spawn.pythonpath(),
                              "OMP_NUM_THREADS": "1"})
    return res, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.faults
def test_a_rank_stopped_past_the_node_grace_is_killed_and_reported_as_hung(tmp_path):
    res, took = _launch(tmp_path, """
if RANK == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
""", "--node-grace-s", "2")
    assert res.returncode != 0, res.stderr
    assert ("tensorplay-run: rank 1 hung on host " in res.stderr
            and ": its process was stopped (SIGSTOP) for 2." in res.stderr), res.stderr
    assert ("tensorplay-run: rank 1 failed first (killed by signal SIGKILL): hung on host "
            in res.stderr), res.stderr
    assert "stopped rank 0." in res.stderr
    assert took < timing.bound(2, 13), (took, timing.describe())  # --node-grace-s 2


@pytest.mark.slow
@pytest.mark.faults
def test_a_rank_whose_main_thread_is_stuck_past_hang_timeout_is_killed_saying_where(tmp_path):
    # 3 s on a quiet machine; longer on a busy one, where a starved rank's beats (one a
    # second) can stop for seconds (then it is "no sign of life", a true verdict but not the
    # one tested here)
    hang_s = max(3, round(1.5 * timing.factor()))
    res, took = _launch(tmp_path, """
if RANK == 0:
    threading.Event().wait()  # a deadlock: waits for ever
time.sleep(0.5)  # rank 1 ends well within the limit
""", "--hang-timeout-s", str(hang_s))
    assert res.returncode != 0, res.stderr
    assert "tensorplay-run: rank 0 hung on host " in res.stderr, res.stderr
    assert ": its main thread has not moved for " in res.stderr, res.stderr
    assert "threading.py:" in res.stderr and "in wait(), from " in res.stderr, res.stderr
    assert (f"job.py:5 in <module>() (limit {hang_s} s, --hang-timeout-s)"
            in res.stderr), res.stderr
    assert "rank 1 hung" not in res.stderr
    assert took < timing.bound(hang_s, 17), (took, timing.describe())
