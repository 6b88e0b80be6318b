"""The tests' own fakes (tests/fakes.py) behave as what they stand for: torch's store, and ranks
that meet across threads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from tests import timing
from tests.fakes import MemoryStore, ThreadRanks


def _classify(err: BaseException) -> str | None:
    from tensorplay.distributed.backends.torch_c10d import ENGINE

    return ENGINE.classify(err)


def test_values_are_read_as_bytes_and_check_does_not_wait():
    store = MemoryStore(timedelta(seconds=0.05))
    store.set("a", "1")
    store.multi_set(["b", "c"], ["2", b"3"])
    assert store.get("a") == b"1" and store.multi_get(["b", "c"]) == [b"2", b"3"]
    assert store.check(["a", "b"]) and not store.check(["a", "z"])
    assert store.keys() == ["a", "b", "c"] and store.calls == 6


def test_compare_set_is_torchs():
    store = MemoryStore()
    assert store.compare_set("k", "", "first") == b"first"
    assert store.compare_set("k", "", "second") == b"first"  # the first stands
    assert store.compare_set("k", "first", "third") == b"third"  # swapped when it matches
    assert store.compare_set("absent", "x", "y") == b"x" and not store.check(["absent"])


def test_a_wait_returns_once_another_thread_sets_the_key():
    store = MemoryStore(timedelta(seconds=10))
    threading.Timer(0.05, lambda: store.clone().set("late", "v")).start()
    assert store.multi_get(["late"]) == [b"v"]


def test_a_wait_that_expires_raises_what_the_torch_engine_calls_a_timeout():
    store = MemoryStore(timedelta(seconds=0.1))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="wait timeout after 100ms, keys: never") as caught:
        store.get("never")
    assert 0.1 <= time.monotonic() - start < timing.bound(0.1, 5), timing.describe()
    assert _classify(caught.value) == "timeout"


def test_a_clone_shares_the_keys_but_has_its_own_timeout():
    store = MemoryStore(timedelta(seconds=30))
    clone = store.clone()
    clone.set_timeout(timedelta(seconds=0.05))
    clone.set("k", "v")
    assert store.get("k") == b"v" and store.timeout == timedelta(seconds=30)
    with pytest.raises(RuntimeError, match="timeout"):
        clone.get("other")


def test_a_killed_store_fails_every_call_and_every_wait_as_a_lost_peer():
    store = MemoryStore(timedelta(seconds=30))
    threading.Timer(0.05, store.kill).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection reset by peer") as caught:
        store.get("never")  # woken by the death, not by its timeout
    assert time.monotonic() - start < timing.bound(0, 10), timing.describe()  # not 30 s
    assert _classify(caught.value) == "peer_lost"
    for call in (lambda: store.set("k", "v"), lambda: store.check(["k"]), store.clone,
                 lambda: store.clone().compare_set("k", "", "v")):
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            call()


def test_thread_ranks_have_their_own_worlds_and_meet_in_collectives():
    import numpy as np

    ranks = ThreadRanks(3, timeout_s=5)

    def fn(world):
        x = np.full(2, float(world.rank))
        world.default_group.ops.all_reduce(x, None, False)
        return world.rank, world.size, x.tolist(), world.store is not ranks.store

    assert ranks.run(fn) == [(r, 3, [3.0, 3.0], True) for r in range(3)]
    assert ranks.run(lambda w: w.rank, ranks=[2]) == [None, None, 2]
    assert ranks.world(1) is ranks.world(1)  # the worlds last across runs


def test_thread_ranks_run_every_collective_as_the_engines_do():
    """3 thread ranks, each group's collectives (``ThreadOps``, as ``group.ops`` runs them):
    rank r holds r + 1, rank 0 is the root of the rooted calls."""
    import numpy as np

    def fn(world):
        me, ops = world.rank, world.default_group.ops
        mine = np.full(1, me + 1.0)
        out = {}
        for name, call in {
                "all_reduce": lambda t: ops.all_reduce(t, None, False),
                "broadcast": lambda t: ops.broadcast(t, 0, False),
                "reduce": lambda t: ops.reduce(t, 0, None, False)}.items():
            t = mine.copy()
            call(t)
            out[name] = t.tolist()
        parts = [np.zeros(1) for _ in range(3)]
        ops.all_gather(parts, mine, False)
        out["all_gather"] = [p.tolist() for p in parts]
        t = np.zeros(3)
        ops.all_gather_into_tensor(t, mine, False)
        out["all_gather_into_tensor"] = t.tolist()
        t = np.zeros(1)
        ops.reduce_scatter_tensor(t, mine * [1, 10, 100], None, False)
        out["reduce_scatter_tensor"] = t.tolist()
        t = np.zeros(3)
        ops.all_to_all_single(t, mine * [1, 10, 100], None, None, False)
        out["all_to_all_single"] = t.tolist()
        parts = [np.zeros(1) for _ in range(3)]
        ops.gather(mine, parts if me == 0 else None, 0, False)
        out["gather"] = [p.tolist() for p in parts]
        t = np.zeros(1)
        ops.scatter(t, [np.full(1, 10.0 * r) for r in range(3)] if me == 0 else None, 0, False)
        out["scatter"] = t.tolist()
        t = np.zeros(1)
        if me == 0:
            ops.send(np.full(1, 7.0), 2)
        elif me == 2:
            ops.recv(t, 0)
        out["recv"] = t.tolist()
        ops.barrier(False)
        return out

    out = ThreadRanks(3, timeout_s=5).run(fn)
    for rank, got in enumerate(out):
        assert got["all_reduce"] == [6.0] and got["broadcast"] == [1.0], got
        assert got["reduce"] == ([6.0] if rank == 0 else [rank + 1.0])
        assert got["all_gather"] == [[1.0], [2.0], [3.0]]
        assert got["all_gather_into_tensor"] == [1.0, 2.0, 3.0]
        assert got["reduce_scatter_tensor"] == [6.0 * 10 ** rank]
        assert got["all_to_all_single"] == [10.0 ** rank * (r + 1) for r in range(3)]
        assert got["gather"] == ([[1.0], [2.0], [3.0]] if rank == 0 else [[0.0]] * 3)
        assert got["scatter"] == [10.0 * rank]
        assert got["recv"] == ([7.0] if rank == 2 else [0.0])
