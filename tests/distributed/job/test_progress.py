"""A call that lasts says what it waits in (``job/progress.py``), once; a quick one says nothing.

In this process: the test's main thread is rank 0 of two ranks run as threads
(``tests.fakes.ThreadRanks``); its all_reduce waits for rank 1, which comes late."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from tensorplay.distributed import collectives
from tensorplay.distributed.job import progress
from tests.fakes import ThreadRanks

AFTER_S = 0.2  # TENSORPLAY_PROGRESS_S in these tests


@pytest.fixture
def watched(monkeypatch, caplog):
    """Two thread ranks; the main thread (rank 0) watched; the notes logged."""
    monkeypatch.setattr(progress, "LOOK_EVERY_S", 0.05)
    ranks = ThreadRanks(2, timeout_s=20)
    caplog.set_level(logging.WARNING, logger="tensorplay.distributed")
    progress.watch(ranks.world(0), AFTER_S)
    yield ranks, lambda: [r.getMessage() for r in caplog.records if "still in" in r.getMessage()]
    progress.stop()


def _all_reduce(world, late_s: float = 0.0) -> None:
    time.sleep(late_s)
    collectives.all_reduce(np.ones(1), group=world.default_group)


def test_a_long_wait_says_what_it_waits_in_once(watched):
    ranks, notes = watched
    late = threading.Thread(target=_all_reduce, args=(ranks.world(1), 4 * AFTER_S))
    late.start()
    _all_reduce(ranks.world(0))  # waits for rank 1
    late.join()
    assert len(notes()) == 1, notes()  # said once
    assert notes()[0].startswith("rank 0: still in all_reduce() on the world group [0-1] "
                                 "after "), notes()
    assert notes()[0].endswith("(waits up to 20 s)"), notes()


def test_a_quick_call_says_nothing(watched):
    ranks, notes = watched
    other = threading.Thread(target=_all_reduce, args=(ranks.world(1),))
    other.start()
    _all_reduce(ranks.world(0))
    other.join()
    time.sleep(2 * AFTER_S)
    assert notes() == []
