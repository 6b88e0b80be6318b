"""The lazy arrival marks of blocking barriers, on an in-process store."""

from __future__ import annotations

import time

import torch.distributed as torch_dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorplay.distributed import _arrivals


def _posted(store, key: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        time.sleep(0.02)
    return False


def test_a_wait_that_ends_quickly_writes_nothing(monkeypatch):
    monkeypatch.setattr(_arrivals, "MARK_AFTER_S", 2.0)
    store = torch_dist.HashStore()
    _arrivals.begin(store, "quick")
    time.sleep(0.05)
    _arrivals.end()
    assert not _posted(store, "quick", within_s=2.5)


def test_a_wait_that_lasts_is_marked_while_it_waits():
    store = torch_dist.HashStore()
    _arrivals.begin(store, "slow")
    try:
        assert _posted(store, "slow", within_s=5.0)
    finally:
        _arrivals.end()


def test_settle_posts_our_own_mark_at_once_and_waits_for_late_ones():
    store = torch_dist.HashStore()
    _arrivals.begin(store, "mine")
    start = time.monotonic()
    _arrivals.settle(store, "mine")
    assert store.check(["mine"]) and time.monotonic() - start >= _arrivals.SETTLE_S
    assert _arrivals._waiting is None


class _CountingStore:
    """A store that holds ``present`` keys and counts the round trips made to it."""

    def __init__(self, present):
        self.present, self.calls = set(present), 0

    def check(self, keys):
        self.calls += 1
        return all(k in self.present for k in keys)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0)), max_size=n))))
def test_unset_finds_exactly_the_keys_nobody_set(case):
    n, missing = case
    missing = {i for i in missing if i < n}
    keys = [f"k/{i}" for i in range(n)]
    store = _CountingStore(k for i, k in enumerate(keys) if i not in missing)
    assert _arrivals.unset(store, keys) == sorted(missing)


def test_naming_one_absent_rank_of_100000_takes_few_round_trips():
    keys = [f"k/{i}" for i in range(100_000)]
    store = _CountingStore(keys[:61_234] + keys[61_235:])
    assert _arrivals.unset(store, keys) == [61_234]
    assert store.calls < 100  # one check per key would be 100,000
