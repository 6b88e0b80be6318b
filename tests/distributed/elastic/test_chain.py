"""The chain of epochs of an elastic mesh (``_elastic``), on the tests' in-memory store: one
answer per grow poll (also when the members poll at once, as threads), admission by token, the
end of the job; and init_device_mesh's elastic arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import tensorplay.distributed as dist
from tensorplay.distributed.control import keys
from tensorplay.distributed.elastic import chain as _elastic
from tensorplay.distributed.elastic.chain import Elastic
from tensorplay.distributed.elastic.mesh import enter
from tensorplay.distributed.errors import (
    ArgumentError,
    DistributedTimeoutError,
    MembersFinished,
    ShrinkError,
    StaleEpochError,
    UnknownDimError,
)
from tensorplay.distributed.host import knobs
from tests import timing
from tests.fakes import ThreadRanks, board

PLAN = Elastic(dim=0, minimum=1, full_shape=(2, 4), full_ranks=tuple(range(8)), epoch=1)
MEMBERS = {0, 1, 2, 3}  # rank 5 lost at epoch 0: slice 1 removed, 4, 6, 7 spares


def test_a_poll_grows_only_when_a_removed_slice_is_complete():
    store = board()
    for spare in (4, 6, 7):
        _elastic.want(store, spare, f"{100 + spare} hostA")
    assert _elastic.poll(store, PLAN, 1, MEMBERS) is None  # rank 5 not back yet
    _elastic.want(store, 5, "977 hostA")
    grown = _elastic.poll(store, PLAN, 2, MEMBERS)
    assert grown == {"epoch": 2, "shape": [2, 4], "ranks": list(range(8)),
                     "fresh": [4, 5, 6, 7],
                     "admitted": {"4": "104 hostA", "5": "977 hostA", "6": "106 hostA",
                                  "7": "107 hostA"}}


def test_every_member_reads_the_first_answer_of_a_poll():
    store = board()
    assert _elastic.poll(store, PLAN, 1, MEMBERS) is None  # the first member found nobody
    for r in (4, 5, 6, 7):
        _elastic.want(store, r, f"{r} hostA")
    assert _elastic.poll(store, PLAN, 1, MEMBERS) is None  # a later member: the same answer
    assert _elastic.poll(store, PLAN, 2, MEMBERS)["shape"] == [2, 4]  # the next poll grows


def test_the_first_record_of_what_follows_an_epoch_stands():
    store = board()
    shrink = {"epoch": 2, "shape": [1, 4], "ranks": [0, 1, 2, 3], "lost": [5]}
    assert _elastic.next_of(store, 1, shrink) == shrink
    assert _elastic.next_of(store, 1, {"epoch": 2, "shape": [2, 4]}) == shrink
    _elastic.end(store, 1, "too late")  # an end after a record changes nothing
    assert json.loads(store.peek([keys.ELASTIC_NEXT.format(epoch=1)])[0]) == shrink


def test_a_recovery_s_detect_time_is_the_first_ranks_for_a_rank_without_its_own():
    """Rank 4's all_reduce failed after 0.04 s and began the recovery; rank 0's next call was
    refused by the watcher's break (no time of its own): it reports rank 4's 0.04 s; a rank
    with a time of its own keeps it."""
    store = board()
    assert _elastic.recovering(store, 1, 4, 0.04) == 0.04
    assert _elastic.recovering(store, 1, 0, None) == 0.04
    assert _elastic.recovering(store, 1, 5, 0.5) == 0.04  # the caller keeps its own 0.5
    assert store.peek([keys.ELASTIC_RECOVERING.format(epoch=1)]) == ["4 detect=0.040000"]
    assert _elastic.recovering(store, 2, 0, None) is None  # nobody measured one


def test_a_waiting_rank_follows_the_chain_to_the_record_that_admits_it():
    store = board()
    _elastic.next_of(store, 0, {"epoch": 1, "shape": [1, 4], "ranks": [0, 1, 2, 3],
                                "lost": [5]})
    old = {"epoch": 2, "shape": [2, 4], "ranks": list(range(8)), "admitted": {"5": "1 old"}}
    _elastic.next_of(store, 1, old)  # an earlier process of rank 5 was admitted here
    admits = {"epoch": 3, "shape": [2, 4], "ranks": list(range(8)),
              "admitted": {"5": "2 new"}}
    _elastic.next_of(store, 2, admits)
    assert _elastic.await_admission(store, 5, "2 new", 0, timeout_s=1) == admits
    assert store.peek([keys.ELASTIC_WANT.format(rank=5)]) == ["2 new"]


def test_a_waiting_rank_learns_that_the_job_ended_or_finished():
    store = board()
    _elastic.end(store, 0, "mesh dim 'dp' would keep 0 of its 2 slices")
    with pytest.raises(ShrinkError, match="rank 5 waited to join, but the job ended: mesh dim"):
        _elastic.await_admission(store, 5, "1 a", 0, timeout_s=1)
    store = board()
    _elastic.finish(store, 0, (1, 4), [0, 1, 2, 3])
    assert _elastic.await_admission(store, 5, "1 a", 0, timeout_s=1)["finished"] == (
        "the members finished at epoch 0")


def test_a_waiting_rank_told_the_members_finished_ends_with_exit_code_0(capsys):
    """mesh.grow() on a spare (and a late replacement's init_device_mesh) raise
    MembersFinished, a SystemExit(0): a loop cannot take it for "go on" and spin."""
    finished = {"finished": "the members finished at epoch 2", "epoch": 2, "shape": [1, 4],
                "ranks": [0, 1, 2, 3]}
    closed: list[bool] = []
    world = SimpleNamespace(rank=5, close=lambda: closed.append(True))
    with pytest.raises(MembersFinished) as caught:
        enter(world, None, PLAN, finished, kind="join")  # type: ignore[arg-type]
    assert closed == [True]  # it left the world first: no engine group is left to the exit
    assert isinstance(caught.value, SystemExit) and caught.value.code == 0
    assert caught.value.epoch == 2
    said = ("rank 5 waited outside the elastic mesh, and the members finished at epoch 2 "
            "without it: it ends (exit code 0)")
    assert str(caught.value) == said
    assert capsys.readouterr().err == f"tensorplay.distributed: {said}\n"


def test_a_token_of_a_process_gone_from_this_host_is_not_admitted():
    """A replacement that died while it waited leaves its token behind: a poll must not admit
    it (the new epoch's groups would wait for a dead process), until a live one replaces it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = knobs.hostname()
    store = board()
    for spare in (4, 6, 7):
        _elastic.want(store, spare, f"{os.getpid()} {here}")
    _elastic.want(store, 5, f"{dead.pid} {here}")
    assert _elastic.poll(store, PLAN, 1, MEMBERS) is None
    _elastic.want(store, 5, f"{dead.pid} elsewhere")  # another host's: its launcher judges it
    assert _elastic.poll(store, PLAN, 2, MEMBERS)["fresh"] == [4, 5, 6, 7]


def test_a_waiting_rank_nobody_admits_times_out_saying_why():
    with pytest.raises(DistributedTimeoutError, match="no member admitted it.*mesh.grow()"):
        _elastic.await_admission(board(), 5, "1 a", 0, timeout_s=0.1)


def test_members_polling_at_once_all_read_the_one_answer_and_the_waiting_ranks_are_admitted():
    """Ranks 0-3 poll while 4-7 wait to join, every one on its own thread: each poll has one
    answer on every member, and each waiting rank follows the chain to the record admitting
    it."""
    ranks = ThreadRanks(8, timeout_s=10)

    def rank_main(world):
        if world.rank in MEMBERS:
            for n in range(1, 200):
                grown = _elastic.poll(world.control, PLAN, n, MEMBERS)
                if grown is not None:  # as elastic.mesh.grow: it becomes what follows the epoch
                    return n, _elastic.next_of(world.control, PLAN.epoch, grown)
                time.sleep(0.01)
            return None
        return _elastic.await_admission(world.control, world.rank, f"{world.rank} hostA",
                                        PLAN.epoch, timeout_s=10)

    out = ranks.run(rank_main)
    assert len({json.dumps(o, sort_keys=True) for o in out[:4]}) == 1, out[:4]  # one answer
    n, grown = out[0]
    assert grown["shape"] == [2, 4] and grown["fresh"] == [4, 5, 6, 7], grown
    assert out[4:] == [grown] * 4
    for earlier in range(1, n):  # the polls before found a slice still incomplete
        key = keys.ELASTIC_POLL.format(epoch=PLAN.epoch, n=earlier)
        assert json.loads(ranks.store.get(key)) == {}


@pytest.fixture
def fake8():
    dist.init_process_group("fake", world_size=8, rank=0)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"elastic": "pp"}, UnknownDimError, "elastic='pp': is not a dim name"),
    ({"elastic": "dp", "elastic_min": 3}, ArgumentError, "elastic_min=3: must be in 1..2"),
    ({"elastic": "dp", "elastic_min": 0}, ArgumentError, "elastic_min=0: must be in 1..2"),
    ({"elastic_min": 2}, ArgumentError, "elastic_min=2: is set but elastic is not"),
    ({"elastic": "dp"}, ArgumentError, "elastic='dp': needs a store .* the fake engine"),
])
def test_bad_elastic_arguments_name_the_argument_and_the_fix(fake8, kwargs, error, words):
    with pytest.raises(error, match=words) as caught:
        dist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), **kwargs)
    assert "Fix:" in str(caught.value) or "use" in str(caught.value)


def test_a_mesh_made_without_elastic_cannot_recover(fake8):
    mesh = dist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert mesh.epoch == 0 and mesh.fresh_ranks == []
    with pytest.raises(ArgumentError, match="is not elastic, so recover"):
        mesh.recover(RuntimeError("x"))
    with pytest.raises(ArgumentError, match="is not elastic, so grow"):
        mesh.grow()


def test_elastic_true_picks_the_one_replicate_dim():
    from tensorplay.distributed.mesh import args

    roles = ("pipeline", "replicate", "tensor")
    assert args.elastic(True, 1, ("pp", "dp", "tp"), (2, 2, 2), roles) == (1, 1)
    assert args.elastic(False, 1, ("pp", "dp", "tp"), (2, 2, 2), roles) is None
    with pytest.raises(ArgumentError, match="elastic=True: picks the one 'replicate' dim, but "
                       "no dim has that role"):
        args.elastic(True, 1, ("pp", "dp", "tp"), (2, 2, 2), None)


@pytest.mark.slow  # four worlds on threads, three epochs: about 1 s on a busy machine
def test_roles_and_abstract_hold_through_a_shrink_and_a_grow_back():
    """4 thread ranks, (2, 2) ("dp", "tp") elastic along the "replicate" dim: rank 3 lost, the
    (1, 2) mesh of epoch 1, then (2, 2) again at epoch 2 (the decisions recover() and grow()
    would write), on every rank that stays."""
    from tensorplay.distributed.elastic import mesh as elastic_mesh

    grow_back = {"epoch": 2, "shape": [2, 2], "ranks": [0, 1, 2, 3], "fresh": [2, 3]}

    def rank_main(world):
        mesh = elastic_mesh.init(world, "cpu", (2, 2), ("dp", "tp"), ("gloo", "gloo"), False,
                                 (0, 1), given=True, roles=("replicate", "tensor"))
        try:
            shrunk = enter(world, mesh, mesh.parts.plan, {"epoch": 1, "shape": [1, 2],
                                                     "ranks": [0, 1], "lost": [3],
                                                     "spares": [2]}, kind="shrink")
        except StaleEpochError as told:  # the lost rank is told to leave; it comes back
            # (as its replacement would) when the mesh grows back
            return str(told), enter(world, mesh, mesh.parts.plan, grow_back, kind="join").abstract
        grown = enter(world, shrunk, shrunk.parts.plan, grow_back, kind="grow")
        return mesh.abstract, shrunk.abstract, grown.abstract, grown.mesh_dim_roles

    out = ThreadRanks(4).run(rank_main)
    for first, shrunk, grown, roles in out[:3]:
        assert first == grown and hash(first) == hash(grown)
        assert first.roles == ("replicate", "tensor") and roles == {"dp": "replicate",
                                                                    "tp": "tensor"}
        assert shrunk.shape == (1, 2) and shrunk.roles == first.roles and shrunk != first
    told, back = out[3]
    assert "agreed it was lost" in told and back == out[0][0]


LOST = {"epoch": 1, "shape": [1, 2], "ranks": [0, 1], "lost": [3], "spares": [2]}
BACK = {"epoch": 2, "shape": [2, 2], "ranks": [0, 1, 2, 3], "fresh": [2, 3]}


def _grow_without_rank_3(world, back):
    """4 thread ranks, (2, 2) elastic on dim 0: rank 3 lost (it leaves), then admitted again
    at epoch 2 (``back``) but never there; on ranks 0-2, what grow() would return."""
    from tensorplay.distributed.elastic import mesh as elastic_mesh

    mesh = elastic_mesh.init(world, "cpu", (2, 2), ("dp", "tp"), ("gloo", "gloo"), False,
                             (0, 1), given=True)
    try:
        shrunk = enter(world, mesh, mesh.parts.plan, LOST, kind="shrink")
    except StaleEpochError:
        return None
    grown = enter(world, shrunk, shrunk.parts.plan, back, kind="grow")
    return grown.epoch, grown.shape, grown.get_coordinate(), grown.last_recovery


def test_a_rank_admitted_that_died_before_it_entered_is_lost_at_once(monkeypatch):
    """Rank 3's replacement admitted into epoch 2 (its token: a pid on this host that has
    ended): ranks 0-2 do not wait for it (ENTER_S is set far longer than the test may take);
    they recover from epoch 2 at once, to epoch 3 without its slice, rank 2 a spare again."""
    bound_s = timing.guard(60)
    monkeypatch.setattr(_elastic, "ENTER_S", bound_s)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    back = {**BACK, "admitted": {"3": f"{child.pid} {knobs.hostname()}"}}
    began = time.monotonic()
    out = ThreadRanks(4).run(_grow_without_rank_3, back)
    assert time.monotonic() - began < bound_s
    for rank, (epoch, shape, coordinate, record) in enumerate(out[:3]):
        assert (epoch, shape) == (3, (1, 2)), out
        assert coordinate == ([0, rank] if rank < 2 else None)
        assert record.kind == "shrink" and record.lost_ranks == (3,)


def test_a_rank_admitted_that_never_enters_is_lost_after_enter_s(monkeypatch):
    """Rank 3 admitted but neither there nor seen dead (as on another host): the others wait
    ENTER_S, then recover from epoch 2 as above."""
    from tensorplay.distributed.elastic import mesh as elastic_mesh

    monkeypatch.setattr(_elastic, "ENTER_S", 0.5)
    monkeypatch.setattr(elastic_mesh, "WAIT_S", 0.5)  # rank 3 never comes to the recovery
    out = ThreadRanks(4).run(_grow_without_rank_3, BACK)
    assert [o[:2] for o in out[:3]] == [(3, (1, 2))] * 3, out


def test_a_rank_that_entered_but_died_as_the_groups_are_made_costs_enter_s_not_the_timeout(
        monkeypatch):
    """Rank 3 arrives at epoch 2 (its mark posted), then is gone before it makes its groups:
    the others' group making gives up after ENTER_S (not the world's timeout, set far longer
    here) and they recover from epoch 2 as above."""
    from tensorplay.distributed.elastic import mesh as elastic_mesh

    timeout_s = timing.guard(60)
    monkeypatch.setattr(_elastic, "ENTER_S", 1.0)
    monkeypatch.setattr(elastic_mesh, "WAIT_S", 0.5)  # rank 3, alive, never comes to recover

    def rank_main(world):
        if world.rank != 3:
            return _grow_without_rank_3(world, BACK)
        from tensorplay.distributed.elastic import mesh as elastic_mesh

        mesh = elastic_mesh.init(world, "cpu", (2, 2), ("dp", "tp"), ("gloo", "gloo"), False,
                                 (0, 1), given=True)
        with pytest.raises(StaleEpochError):
            enter(world, mesh, mesh.parts.plan, LOST, kind="shrink")
        world.open_epoch(2, present=BACK["ranks"])
        return _elastic.enter_together(_elastic.board_of(world), BACK, 3, lambda: [])

    threads = ThreadRanks(4, timeout_s=timeout_s)
    threads.engine.meets = True  # a group is made once all its members make it, as gloo's
    began = time.monotonic()
    out = threads.run(rank_main)
    assert time.monotonic() - began < timeout_s
    assert out[3] == []  # every fresh rank had arrived
    for epoch, shape, _, record in out[:3]:
        assert (epoch, shape) == (3, (1, 2)), out
        assert record.kind == "shrink" and record.lost_ranks == (3,)
