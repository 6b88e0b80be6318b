"""The cross-rank check's protocol (``control/consensus.py``), run by threads that share one
in-memory store.

Each thread plays one rank of a world over a ``tests.fakes.MemoryStore`` (``ThreadRanks``), so
the whole exchange runs without processes: digests, rank 0's verdict, the mismatch texts, the
ranks that never arrive, a late rank, death notices, a store that dies. The same behaviours in
real gloo jobs (a SIGKILL, two hosts, the launcher) are in test_faults.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tensorplay.distributed.control import consensus, keys
from tensorplay.distributed.errors import (
    DistributedTimeoutError,
    MeshMismatchError,
    RankFailedError,
)
from tensorplay.distributed.job import failures
from tests import timing
from tests.fakes import ThreadRanks, exited_pid, raised

TIMEOUT_S = 0.5  # the world timeout of the waits that are meant to expire


def _agree(request_of):
    """A rank's body: agree on ``request_of(rank)``; None when it passed."""
    return lambda world: consensus.agree(world, "init_device_mesh()", request_of(world.rank))


def _run_ranks(requests: list[dict]) -> list[BaseException | None]:
    """Call agree() on one thread per request (thread i is rank i); return what each raised."""
    return ThreadRanks(len(requests), timeout_s=20).run(_agree(lambda r: requests[r]))


def test_equal_requests_pass_on_every_rank():
    assert _run_ranks([{"mesh_shape": (2, 2), "names": ["dp", "tp"]}] * 4) == [None] * 4


def test_different_requests_raise_the_same_error_on_every_rank():
    requests = [{"mesh_shape": (2, 2)}] * 3 + [{"mesh_shape": (4, 1)}] * 2
    errors = raised(_run_ranks(requests), MeshMismatchError)
    assert {str(e) for e in errors} == {str(errors[0])}
    assert errors[0].values == {"(2, 2)": [0, 1, 2], "(4, 1)": [3, 4]}
    assert "mesh_shape in init_device_mesh()" in str(errors[0])
    assert "(2, 2): passed by ranks 0-2" in str(errors[0])
    assert "(4, 1): passed by ranks 3-4" in str(errors[0]) and "Fix" in str(errors[0])


def test_a_mismatch_names_the_first_differing_field_and_the_check_goes_on():
    """As the 4-rank job of test_faults.py: names differ on rank 2; the next check passes."""
    ranks = ThreadRanks(4, timeout_s=20)

    def names(r):
        return {"mesh_shape": (2, 2), "names": ("x", "y") if r == 2 else ("dp", "tp")}

    errors = raised(ranks.run(_agree(names)), MeshMismatchError)
    assert errors[0].values == {"('dp', 'tp')": [0, 1, 3], "('x', 'y')": [2]}
    assert "mesh_dim_names" not in str(errors[0])  # the field as the request names it
    assert {str(e) for e in errors} == {str(errors[0])}
    assert ranks.run(_agree(lambda r: {"mesh_shape": (2, 2)})) == [None] * 4


def test_many_distinct_requests_spell_out_the_first_few_and_count_the_rest():
    size = consensus.SHOWN_VALUES + 3
    errors = raised(_run_ranks([{"mesh_shape": (r, 1)} for r in range(size)]),
                    MeshMismatchError)
    values = errors[0].values
    assert len(values) == consensus.SHOWN_VALUES + 1
    assert values["(0, 1)"] == [0]
    assert values["<3 more distinct requests>"] == [size - 3, size - 2, size - 1]


def test_ranks_that_never_arrive_are_named_and_a_late_rank_fails_at_once():
    ranks = ThreadRanks(4, timeout_s=TIMEOUT_S)
    same = _agree(lambda r: {"mesh_shape": (2, 2)})
    start = time.monotonic()
    out = ranks.run(same, ranks=[0, 1])  # ranks 2 and 3 never call
    for rank in (0, 1):
        err = out[rank]
        assert isinstance(err, DistributedTimeoutError), (rank, err)
        assert err.missing == [2, 3] and err.timeout_s == TIMEOUT_S, err
        assert f"timed out after {TIMEOUT_S:g} s" in str(err)
        assert "init_device_mesh() (cross-rank check #1)" in str(err)
        assert "ranks 2-3 had not arrived" in str(err) and "Fix" in str(err)
    assert time.monotonic() - start < timing.bound(TIMEOUT_S, 5)
    start = time.monotonic()
    late = ranks.run(same, ranks=[3])[3]
    assert isinstance(late, DistributedTimeoutError), late
    assert "rank 3 arrived after the others had given up waiting" in str(late)
    assert "missing then: 2-3" in str(late)
    assert time.monotonic() - start < TIMEOUT_S  # it did not wait out its own timeout


def test_a_death_seen_by_the_watch_wakes_every_waiting_rank():
    """Rank 3's process is gone before it posted: a death notice fails the check at once."""
    pids = dict.fromkeys(range(4), os.getpid()) | {3: exited_pid()}
    ranks = ThreadRanks(4, timeout_s=30, host_pids=pids)
    start = time.monotonic()
    errors = raised(ranks.run(_agree(lambda r: {"mesh_shape": (4, 1)}), ranks=[0, 1, 2])[:3],
                    RankFailedError)
    assert time.monotonic() - start < timing.bound(0, 5)  # seen by the watch, no timeout
    for err in errors:
        assert err.ranks == [3], err
        assert str(err).startswith(f"init_device_mesh() (cross-rank check #1) failed: rank 3 "
                                   f"(pid {pids[3]}) died (no longer running on this host)")
        assert "Fix" in str(err)


def test_rank_0_dying_in_the_check_is_named_though_the_store_dies_with_it():
    pids = dict.fromkeys(range(3), os.getpid()) | {0: exited_pid()}
    ranks = ThreadRanks(3, timeout_s=30, host_pids=pids)
    threading.Timer(0.1, ranks.store.kill).start()  # rank 0 served it; the others wait
    errors = raised(ranks.run(_agree(lambda r: {"mesh_shape": (3,)}), ranks=[1, 2])[1:],
                    RankFailedError)
    for err in errors:
        assert err.ranks == [0], err
        assert "rank 0 (pid" in str(err) and "died" in str(err), err


# ------------------------------------------------------------------ the diagnosis, in one thread


def _arrive(world, n: int, ranks) -> None:
    for r in ranks:
        world.store.set(world.spmd.key(keys.CHECK_ARRIVE, n=n, rank=r), "test")


def test_a_broken_connection_names_the_dead_and_the_missing():
    world = ThreadRanks(4, host_pids={0: os.getpid(), 1: os.getpid(), 2: exited_pid()}).world(0)
    _arrive(world, 1, [0, 1, 2])
    err = world.control.diagnosed("init_device_mesh() (cross-rank check #1)", 1,
                               RuntimeError("[pair.cc:1] Connection reset by peer"), False)
    assert isinstance(err, RankFailedError)
    assert err.ranks == [2]
    text = str(err)
    assert text.startswith("init_device_mesh() (cross-rank check #1) failed: rank 2 (pid ")
    assert "rank 3 never arrived at it" in text
    assert "Engine said: Connection reset by peer." in text and "Fix" in text


def test_a_broken_connection_with_nobody_dead_here_blames_another_host(monkeypatch):
    monkeypatch.setattr(failures, "DEATH_GRACE_S", 0.3)  # 1 s in the package
    world = ThreadRanks(4).world(0)
    _arrive(world, 1, range(4))
    start = time.monotonic()
    err = world.control.diagnosed("flatten() (cross-rank check #1)", 1,
                               RuntimeError("Connection closed by peer"), False)
    took = time.monotonic() - start  # a socket closes a moment before its process is reaped:
    # the death is looked for that long (DEATH_GRACE_S), no longer
    assert failures.DEATH_GRACE_S <= took < timing.bound(failures.DEATH_GRACE_S, 2), took
    assert isinstance(err, RankFailedError) and err.ranks is None
    assert "no rank on this host died, so a rank on another host probably did" in str(err)


def test_a_timeout_names_the_missing_and_leaves_a_note_for_late_ranks():
    ranks = ThreadRanks(4, timeout_s=5)
    world = ranks.world(0)
    _arrive(world, 1, [0, 1])
    err = world.control.diagnosed("init_device_mesh() (cross-rank check #1)", 1,
                               RuntimeError("Timed out waiting 5000ms"), True)
    assert isinstance(err, DistributedTimeoutError)
    assert err.missing == [2, 3] and err.timeout_s == 5
    assert "ranks 2-3 had not arrived" in str(err)
    with pytest.raises(DistributedTimeoutError, match="rank 3 arrived after the others had "
                       "given up waiting .rank 0 stopped waiting after 5 s; missing then: 2-3"):
        consensus.agree(ranks.world(3), "init_device_mesh()", {"mesh_shape": (2, 2)})


def test_a_dead_rank_is_named_even_when_the_store_is_gone_too():
    """Rank 0 often exits right after its own error; the others must still name the dead."""
    ranks = ThreadRanks(4, host_pids={0: os.getpid(), 1: os.getpid(), 2: exited_pid()})
    ranks.store.kill()
    err = ranks.world(1).control.diagnosed("flatten() (cross-rank check #2)", 2,
                               RuntimeError("Connection closed by peer"), False)
    assert isinstance(err, RankFailedError) and err.ranks == [2], err
    assert str(err).startswith("flatten() (cross-rank check #2) failed: rank 2 (pid ")


def test_an_unreachable_store_names_rank_0():
    ranks = ThreadRanks(4)
    ranks.store.kill()
    with pytest.raises(RankFailedError, match=r"init_device_mesh\(\) \(cross-rank check #1\) "
                       r"failed: the job's store cannot be reached") as caught:
        consensus.agree(ranks.world(2), "init_device_mesh()", {"mesh_shape": (2, 2)})
    assert caught.value.ranks == [0]
