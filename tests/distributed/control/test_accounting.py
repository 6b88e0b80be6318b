"""Collective accounting (``control/accounting.py``): a stray collective never goes unnamed.

The stray case is the one a user met: on a (2, 4) "dp" x "tp" mesh of 8 gloo ranks, rank 0
makes one extra all_reduce on the "tp" group inside the training loop. Its sums are silently
wrong from then on; at the end rank 0 must be named, with the "tp" group and the counts. That
job runs once on real processes; the comparison itself (at the end, after a failed collective,
with a member that never posts) runs on ranks as threads (``tests.fakes.ThreadRanks``). Strict
mode is in test_strict.py, the notes of a long wait in test_progress.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed.control import accounting
from tensorplay.distributed.errors import CallMismatchError
from tensorplay.distributed.geometry.spec import Ranks
from tensorplay.distributed.job.world import GroupName
from tests import spawn
from tests.fakes import ThreadRanks


def stray_job(rank: int, extra_at: int) -> dict:
    from tensorplay.distributed import init_device_mesh

    dist.init_process_group("gloo", timeout=20)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    sums = []
    try:
        for step in range(4):
            x = torch.ones(1)
            dist.all_reduce(x, group=tp)
            if rank == 0 and step == extra_at:
                dist.all_reduce(torch.ones(1), group=tp)  # the stray call
            sums.append(x.item())
        dist.destroy_process_group()
    except dist.DistributedError as err:
        return {"error": type(err).__name__, "message": str(err), "sums": sums,
                "counts": getattr(err, "counts", None)}
    return {"error": None, "sums": sums}


@pytest.mark.slow
@pytest.mark.faults
def test_an_extra_all_reduce_on_rank_0_is_named_with_the_tp_group():
    out = spawn.run(stray_job, 8, 1, init=False, timeout=120, pg_timeout=20)  # inside the loop
    zero = out[0]
    assert zero["error"] == "CallMismatchError", out
    assert zero["message"].startswith(
        "ranks made different numbers of collective calls on the 'tp' group [0-3]: "
        "rank 0 made 5; ranks 1-3 made 4."), zero["message"]
    assert zero["counts"] == {5: [0], 4: [1, 2, 3]}
    for rank in range(4, 8):  # the other "tp" row made matching calls and ends cleanly
        assert out[rank]["error"] is None, out[rank]
        assert out[rank]["sums"] == [4.0] * 4


def _tp(world):
    """The 'tp' group of a (2, 4) mesh through this rank: [0-3] or [4-7]."""
    first = world.rank // 4 * 4
    return world.group(Ranks.of(range(first, first + 4)), name=GroupName("'tp'"))


def _counted(calls_of):
    """A rank's body: make its 'tp' group, count ``calls_of(rank)`` calls on it, then do what
    destroy_process_group() does with the counts; the error it raised, or None."""
    def body(world):
        _tp(world).calls = calls_of(world.rank)
        try:
            accounting.check_at_end(world)
        except CallMismatchError as err:
            return err
        return None
    return body


def test_differing_counts_are_named_at_the_end_by_the_groups_first_member():
    out = ThreadRanks(8).run(_counted(lambda rank: 5 if rank == 0 else 4))
    zero = out[0]
    assert isinstance(zero, CallMismatchError), out
    assert str(zero).startswith(
        "ranks made different numbers of collective calls on the 'tp' group [0-3]: "
        "rank 0 made 5; ranks 1-3 made 4."), str(zero)
    assert zero.counts == {5: [0], 4: [1, 2, 3]}
    assert out[1:] == [None] * 7  # the other members, and the other "tp" row, end cleanly


def test_equal_counts_end_cleanly_and_every_rank_says_it_left():
    ranks = ThreadRanks(8)
    assert ranks.run(_counted(lambda rank: 7)) == [None] * 8
    world = ranks.world(0)
    assert all(ranks.store.check([world.spmd.key("left/{rank}", rank=r)]) for r in range(8))


def test_a_member_that_never_posts_is_logged_not_blamed(caplog, monkeypatch):
    """At the end the first member waits a moment for the others' counts (GRACE_S); one still
    missing then may be slow, or stuck in the stray call: it is logged, in one line, not
    compared."""
    monkeypatch.setattr(accounting, "GRACE_S", 0.2)
    caplog.set_level(logging.WARNING, logger="tensorplay.distributed")
    ranks = ThreadRanks(8)  # the 'tp' groups [0-3], [4-7] and the world group [0-7]
    present = [0, 1, 2, 4, 5, 6, 7]  # rank 3 never ends
    out = ranks.run(_counted(lambda rank: 3), ranks=present)
    assert [out[r] for r in present] == [None] * 7
    lines = [r.getMessage() for r in caplog.records if "accounting" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("collective accounting: rank 3 had not posted their call counts "
                               "on ") and lines[0].endswith("; they were not compared"), lines
    assert "rank 3 had not posted their call counts on the 'tp' group [0-3]; " in lines[0]
    assert "rank 3 had not posted their call counts on the world group [0-7]" in lines[0]


def test_after_a_failed_collective_the_rank_with_the_extra_call_names_itself():
    ranks = ThreadRanks(4)
    for rank in (1, 2, 3):  # the peers finished after 4 calls (their counts posted at the end)
        _tp(ranks.world(rank)).calls = 4
        accounting.check_at_end(ranks.world(rank))
    group = _tp(ranks.world(0))
    group.calls = 5  # rank 0 waits in its 5th, which fails when the peers leave
    err = accounting.check_after_failure(ranks.world(0), group)
    assert isinstance(err, CallMismatchError) and err.counts == {5: [0], 4: [1, 2, 3]}, err
