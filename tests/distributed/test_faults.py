"""Faults injected into real gloo jobs: what every surviving rank sees, and how soon.

Each job runs 4 ranks with tests/spawn.py (or the launcher). The ranks first import everything
and meet at a file barrier, so that only the step under test runs against the short timeout
(starting 4 processes that import torch on a busy 2-core machine can take longer than it).
Every test asserts the surviving ranks' errors and that none of them waited out that timeout,
which is PG_TIMEOUT_S scaled to the machine's speed (tests/timing.py), so that "less than the
timeout" still tells "seen at once" from "waited for the timeout" on a busy machine.

One job per behaviour of real processes: a SIGKILL in the check (after two mismatches and a
good mesh, in the same job), a death on another host, the launcher. The protocol itself (who
never arrived, a late rank, death notices, a store that died, the failed marks) runs on threads
in test_consensus.py and test_failures.py.
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

from tensorplay.distributed.host import procfs
from tests import spawn, timing

pytestmark = [pytest.mark.slow, pytest.mark.faults]

N = 4
PG_TIMEOUT_S = 5.0  # the world timeout on a quiet machine (scaled by timing.factor())
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


def _timeout_s() -> float:
    """The jobs' world timeout: PG_TIMEOUT_S, longer on a slow or busy machine."""
    return PG_TIMEOUT_S * timing.factor()


def _join(rank: int, tmp: str, timeout_s: float, n: int = N) -> None:
    """Import everything, meet the other ranks at a file barrier, then init the world."""
    import torch  # noqa: F401 - imported before the barrier, so that it costs no wait time

    import tensorplay.distributed as dist
    from tensorplay.distributed import collectives, device_mesh  # noqa: F401

    _mark(tmp, "ready", rank)
    assert _wait_for(tmp, "ready", range(n), limit_s=120), "the ranks never all started"
    dist.init_process_group("gloo", timeout=timeout_s)


def _attempt(call) -> dict:
    """Run ``call``; return what it raised (or returned) and how long it took."""
    from tensorplay.distributed.job import lifecycle as world  # holds the world (_WORLD)

    created = world._WORLD.registry.created
    start = time.monotonic()
    try:
        value = call()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": [c.__name__ for c in type(err).__mro__], "message": str(err),
                "elapsed": time.monotonic() - start,
                "made": world._WORLD.registry.created - created,
                "values": getattr(err, "values", None), "missing": getattr(err, "missing", None),
                "timeout_s": getattr(err, "timeout_s", None),
                "ranks": getattr(err, "ranks", None)}
    return {"error": None, "value": value, "elapsed": time.monotonic() - start,
            "made": world._WORLD.registry.created - created}


def _check_bounded(result: dict, timeout_s: float) -> None:
    """The call ended before the world's timeout: it did not wait for it."""
    assert result["elapsed"] < timeout_s, (f"took {result['elapsed']:.1f} s of {timeout_s:.1f}: "
                                           f"{result}")


# ---------------------------------------------------------------------------- (a), (b): mismatch


def mismatch_job(rank: int, tmp: str, timeout_s: float) -> dict:
    import torch

    import tensorplay.distributed as dist
    from tensorplay.distributed.control import consensus
    from tensorplay.distributed.device_mesh import init_device_mesh

    _join(rank, tmp, timeout_s)
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
        consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    out["killed"] = _attempt(lambda: init_device_mesh("cpu", (4, 1)))
    return _stay_until_all_said(tmp, rank, N, 3, out)


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    """One job for (a), (b) and (e): two mismatches, a good mesh, then rank 3 is killed."""
    tmp = str(tmp_path_factory.mktemp("mismatch"))
    timeout_s = _timeout_s()
    out = spawn.run(mismatch_job, N, tmp, timeout_s, init=False, timeout=120,
                    expect_errors=True)
    assert not any(isinstance(o, spawn.Failure) for o in out[:3]), out
    for result in out[:3]:
        result["timeout_s"] = timeout_s
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
        _check_bounded(result, out["timeout_s"])  # no rank waited for a timeout
        messages.add(result["message"])
    assert len(messages) == 1  # every rank raises the same text


def test_names_mismatch_names_who_passed_what(mismatch):
    for rank, out in enumerate(mismatch[:3]):
        result = out["names"]
        assert "MeshMismatchError" in result["error"], (rank, result)
        assert result["values"] == {"('dp', 'tp')": [0, 1, 3], "('x', 'y')": [2]}
        assert "mesh_dim_names in init_device_mesh()" in result["message"]
        assert result["made"] == 0
        _check_bounded(result, out["timeout_s"])


def test_world_still_works_after_a_mismatch(mismatch):
    for rank, out in enumerate(mismatch[:3]):
        result = out["good"]
        assert result["error"] is None, (rank, result)
        tp_sum = 1.0 if rank < 2 else 5.0  # tp groups [0, 1] and [2, 3]
        assert result["value"] == [tp_sum, float(N)]
        assert result["made"] == 2


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
        _check_bounded(result, mismatch[rank]["timeout_s"])  # a broken connection: at once


def killed_in_check_job(rank: int, tmp: str, victim: int, hosts: list[str],
                        timeout_s: float) -> dict:
    """Ranks live on the named (simulated) hosts; ``victim`` SIGKILLs itself in the check."""
    from tensorplay.distributed.control import consensus
    from tensorplay.distributed.device_mesh import init_device_mesh

    os.environ["TENSORPLAY_HOSTNAME"] = hosts[rank]
    _join(rank, tmp, timeout_s, n=len(hosts))
    _mark(tmp, "joined", rank)  # rank 0 must not die while the others are still joining
    assert _wait_for(tmp, "joined", range(len(hosts)))
    if rank == victim:
        consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
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
    timeout_s = _timeout_s()
    out = spawn.run(killed_in_check_job, N, str(tmp_path), 3, hosts, timeout_s, init=False,
                    timeout=120, expect_errors=True)
    for rank, result in _survivors_naming(out, 3).items():
        where = "this host" if rank == 2 else "host hB"
        assert f"died (no longer running on {where})" in result["message"], result
        assert "Fix" in result["message"] and result["made"] == 0
        _check_bounded(result, timeout_s)  # seen by the watch, not by a timeout


# --------------------------------------------------------------------------------- (f): launcher


LAUNCHED = """\
import os, signal, sys, time
from pathlib import Path
import tensorplay.distributed as dist
from tensorplay.distributed.control import consensus
from tensorplay.distributed.device_mesh import init_device_mesh
HERE = Path(__file__).resolve().parent
RANK, N = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
(HERE / f"pid_{RANK}").write_text(str(os.getpid()))
while not all((HERE / f"pid_{r}").exists() for r in range(N)):  # every rank imported
    time.sleep(0.02)
dist.init_process_group("gloo", timeout=float(sys.argv[1]))
if RANK == 3:
    consensus._digest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
try:
    init_device_mesh("cpu", (2, 2))
except Exception as err:
    print(f"rank {RANK} raised {type(err).__name__}: {err}", flush=True)
    time.sleep(60)  # the launcher must stop us
"""


def test_launcher_stops_the_job_when_a_rank_is_killed(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(LAUNCHED))
    start = time.monotonic()
    proc = subprocess.run([*LAUNCHER, "--nproc-per-node", str(N), "--stop-grace-s", "2",
                           str(job), str(_timeout_s())],
                          capture_output=True, text=True, timeout=120, errors="replace")
    elapsed = time.monotonic() - start
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_?"))]
    assert len(pids) == N, proc.stderr[-2000:]
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-2000:]
    assert "rank 3 failed first (killed by signal SIGKILL)" in proc.stderr, proc.stderr[-2000:]
    assert "stopped ranks 0-2" in proc.stderr
    deadline = time.monotonic() + timing.bound(0, 5)
    while any(procfs.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if procfs.alive(p)] == []  # no process left behind
    assert elapsed < timing.bound(0, 60), timing.describe()
