"""The lazy arrival marks of blocking barriers, on the tests' in-memory store."""

from __future__ import annotations

import logging
import re
import time

from hypothesis import given
from hypothesis import strategies as st

from tensorplay.distributed.control import arrivals
from tests.fakes import MemoryStore
from tests.laws import examples


def _posted(store, key: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        time.sleep(0.02)
    return False


def test_a_wait_that_ends_quickly_writes_nothing(monkeypatch):
    monkeypatch.setattr(arrivals, "MARK_AFTER_S", 0.6)
    store = MemoryStore()
    arrivals.begin(store, "quick", 0)
    time.sleep(0.05)
    arrivals.end()
    assert not _posted(store, "quick", within_s=0.6 + 3 * arrivals.POLL_S)


def test_a_wait_that_lasts_is_marked_while_it_waits():
    store = MemoryStore()
    arrivals.begin(store, "slow", 0)
    try:
        assert _posted(store, "slow", within_s=5.0)
    finally:
        arrivals.end()


def test_settle_posts_our_own_mark_at_once_and_waits_for_late_ones():
    store = MemoryStore()
    arrivals.begin(store, "mine", 0)
    start = time.monotonic()
    arrivals.settle(store, "mine")
    assert store.check(["mine"]) and time.monotonic() - start >= arrivals.SETTLE_S
    assert arrivals._waiting is None


def test_a_mark_that_fails_not_for_the_store_is_said_and_the_next_wait_is_marked(caplog):
    """The thread that posts the marks stops on an error that is no failure of the store's
    (here a TypeError): said once; the next wait starts another thread, which marks it."""
    caplog.set_level(logging.ERROR, logger="tensorplay.distributed")

    class Broken(MemoryStore):
        def set(self, key, value):
            raise TypeError("a mark's bug")

    arrivals.begin(Broken(), "broken", 3)
    deadline = time.monotonic() + 5.0
    while arrivals._watching and time.monotonic() < deadline:  # until it stopped
        time.sleep(0.02)
    arrivals.end()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and re.fullmatch(r"rank \d+: the barrier arrival marks stopped on an "
                                           r"unexpected error: TypeError: a mark's bug", said[0])
    store = MemoryStore()
    arrivals.begin(store, "after", 3)
    try:
        assert _posted(store, "after", within_s=5.0)
    finally:
        arrivals.end()


def _holding(keys) -> MemoryStore:
    """A store that holds ``keys``."""
    store = MemoryStore()
    keys = list(keys)
    if keys:
        store.multi_set(keys, ["1"] * len(keys))
    return store


@examples(0.6)
@given(st.integers(0, 300).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0)), max_size=n))))
def test_unset_finds_exactly_the_keys_nobody_set(case):
    n, missing = case
    missing = {i for i in missing if i < n}
    keys = [f"k/{i}" for i in range(n)]
    store = _holding(k for i, k in enumerate(keys) if i not in missing)
    assert arrivals.unset(store, keys) == sorted(missing)


def test_naming_one_absent_rank_of_100000_takes_few_round_trips():
    keys = [f"k/{i}" for i in range(100_000)]
    store = _holding(keys[:61_234] + keys[61_235:])
    before = store.calls
    assert arrivals.unset(store, keys) == [61_234]
    assert store.calls - before < 100  # one check per key would be 100,000
