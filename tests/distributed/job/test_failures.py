"""How failures are worded (``job/failures.py``): who died, who is missing, and who only raised.

Ranks are threads over one in-memory store (``tests.fakes.ThreadRanks``); a rank "died" when its
pid in ``host_pids`` is that of a process that has exited. The same in real gloo jobs (a
SIGKILL seen by the survivors) is in test_faults.py.
"""

from __future__ import annotations

import os

import pytest

from tensorplay.distributed.control import keys
from tensorplay.distributed.errors import DistributedTimeoutError, RankFailedError
from tensorplay.distributed.host import wire
from tensorplay.distributed.job import failures
from tests.fakes import ThreadRanks, exited_pid

ME = os.getpid()


def test_a_rank_that_ended_after_raising_is_not_named_as_a_second_death():
    """3 ranks on one host: rank 2 dies; rank 1, its only peer, raises and ends; rank 0, whose
    only peer is rank 1, fails after that and finds ranks 1 and 2 gone: only 2 died."""
    two, one = exited_pid(), exited_pid()
    ranks = ThreadRanks(3, host_pids={0: ME, 1: ME, 2: two})
    lost = RuntimeError("Connection closed by peer")
    first = failures.collective_error(ranks.world(1), lost, "all_reduce()",
                                       ranks.world(1).default_group)
    assert isinstance(first, RankFailedError) and first.ranks == [2], first
    assert ranks.store.check([ranks.world(1).spmd.key(keys.FAILED, rank=1)])  # its mark
    ranks.world(0).epochs.host_pids = {0: ME, 1: one, 2: two}  # rank 1 has ended since
    err = failures.collective_error(ranks.world(0), lost, "all_reduce()",
                                     ranks.world(0).default_group)
    assert isinstance(err, RankFailedError) and err.ranks == [2], err
    assert str(err).startswith(f"all_reduce() on the world group [0-2] failed: rank 2 (pid "
                               f"{two}) died (no longer running on this host)"), err


def test_without_the_mark_both_gone_ranks_are_named():
    ranks = ThreadRanks(3, host_pids={0: ME, 1: exited_pid(), 2: exited_pid()})
    err = failures.diagnose(ranks.world(0), "all_reduce()", None, timed_out=False)
    assert isinstance(err, RankFailedError) and err.ranks == [1, 2], err


def test_a_collective_that_loses_a_peer_names_it_on_every_survivor():
    dead = exited_pid()
    ranks = ThreadRanks(3, host_pids={0: ME, 1: ME, 2: dead})

    def fail(world):
        return failures.collective_error(world, RuntimeError("[pair.cc] Connection reset by "
                                                              "peer"), "all_reduce()",
                                          world.default_group)

    for err in ranks.run(fail, ranks=[0, 1])[:2]:
        assert isinstance(err, RankFailedError) and err.ranks == [2], err
        assert str(err).startswith(f"all_reduce() on the world group [0-2] failed: rank 2 (pid "
                                   f"{dead}) died"), err
        assert "Engine said: Connection reset by peer." in str(err) and "Fix" in str(err)


def test_a_collective_that_times_out_says_so_with_the_engines_words():
    err = failures.collective_error(
        ThreadRanks(2, timeout_s=7).world(0), RuntimeError("Timed out waiting 7000ms"),
        "broadcast()", ThreadRanks(2).world(0).default_group)
    assert isinstance(err, DistributedTimeoutError) and err.timeout_s == 7
    assert "broadcast() on the world group [0-1]" in str(err)
    assert "Engine said: Timed out waiting 7000ms" in str(err)


def test_a_rank_killed_while_creating_groups_is_named():
    dead = exited_pid()
    world = ThreadRanks(3, host_pids={0: ME, 1: ME, 2: dead}).world(0)
    with pytest.raises(RankFailedError) as caught, \
            failures.named_failures(world, "creating the group of mesh dim None ('[2, 0, 1]')"):
        raise RuntimeError("Connection closed by peer")
    assert caught.value.ranks == [2]
    assert str(caught.value).startswith(
        f"creating the group of mesh dim None ('[2, 0, 1]') failed: rank 2 (pid {dead}) died")


def test_named_failures_leaves_other_errors_alone():
    world = ThreadRanks(2).world(0)
    with pytest.raises(ValueError, match="not the engine's"), \
            failures.named_failures(world, "step"):
        raise ValueError("not the engine's")


def test_the_failed_mark_is_bounded_when_the_store_is_gone():
    ranks = ThreadRanks(2, host_pids={0: ME, 1: exited_pid()})
    ranks.store.kill()
    err = failures.diagnose(ranks.world(0), "barrier()", None, timed_out=False)
    assert isinstance(err, RankFailedError) and err.ranks == [1], err
    assert ranks.world(0).store.timeout.total_seconds() == ranks.timeout_s  # restored


def test_a_loss_whose_ranks_were_admitted_again_is_not_blamed(monkeypatch, tmp_path):
    """Node 1's first launcher ("1.1", ranks 2-3) was lost; its second launcher started ranks 2
    and 3 again and the mesh admitted them (``Epochs.admit``). A broken connection after
    that is not worded as the old loss, which no longer names them."""
    path = tmp_path / "losses"
    wire.write(str(path), [{"node": 1, "claim": 1, "ranks": [2, 3], "replaced": False,
                               "text": "node 1 (hostB, ranks 2-3) is lost"}])
    monkeypatch.setenv(wire.LOSSES_FILE, str(path))
    monkeypatch.setattr(failures, "DEATH_GRACE_S", 0.0)  # no process here is about to die
    world = ThreadRanks(4, host_pids={0: ME, 1: ME}).world(0)
    broken = RuntimeError("Connection closed by peer")
    before = failures.diagnose(world, "all_reduce()", None, timed_out=False)
    assert "node 1 (hostB, ranks 2-3) is lost" in str(before) and before.ranks == [2, 3]
    for rank in (2, 3):
        world.epochs.admit(rank, 4000 + rank, on_this_host=False, instance="1.2")
    after = failures.collective_error(world, broken, "all_reduce()", world.default_group)
    assert isinstance(after, RankFailedError) and "is lost" not in str(after), after
    assert "a rank on another host probably did" in str(after), after
    assert world.epochs.host_pids == {0: ME, 1: ME}  # pids on another host are not watched here
