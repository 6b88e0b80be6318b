"""Faults injected into real gloo jobs: what every surviving rank sees, and how soon.

Each job runs 4 ranks with tests/spawn.py (or the launcher). The ranks first import everything
and meet at a file barrier, so that only the step under test runs against the short timeout
(starting 4 processes that import torch on a busy 2-core machine can take longer than it).
Every test asserts the surviving ranks' errors and a bound on how long they took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import spawn

pytestmark = [pytest.mark.slow, pytest.mark.faults]

N = 4
PG_TIMEOUT_S = 5.0
ENV_TIMEOUT_S = 3.0  # TENSORPLAY_TIMEOUT in the absent/late job
BOUND_S = 30.0  # every failure must be reported within this many seconds of the call
LAUNCHER = [sys.executable, "-m", "tensorplay.distributed.run"]


# ------------------------------------------------------------------------------- helpers (ranks)


def _mark(tmp: str, tag: str, rank: int) -> None:
    Path(tmp, f"{tag}.{rank}").write_text(str(os.getpid()))


def _wait_for(tmp: str, tag: str, ranks, limit_s: float = 60.0) -> bool:
    """Wait until every rank in ``ranks`` has marked ``tag``; False when the limit passed."""
    deadline = time.monotonic() + limit_s
    while not all(Path(tmp, f"{tag}.{r}").exists() for r in ranks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _join(rank: int, tmp: str, timeout_s: float | None = PG_TIMEOUT_S, n: int = N) -> None:
    """Import everything, meet the other ranks at a file barrier, then init the world."""
    import torch  # noqa: F401 - imported before the barrier, so that it costs no wait time

    import tensorplay.distributed as dist
    from tensorplay.distributed import collectives, device_mesh  # noqa: F401

    _mark(tmp, "ready", rank)
    assert _wait_for(tmp, "ready", range(n), limit_s=120), "the ranks never all started"
    if timeout_s is None:
        dist.init_process_group("gloo")  # the timeout comes from TENSORPLAY_TIMEOUT
    else:
        dist.init_process_group("gloo", timeout=timeout_s)


def _attempt(call) -> dict:
    """Run ``call``; return what it raised (or returned) and how long it took."""
    from tensorplay.distributed import world

    created = world._WORLD.created
    start = time.monotonic()
    try:
        value = call()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": [c.__name__ for c in type(err).__mro__], "message": str(err),
                "elapsed": time.monotonic() - start, "made": world._WORLD.created - created,
                "values": getattr(err, "values", None), "missing": getattr(err, "missing", None),
                "timeout_s": getattr(err, "timeout_s", None),
                "ranks": getattr(err, "ranks", None)}
    return {"error": None, "value": value, "elapsed": time.monotonic() - start,
            "made": world._WORLD.created - created}


def _check_bounded(result: dict, bound_s: float = BOUND_S) -> None:
    assert result["elapsed"] < bound_s, f"took {result['elapsed']:.1f} s: {result}"


# ---------------------------------------------------------------------------- (a), (b): mismatch


def mismatch_job(rank: int, tmp: str) -> dict:
    import torch

    import tensorplay.distributed as dist
    from tensorplay.distributed import _consensus
    from tensorplay.distributed.device_mesh import init_device_mesh

    _join(rank, tmp)
    shape = (4, 1) if rank == 3 else (2, 2)
    names = ("x", "y") if rank == 2 else ("dp", "tp")
    out = {
        "shape": _attempt(lambda: init_device_mesh("cpu", shape)),
        "names": _attempt(lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=names)),
    }

    def good():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=mesh.get_group("tp"))
        y = torch.tensor([1.0])
        dist.all_reduce(y)
        return [x.item(), y.item()]

    out["good"] = _attempt(good)
    if rank == 3:  # (e): rank 3 now dies inside the next mesh's cross-rank check
        _consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    out["killed"] = _attempt(lambda: init_device_mesh("cpu", (4, 1)))
    return _stay_until_all_said(tmp, rank, N, 3, out)


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    """One job for (a), (b) and (e): two mismatches, a good mesh, then rank 3 is killed."""
    tmp = str(tmp_path_factory.mktemp("mismatch"))
    start = time.monotonic()
    out = spawn.run(mismatch_job, N, tmp, init=False, timeout=120, expect_errors=True)
    assert time.monotonic() - start < 120
    assert not any(isinstance(o, spawn.Failure) for o in out[:3]), out
    return out


def test_shape_mismatch_names_who_passed_what(mismatch):
    messages = set()
    for rank, out in enumerate(mismatch[:3]):
        result = out["shape"]
        assert "MeshMismatchError" in result["error"], (rank, result)
        assert result["values"] == {"(2, 2)": [0, 1, 2], "(4, 1)": [3]}
        assert "mesh_shape in init_device_mesh()" in result["message"]
        assert "(2, 2): passed by ranks 0-2" in result["message"]
        assert "(4, 1): passed by rank 3" in result["message"]
        assert "Fix" in result["message"]
        assert result["made"] == 0  # nothing half-created
        _check_bounded(result, PG_TIMEOUT_S)  # no rank waited for a timeout
        messages.add(result["message"])
    assert len(messages) == 1  # every rank raises the same text


def test_names_mismatch_names_who_passed_what(mismatch):
    for rank, out in enumerate(mismatch[:3]):
        result = out["names"]
        assert "MeshMismatchError" in result["error"], (rank, result)
        assert result["values"] == {"('dp', 'tp')": [0, 1, 3], "('x', 'y')": [2]}
        assert "mesh_dim_names in init_device_mesh()" in result["message"]
        assert result["made"] == 0
        _check_bounded(result, PG_TIMEOUT_S)


def test_world_still_works_after_a_mismatch(mismatch):
    for rank, out in enumerate(mismatch[:3]):
        result = out["good"]
        assert result["error"] is None, (rank, result)
        tp_sum = 1.0 if rank < 2 else 5.0  # tp groups [0, 1] and [2, 3]
        assert result["value"] == [tp_sum, float(N)]
        assert result["made"] == 2


# ------------------------------------------------------------------------ (c), (d): absent, late


def absent_late_job(rank: int, tmp: str) -> dict:
    """Ranks 0, 1 build a mesh; rank 2 never calls; rank 3 calls after the others gave up."""
    from tensorplay.distributed import world
    from tensorplay.distributed.device_mesh import init_device_mesh

    _join(rank, tmp, timeout_s=None)
    out = {"timeout_s": world._WORLD.timeout.total_seconds()}
    if rank == 2:  # never calls; stays alive until the others are done, then exits
        _wait_for(tmp, "done", [0, 1, 3])
        return out
    if rank == 3:  # sleeps past the others' timeout, then calls
        _wait_for(tmp, "done", [0, 1])
        out["late"] = _attempt(lambda: init_device_mesh("cpu", (2, 2)))
        _mark(tmp, "done", rank)
        return out
    out["absent"] = _attempt(lambda: init_device_mesh("cpu", (2, 2)))
    _mark(tmp, "done", rank)
    _wait_for(tmp, "done", [3])  # rank 0 serves the store: keep it up for the late rank
    return out


@pytest.fixture(scope="module")
def absent_late(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("absent"))
    env = {"TENSORPLAY_TIMEOUT": str(ENV_TIMEOUT_S)}
    return spawn.run(absent_late_job, N, tmp, init=False, env=env, timeout=120)


def test_tensorplay_timeout_is_honoured(absent_late):
    assert [out["timeout_s"] for out in absent_late] == [ENV_TIMEOUT_S] * N
    for rank in (0, 1):
        result = absent_late[rank]["absent"]
        assert result["timeout_s"] == ENV_TIMEOUT_S
        assert f"timed out after {ENV_TIMEOUT_S:g} s" in result["message"]
        assert ENV_TIMEOUT_S * 0.8 < result["elapsed"] < ENV_TIMEOUT_S + 10, result


def test_absent_ranks_are_named_by_the_ones_that_waited(absent_late):
    for rank in (0, 1):
        result = absent_late[rank]["absent"]
        assert "DistributedTimeoutError" in result["error"], (rank, result)
        assert result["missing"] == [2, 3]
        assert "init_device_mesh() (cross-rank check #1)" in result["message"]
        assert "ranks 2-3 had not arrived" in result["message"]
        assert "Fix" in result["message"]
        assert result["made"] == 0
        _check_bounded(result)


def test_a_late_rank_fails_at_once_and_says_it_was_late(absent_late):
    result = absent_late[3]["late"]
    assert "DistributedTimeoutError" in result["error"], result
    assert "rank 3 arrived after the others had given up waiting" in result["message"]
    assert "missing then: 2-3" in result["message"]
    assert result["elapsed"] < ENV_TIMEOUT_S, result  # it did not wait out its own timeout
    assert result["made"] == 0


# ---------------------------------------------------------------------------------- (e): SIGKILL


def test_a_rank_killed_in_the_check_is_named_by_the_survivors(mismatch):
    assert mismatch[3] is spawn.NO_ANSWER  # it died without a word
    for rank in range(3):
        result = mismatch[rank]["killed"]
        assert "RankFailedError" in result["error"], (rank, result)
        assert result["ranks"] == [3], result
        assert "rank 3 (pid" in result["message"] and "died" in result["message"]
        assert "init_device_mesh() (cross-rank check #4)" in result["message"]
        assert "Fix" in result["message"]
        assert result["made"] == 0
        _check_bounded(result, PG_TIMEOUT_S)  # a broken connection is seen at once


def killed_in_check_job(rank: int, tmp: str, victim: int, hosts: list[str]) -> dict:
    """Ranks live on the named (simulated) hosts; ``victim`` SIGKILLs itself in the check."""
    from tensorplay.distributed import _consensus
    from tensorplay.distributed.device_mesh import init_device_mesh

    os.environ["TENSORPLAY_HOSTNAME"] = hosts[rank]
    _join(rank, tmp, n=len(hosts))
    _mark(tmp, "joined", rank)  # rank 0 must not die while the others are still joining
    assert _wait_for(tmp, "joined", range(len(hosts)))
    if rank == victim:
        _consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    return _stay_until_all_said(tmp, rank, len(hosts), victim,
                                _attempt(lambda: init_device_mesh("cpu", (len(hosts),))))


def _stay_until_all_said(tmp: str, rank: int, n: int, victim: int, result: dict) -> dict:
    """Keep this survivor running until every survivor has its error: one that ended at once
    would be one more rank gone, which another survivor can tell from a death only by asking
    the store, and here the store may have died with rank 0 (docs/bad_inputs.md)."""
    _mark(tmp, "said", rank)
    _wait_for(tmp, "said", [r for r in range(n) if r != victim], limit_s=30)
    return result


def _survivors_naming(out: list, dead: int) -> dict[int, dict]:
    """Check that ``dead`` never answered and every other rank raised RankFailedError naming
    it by rank and pid; return the survivors' results by rank."""
    assert out[dead] is spawn.NO_ANSWER
    survivors = {rank: result for rank, result in enumerate(out) if rank != dead}
    for rank, result in survivors.items():
        assert "RankFailedError" in result["error"], (rank, result)
        assert result["ranks"] == [dead], result
        assert f"rank {dead} (pid" in result["message"] and "died" in result["message"], result
    return survivors


def test_a_death_seen_on_one_host_reaches_the_ranks_of_another(tmp_path):
    """Rank 3 dies on host hB: rank 2 sees it there and its notice wakes ranks 0, 1 on hA."""
    hosts = ["hA", "hA", "hB", "hB"]
    out = spawn.run(killed_in_check_job, N, str(tmp_path), 3, hosts, init=False, timeout=120,
                    expect_errors=True)
    for rank, result in _survivors_naming(out, 3).items():
        where = "this host" if rank == 2 else "host hB"
        assert f"died (no longer running on {where})" in result["message"], result
        assert "Fix" in result["message"] and result["made"] == 0
        _check_bounded(result, PG_TIMEOUT_S)  # seen by the watch, not by a timeout


def test_rank_0_dying_in_the_check_is_named_though_the_store_dies_with_it(tmp_path):
    out = spawn.run(killed_in_check_job, 3, str(tmp_path), 0, ["h"] * 3, init=False,
                    timeout=120, expect_errors=True)
    for result in _survivors_naming(out, 0).values():
        _check_bounded(result, PG_TIMEOUT_S)


def killed_in_groups_job(rank: int, tmp: str) -> dict:
    """3 ranks; rank 2 SIGKILLs itself when it starts creating the mesh's group."""
    from tensorplay.distributed.backends import torch_c10d
    from tensorplay.distributed.device_mesh import DeviceMesh

    _join(rank, tmp, n=3)
    if rank == 2:
        torch_c10d.ENGINE.new_group = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    return _stay_until_all_said(tmp, rank, 3, 2, _attempt(lambda: DeviceMesh("cpu", [2, 0, 1])))


def test_a_rank_killed_while_creating_groups_is_named(tmp_path):
    out = spawn.run(killed_in_groups_job, 3, str(tmp_path), init=False, timeout=120,
                    expect_errors=True)
    for result in _survivors_naming(out, 2).values():
        assert "creating the group" in result["message"]
        _check_bounded(result)


def left_after_a_loss_job(rank: int, tmp: str) -> dict:
    """3 ranks on one host: rank 2 dies; rank 1, its only peer, raises and ends; rank 0, whose
    only peer is rank 1, calls after that and finds ranks 1 and 2 gone."""
    import torch

    import tensorplay.distributed as dist
    from tensorplay.distributed import _procfs, world

    _join(rank, tmp, n=3)
    pids = world._WORLD.host_pids
    pair_12 = dist.new_group([1, 2]) if rank else None
    pair_01 = dist.new_group([0, 1]) if rank < 2 else None
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        return _attempt(lambda: dist.all_reduce(torch.ones(1), group=pair_12))
    deadline = time.monotonic() + 60
    while _procfs.alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _attempt(lambda: dist.all_reduce(torch.ones(1), group=pair_01))


def test_a_rank_that_ended_after_raising_is_not_named_as_a_second_death(tmp_path):
    out = spawn.run(left_after_a_loss_job, 3, str(tmp_path), init=False, timeout=120,
                    expect_errors=True)
    for rank in (1, 0):  # rank 0 fails after rank 1 ended: it names rank 2 only
        assert "RankFailedError" in out[rank]["error"], (rank, out[rank])
        assert out[rank]["ranks"] == [2], (rank, out[rank]["message"])
        assert "rank 2 (pid" in out[rank]["message"] and "died" in out[rank]["message"]


# --------------------------------------------------------------------------------- (f): launcher


LAUNCHED = """\
import os, signal, sys, time
from pathlib import Path
import tensorplay.distributed as dist
from tensorplay.distributed import _consensus
from tensorplay.distributed.device_mesh import init_device_mesh
HERE = Path(__file__).resolve().parent
RANK, N = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
(HERE / f"pid_{RANK}").write_text(str(os.getpid()))
while not all((HERE / f"pid_{r}").exists() for r in range(N)):  # every rank imported
    time.sleep(0.02)
dist.init_process_group("gloo", timeout=float(sys.argv[1]))
if RANK == 3:
    _consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
try:
    init_device_mesh("cpu", (2, 2))
except Exception as err:
    print(f"rank {RANK} raised {type(err).__name__}: {err}", flush=True)
    time.sleep(60)  # the launcher must stop us
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_launcher_stops_the_job_when_a_rank_is_killed(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(LAUNCHED))
    start = time.monotonic()
    proc = subprocess.run([*LAUNCHER, "--nproc-per-node", str(N), "--stop-grace-s", "2",
                           str(job), str(PG_TIMEOUT_S)],
                          capture_output=True, text=True, timeout=120, errors="replace")
    elapsed = time.monotonic() - start
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_?"))]
    assert len(pids) == N, proc.stderr[-2000:]
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-2000:]
    assert "rank 3 failed first (killed by signal SIGKILL)" in proc.stderr, proc.stderr[-2000:]
    assert "stopped ranks 0-2" in proc.stderr
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []  # no process left behind
    assert elapsed < 60


# ------------------------------------------------------------------ the diagnosis, in one process


def _world(rank: int = 0, size: int = 4, store=None):
    """A World over a torch HashStore with a short timeout, no processes (as _consensus and
    _failures see a real one)."""
    from datetime import timedelta

    import torch.distributed as tdist

    from tensorplay.distributed.backends import engine_for
    from tensorplay.distributed.world import World

    return World(rank, size, "gloo", timedelta(seconds=PG_TIMEOUT_S), engine_for("gloo"),
                 store if store is not None else tdist.HashStore())


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _arrive(world, n: int, ranks) -> None:
    from tensorplay.distributed import _keys

    for r in ranks:
        world.store.set(world.spmd.key(_keys.CHECK_ARRIVE, n=n, rank=r), "test")


def test_running_treats_zombies_and_reaped_processes_as_dead():
    from tensorplay.distributed._procfs import alive as running

    assert running(os.getpid())
    assert not running(_exited_pid())
    zombie = subprocess.Popen(["true"])  # not reaped until wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not running(zombie.pid)
    zombie.wait()


def test_a_broken_connection_names_the_dead_and_the_missing():
    from tensorplay.distributed.errors import RankFailedError

    world = _world()
    world.host_pids = {0: os.getpid(), 1: os.getpid(), 2: _exited_pid()}
    _arrive(world, 1, [0, 1, 2])
    err = world.control.diagnosed("init_device_mesh() (cross-rank check #1)", 1,
                                      RuntimeError("[pair.cc:1] Connection reset by peer"), False)
    assert isinstance(err, RankFailedError)
    assert err.ranks == [2]
    text = str(err)
    assert text.startswith("init_device_mesh() (cross-rank check #1) failed: rank 2 (pid ")
    assert "rank 3 never arrived at it" in text
    assert "Engine said: Connection reset by peer." in text and "Fix" in text


def test_a_broken_connection_with_nobody_dead_here_blames_another_host():
    from tensorplay.distributed import _failures
    from tensorplay.distributed.errors import RankFailedError

    world = _world()
    _arrive(world, 1, range(4))
    start = time.monotonic()
    err = world.control.diagnosed("flatten() (cross-rank check #1)", 1,
                                      RuntimeError("Connection closed by peer"), False)
    assert time.monotonic() - start < _failures.DEATH_GRACE_S + 2  # bounded grace
    assert isinstance(err, RankFailedError) and err.ranks is None
    assert "a rank on another host probably did" in str(err)


def test_a_timeout_names_the_missing_and_leaves_a_note_for_late_ranks():
    from tensorplay.distributed import _consensus
    from tensorplay.distributed.errors import DistributedTimeoutError

    world = _world()
    _arrive(world, 1, [0, 1])
    err = world.control.diagnosed("init_device_mesh() (cross-rank check #1)", 1,
                                      RuntimeError("Timed out waiting 5000ms"), True)
    assert isinstance(err, DistributedTimeoutError)
    assert err.missing == [2, 3] and err.timeout_s == PG_TIMEOUT_S
    assert "ranks 2-3 had not arrived" in str(err)
    late = _world(rank=3, store=world.store)
    with pytest.raises(DistributedTimeoutError, match="rank 3 arrived after the others had "
                       "given up waiting .rank 0 stopped waiting after 5 s; missing then: 2-3"):
        _consensus.agree(late, "init_device_mesh()", {"mesh_shape": (2, 2)})


class _GoneStore:
    """A store whose server has died: every call fails as c10d's client does."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_dead_rank_is_named_even_when_the_store_is_gone_too():
    """Rank 0 often exits right after its own error; the others must still name the dead."""
    from tensorplay.distributed.errors import RankFailedError

    world = _world(rank=1, store=_GoneStore())
    world.host_pids = {0: os.getpid(), 1: os.getpid(), 2: _exited_pid()}
    err = world.control.diagnosed("flatten() (cross-rank check #2)", 2,
                                      RuntimeError("Connection closed by peer"), False)
    assert isinstance(err, RankFailedError) and err.ranks == [2], err
    assert str(err).startswith("flatten() (cross-rank check #2) failed: rank 2 (pid ")


def test_an_unreachable_store_names_rank_0():
    from tensorplay.distributed import _consensus
    from tensorplay.distributed.errors import RankFailedError

    world = _world(rank=2, store=_GoneStore())
    with pytest.raises(RankFailedError, match=r"init_device_mesh\(\) \(cross-rank check #1\) "
                       r"failed: the job's store cannot be reached") as caught:
        _consensus.agree(world, "init_device_mesh()", {"mesh_shape": (2, 2)})
    assert caught.value.ranks == [0]
