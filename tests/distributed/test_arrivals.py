"""The lazy arrival marks of blocking barriers, on an in-process store."""

from __future__ import annotations

import time

import torch.distributed as torch_dist

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
