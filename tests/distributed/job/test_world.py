"""The world: joining, asking it about ranks and groups, and a rendezvous that cannot hang."""

from __future__ import annotations

import time

import pytest
import torch

import tensorplay.distributed as dist
from tests import spawn, timing


def queries_job(rank: int):
    group = dist.new_group([6, 2, 4])  # kept in this order, not sorted
    again = dist.new_group([6, 2, 4])
    x = torch.tensor([float(rank)])
    if group.rank() >= 0:
        dist.all_reduce(x, group=group)
    return {
        "initialized": dist.is_initialized(), "rank": dist.get_rank(),
        "size": dist.get_world_size(), "backend": dist.get_backend(),
        "group_rank": dist.get_rank(group), "group_size": dist.get_world_size(group),
        "ranks": dist.get_process_group_ranks(group), "same": again is group,
        "torch_ranks": None if group.engine_group is None
        else torch.distributed.get_process_group_ranks(group.engine_group),
        "sum": x.item(), "world_ranks": dist.get_process_group_ranks(),
    }


@pytest.mark.slow
def test_world_queries_and_new_group_keep_the_given_order(world8):
    for rank, got in enumerate(world8.run(queries_job)):
        assert got["initialized"] and got["rank"] == rank and got["size"] == 8
        assert got["backend"] == "gloo" and got["world_ranks"] == list(range(8))
        assert got["ranks"] == [6, 2, 4] and got["group_size"] == 3 and got["same"]
        assert got["group_rank"] == ([6, 2, 4].index(rank) if rank in (6, 2, 4) else -1)
        if rank in (6, 2, 4):
            assert got["torch_ranks"] == [6, 2, 4] and got["sum"] == 12.0
        else:
            assert got["torch_ranks"] is None and got["sum"] == rank


def lonely_rendezvous(rank: int):
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", world_size=3, rank=rank, timeout=3)
    except dist.DistributedTimeoutError as err:
        return err.missing, str(err), time.monotonic() - start
    except dist.BackendError as err:  # rank 1: rank 0 timed out first and its store closed
        return None, str(err), time.monotonic() - start
    return "joined"


@pytest.mark.slow
@pytest.mark.faults
def test_rendezvous_names_the_rank_that_never_came():
    # ranks 0 and 1 of a world of 3 start; rank 2 never does
    results = spawn.run(lonely_rendezvous, 2, init=False, timeout=90)
    missing, text, elapsed = results[0]
    assert missing == [2] and "rank 2" in text and "rendezvous" in text
    assert elapsed < timing.bound(0, 45), timing.describe()
    assert results[1][0] in ([2], None)  # rank 1 may find the store already gone


def test_calls_before_init_say_how_to_fix():
    assert not dist.is_initialized()
    with pytest.raises(dist.NotInitializedError, match="init_process_group"):
        dist.get_rank()
    with pytest.raises(dist.NotInitializedError, match="Fix"):
        dist.new_group([0])


def test_fake_world_is_any_rank_of_any_size(fake_world):
    fake_world(123_456, 1_000_000)
    assert dist.get_rank() == 123_456 and dist.get_world_size() == 1_000_000
    assert dist.get_backend() == "fake"
    x = torch.ones(2)
    assert dist.all_reduce(x) is None and x.tolist() == [1.0, 1.0]  # left as it is
    group = dist.new_group([5, 123_456])
    assert group.rank() == 1 and dist.get_process_group_ranks(group) == [5, 123_456]


def file_and_tcp_job(rank: int, method: str):
    dist.init_process_group("gloo", method, world_size=2, rank=rank, timeout=30)
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x.item(), dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_file_and_tcp_init_methods(tmp_path, scheme):
    method = (f"file://{tmp_path}/rendezvous" if scheme == "file"
              else f"tcp://127.0.0.1:{spawn.free_port()}")
    assert spawn.run(file_and_tcp_job, 2, method, init=False) == [(3.0, False)] * 2


def test_tensorplay_timeout_is_the_worlds_timeout_when_none_is_passed(fake_world,
                                                                      monkeypatch):
    from tensorplay.distributed.world import current_world

    monkeypatch.setenv("TENSORPLAY_TIMEOUT", "3")
    fake_world(1, 4)
    assert current_world("test").timeout.total_seconds() == 3.0


def test_groups_of_a_destroyed_world_refuse_work_even_after_a_new_init(fake_world):
    fake_world(1, 4)
    old = dist.new_group([0, 1])
    dist.destroy_process_group()
    dist.init_process_group("fake", rank=1, world_size=4)
    with pytest.raises(dist.NotInitializedError, match="destroyed world"):
        dist.all_reduce(torch.zeros(1), group=old)
    assert dist.new_group([0, 1]) is not old  # the new world made its own


def reinit_job(rank: int):
    from tensorplay.distributed.device_mesh import init_device_mesh

    seen = []
    for i in range(3):  # three worlds in a row on the same MASTER_PORT
        dist.init_process_group("gloo", timeout=20)
        try:
            init_device_mesh("cpu", (2,), mesh_dim_names=(f"r{rank}" if i == 2 else "x",))
            seen.append("built")
        except dist.MeshMismatchError:
            seen.append("mismatch")
        if rank == 0 and i == 0:
            time.sleep(2)  # rank 1 re-inits while rank 0's old store still listens
        dist.destroy_process_group()
    return seen


@pytest.mark.slow
def test_a_new_world_after_destroy_listens_again_and_checks_afresh():
    """Rank 0's store closes at destroy; rank 1, connected early to the old one, moves to the
    new one, and the next world's checks see only its own answers."""
    assert spawn.run(reinit_job, 2, init=False, timeout=120) == [["built", "built",
                                                                  "mismatch"]] * 2


def miscounted_job(rank: int) -> str:
    from tensorplay.distributed.control import keys

    if rank == 1:
        keys.next_world()  # as if rank 1 alone had started a world before
    try:
        dist.init_process_group("gloo", timeout=3)
    except dist.DistributedTimeoutError as err:
        return str(err)
    return "joined"


@pytest.mark.slow
@pytest.mark.faults
def test_a_rank_that_counted_worlds_differently_is_told_so_not_hung():
    zero, one = spawn.run(miscounted_job, 2, init=False, timeout=60)
    assert "rank 1 had not arrived" in zero
    assert "never opened world 'tensorplay/world_2/'" in one
    assert "same number of times" in one


def test_a_client_waits_for_rank_0_to_listen_then_returns():
    """Ranks that start before rank 0 listens probe the port instead of backing off."""
    import socket
    import threading

    from tensorplay.distributed.host import netif

    port = spawn.free_port()
    listening = threading.Event()

    def listen_later():
        time.sleep(0.3)
        server = socket.create_server(("127.0.0.1", port))
        listening.set()
        time.sleep(3)
        server.close()

    threading.Thread(target=listen_later, daemon=True).start()
    netif.await_listener("127.0.0.1", port, time.monotonic() + 20)
    assert listening.is_set()


def test_with_nobody_listening_the_probe_gives_up_at_its_deadline():
    from tensorplay.distributed.host import netif

    start = time.monotonic()
    netif.await_listener("127.0.0.1", spawn.free_port(), start + 0.5)
    assert 0.5 <= time.monotonic() - start < timing.bound(0.5, 9.5)


def test_a_new_epoch_makes_fresh_groups_and_keys(fake_world):
    from tensorplay.distributed.control import keys
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.world import current_world

    fake_world(5, 8)
    world = current_world("test")
    old = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert old.get_group("dp").name.startswith("fake-e0-")
    assert world.spmd.key(keys.CHECK_OUTCOME, n=1) == "e0/check/1/outcome"
    assert world.open_epoch() == 1
    new = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert new == old  # the same value ...
    assert new.get_group("dp") is not old.get_group("dp")  # ... on fresh groups
    assert new.get_group("dp").name.startswith("fake-e1-")
    assert new.get_group("dp").ranks == [1, 5]
    assert world.spmd.key(keys.CHECK_OUTCOME, n=1) == "e1/check/1/outcome"
    assert world.spmd.counts() == {}  # counters restart in the new epoch
    # the whole world flattened in the new epoch: a group of its own, not the old world group
    # (kept retired, so that its use says so)
    flat = new.flatten().get_group()
    assert flat is not world.default_group and not flat.retired
    assert flat.ranks == list(range(8)) and flat.name.startswith("fake-e1-")
    assert world.default_group.retired


def test_one_rank_needs_no_address(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    dist.init_process_group("gloo", rank=0, world_size=1, timeout=30)
    try:
        x = torch.ones(2)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0] and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_a_port_in_use_is_said_at_once_not_as_a_timeout(monkeypatch):
    import socket
    import time

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "2"),
                            ("MASTER_PORT", str(taken.getsockname()[1]))):
            monkeypatch.setenv(name, value)
        start = time.monotonic()
        with pytest.raises(dist.BackendError, match=r"rank 0 cannot listen on 127\.0\.0\.1:\d+ "
                           r"for the rendezvous store: \[Errno 98\] Address already in use"):
            dist.init_process_group("gloo", timeout=60)
        assert time.monotonic() - start < timing.bound(0, 10)  # at once, not at the timeout
        assert not dist.is_initialized()
    finally:
        taken.close()


def test_the_interface_chosen_for_a_world_is_dropped_with_it(monkeypatch):
    import os

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{spawn.free_port()}", rank=0,
                            world_size=1, timeout=30)
    try:
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"  # the route to 127.0.0.1
    finally:
        dist.destroy_process_group()
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # not inherited by what runs next


# -- groups made at first use (ranks as threads over the in-memory store) ------------------------


def _ep(world):
    """Rank 0-3's 'ep' group of a world of 6, registered to be made at its first use."""
    from tensorplay.distributed.geometry.spec import Ranks
    from tensorplay.distributed.job.world import GroupName

    return world.group(Ranks.of(range(4)), name=GroupName("'ep'", use="'ep' of (ep,)"),
                       make=False)


def _first_use(world):
    """Register the group twice (one object), then reduce over it: its members make it."""
    import numpy as np

    group = _ep(world)
    before = (group.made, world.registry.created, _ep(world) is group)
    x = np.full(1, float(world.rank))
    group.usable("all_reduce()").all_reduce(x, dist.ReduceOp.SUM, False)
    return before, (group.made, world.registry.created, float(x[0]), world.registry.uses(group))


@pytest.mark.slow  # threads meeting over the store: about 0.6 s on a busy machine
def test_a_group_made_at_first_use_is_one_object_made_once_by_its_members():
    from tests.fakes import ThreadRanks

    ranks = ThreadRanks(6)
    ranks.engine.meets = True  # making it waits for every member, as gloo does
    out = ranks.run(_first_use, ranks=range(4))
    for before, after in out[:4]:
        assert before == (False, 0, True)  # registered, not made, one object
        assert after == (True, 1, 6.0, ["'ep' of (ep,)"])
    assert len(ranks.engine.made) == 4  # once per member


@pytest.mark.slow  # a 1 s timeout, then the arrival marks settle
def test_a_group_whose_members_do_not_all_come_to_its_first_use_names_them_in_time():
    from tests.fakes import ThreadRanks

    ranks = ThreadRanks(6, timeout_s=1.0)
    ranks.engine.meets = True
    start = time.monotonic()
    out = ranks.run(_first_use, ranks=[0, 1, 2])  # rank 3 never reduces over 'ep'
    elapsed = time.monotonic() - start
    for rank in (0, 1, 2):
        err = out[rank]
        assert isinstance(err, dist.DistributedTimeoutError), out
        assert err.missing == [3]
        assert "creating the 'ep' group [0-3] at its first use (all_reduce())" in str(err)
        assert "rank 3 had not arrived. Fix:" in str(err)
    assert elapsed < timing.bound(1.0, 5.0)
    assert ranks.engine.made == []  # nobody holds a half-made group


def _stuck_creation(rank_2_dead: bool = False):
    """Rank 0 of a 4-rank thread world whose engine's group creation never returns by itself
    (as gloo's rendezvous with a peer that gave up was seen to: 120 s in a group made with a
    30 s timeout), and the event that frees the abandoned creation at the test's end.
    ``rank_2_dead``: rank 2 "on this host" has exited."""
    import threading

    from tests.fakes import ThreadRanks, exited_pid

    ranks = ThreadRanks(4, host_pids={0: 1, 1: 1, 2: exited_pid(), 3: 1} if rank_2_dead
                        else None)
    released = threading.Event()
    ranks.engine.new_group = lambda *_args, **_kw: released.wait(60) and "late"
    return ranks.world(0), released


def _bounded_creation(world, within_s: float, meanwhile=None):
    """world.group([0, 1, 2], within=within_s) on a thread; (error or group, seconds)."""
    import threading
    from datetime import timedelta

    from tensorplay.distributed.geometry.spec import Ranks

    out: list = []
    start = time.monotonic()

    def make():
        try:
            out.append(world.group(Ranks.of([0, 1, 2]), within=timedelta(seconds=within_s)))
        except Exception as err:  # noqa: BLE001 - the test reads it
            out.append(err)

    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    if meanwhile is not None:
        meanwhile()
    thread.join(timing.bound(within_s * 1.1 + 1.0, 10.0))
    return (out[0] if out else None), time.monotonic() - start


def test_a_bounded_group_creation_that_the_engine_never_ends_times_out_at_its_bound(
        monkeypatch):
    from tensorplay.distributed.job import watch

    monkeypatch.setattr(watch, "_bound", lambda within_s: within_s)  # no grace for the
    world, released = _stuck_creation()  # engine's own error: this engine never raises one
    try:
        err, elapsed = _bounded_creation(world, 0.3)
    finally:
        released.set()
    assert isinstance(err, dist.DistributedTimeoutError), err
    assert err.timeout_s == 0.3 and "creating the group [0-2]" in str(err), err
    assert elapsed >= 0.3


def test_a_bounded_group_creation_is_given_up_once_its_epoch_is_severed():
    world, released = _stuck_creation()
    try:
        err, elapsed = _bounded_creation(world, 30.0, lambda: (time.sleep(0.2),
                                                                world.sever_epoch(0)))
    finally:
        released.set()
    assert isinstance(err, dist.RankFailedError), err
    assert "a recovery of epoch 0 began elsewhere while it was being made" in str(err), err
    assert elapsed < 30.0  # not the bound: the sever


def test_a_bounded_group_creation_is_given_up_once_a_member_on_this_host_died():
    world, released = _stuck_creation(rank_2_dead=True)
    try:
        err, elapsed = _bounded_creation(world, 30.0)
    finally:
        released.set()
    assert isinstance(err, dist.RankFailedError) and err.ranks == [2], err
    assert "rank 2 died while it was being made" in str(err), err
    assert elapsed < 30.0


def test_only_a_bounded_group_creation_meets_over_a_store_connection_of_its_own():
    """A bounded creation runs on a helper thread that is left blocked in the engine when it
    is given up: its rendezvous must not hold the store connection the recovery that follows
    uses (TorchEngine.new_group's ``apart``). An unbounded one runs on the caller's thread."""
    from datetime import timedelta

    from tensorplay.distributed.geometry.spec import Ranks
    from tests.fakes import ThreadRanks

    ranks = ThreadRanks(4)
    asked: list[bool] = []
    ranks.engine.new_group = lambda name, *_args, apart=False: asked.append(apart) or name
    world = ranks.world(0)
    world.group(Ranks.of([0, 1]), within=timedelta(seconds=5))
    world.group(Ranks.of([0, 2]))
    assert asked == [True, False]


@pytest.mark.parametrize(("rank", "compared"), [(1, True), (5, False)])
def test_a_rank_outside_the_current_members_leaves_without_comparing_counts(
        fake_world, monkeypatch, rank, compared):
    """After an elastic mesh shrank to ranks 0-3, spare rank 5's destroy_process_group posts
    no counts (nobody compares them, and under env:// the store may have gone with rank 0);
    member rank 1 still compares."""
    from tensorplay.distributed.control import accounting
    from tensorplay.distributed.world import current_world

    fake_world(rank, 8)
    current_world("test").open_epoch(1, present=[0, 1, 2, 3])
    calls: list[int] = []
    monkeypatch.setattr(accounting, "check_at_end", lambda world: calls.append(world.rank))
    dist.destroy_process_group()
    assert calls == ([rank] if compared else [])
    assert not dist.is_initialized()
