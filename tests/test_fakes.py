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
