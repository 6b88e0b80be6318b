"""StoreControl's verbs that the protocol tests do not reach: arrivals named after a timeout,
the exchange bounded by its wait, rank 0 lingering for the others at the end, the Board."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from tensorplay.distributed.backends.protocol import StoreGone, StoreTimedOut
from tensorplay.distributed.control import arrivals as _arrivals
from tensorplay.distributed.control.plane import Board
from tensorplay.distributed.errors import DistributedTimeoutError
from tests import timing
from tests.fakes import MemoryStore, ThreadRanks, board


def test_a_blocking_wait_that_times_out_names_the_members_that_never_arrived():
    ranks = ThreadRanks(3)

    def waiter(world):
        step = "barrier() #1 on the world group [0-2]"
        try:
            with world.control.arrivals(step, "world", [0, 1, 2], 1):
                time.sleep(_arrivals.MARK_AFTER_S + 2 * _arrivals.POLL_S)  # lasts: it is marked
                raise DistributedTimeoutError(step, 1.0, None)
        except DistributedTimeoutError as err:
            return err

    out = ranks.run(waiter, ranks=[0, 1])
    for err in out[:2]:
        assert isinstance(err, DistributedTimeoutError) and err.missing == [2], err
        assert str(err).startswith("timed out after 1 s in barrier() #1 on the world group "
                                   "[0-2]: rank 2 had not arrived"), err


def test_an_exchange_returns_what_was_posted_within_its_wait():
    ranks = ThreadRanks(3)
    ranks.run(lambda w: w.control.exchange("calls", f"c{w.rank}", [], 0.0), ranks=[1])
    start = time.monotonic()
    got = ranks.world(0).control.exchange("calls", "c0", [0, 1, 2], 0.2)
    assert got == {0: "c0", 1: "c1"}  # rank 2 never posted
    assert 0.2 <= time.monotonic() - start < timing.bound(0.2, 2)


def test_rank_0_lingers_at_the_end_until_every_rank_left():
    ranks = ThreadRanks(3)
    started = time.monotonic()
    out = ranks.run(lambda w: (time.sleep(0.3 * (w.rank == 2)), w.control.leave(5.0),
                               time.monotonic() - started)[-1])
    assert out[0] >= 0.3  # it waited for rank 2
    assert out[0] < timing.bound(0.3, 3)


def test_the_store_control_is_a_board_whose_first_decision_stands():
    world = ThreadRanks(2).world(0)
    board = world.control
    assert isinstance(board, Board)
    assert board.decide("k", "first") == "first" and board.decide("k", "second") == "first"
    board.post("m", "1")
    assert board.peek(["m", "absent"]) == ["1", None]
    assert board.unposted(["m", "absent"]) == [1]
    with board.briefly():
        assert board.wait(["m"]) == ["1"]
    assert board.clone().peek(["k"]) == ["first"]


def test_the_store_s_failures_are_ours_judged_by_the_engine_and_a_bug_comes_through():
    """The control plane's store (``JobStore``): a wait that runs out is StoreTimedOut, a
    server gone StoreGone, each from the engine's error; a bug of the caller's is not the
    store's failure and is raised as it is."""
    store = MemoryStore(timedelta(seconds=0.05))
    over = board(store)
    with pytest.raises(StoreTimedOut, match="wait timeout") as waited:
        over.wait(["never posted"])
    assert isinstance(waited.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="zip"):  # two values for one key: not the store's
        over._store.multi_set(["a"], ["1", "2"])
    store.kill()
    with pytest.raises(StoreGone, match="Connection reset by peer") as gone:
        over.post("k", "1")
    assert str(gone.value.__cause__) == "Connection reset by peer"
    with pytest.raises(StoreGone):
        over.clone()
