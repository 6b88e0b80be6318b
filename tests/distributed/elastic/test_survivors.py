"""Agreement on the lost ranks (``elastic.survivors.agree_lost``): five ranks as threads over
one store (``tests.fakes.ThreadRanks``); every survivor gets the same answer or the same
refusal. The same in real jobs under tensorplay-run (a kill, a hang, a straggler) is in
test_recover.py."""

from __future__ import annotations

import re
import time

import pytest

from tensorplay.distributed.control import keys
from tensorplay.distributed.elastic import survivors as _survivors
from tensorplay.distributed.errors import ShrinkError, StaleEpochError
from tests import timing
from tests.fakes import ThreadRanks

MEMBERS = range(5)
GRACE_S = 0.5  # SUSPECT_GRACE_S in these tests (3 s in the package), so they run in a second


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(_survivors, "SUSPECT_GRACE_S", GRACE_S)


ROUNDS: dict[str, int] = {}  # each round's name -> the epoch it runs in (a key space of its own)


def _attempt(name: str, suspects=lambda rank: (), late=(), dead=lambda rank: (), **kw):
    """A rank's body: agree_lost at round ``name``; (what it returned or raised, seconds).
    The ranks in ``late`` come only once the others have posted their verdict."""
    epoch = ROUNDS.setdefault(name, len(ROUNDS))

    def body(world):
        if world.rank in late:
            world.store.get(keys.RECOVER_VERDICT.format(epoch=epoch))  # waits for it
        start = time.monotonic()
        try:
            got = _survivors.agree_lost(world.control, epoch, world.rank, MEMBERS,
                                        suspects(world.rank), dead=lambda: dead(world.rank), **kw)
        except (ShrinkError, StaleEpochError) as err:
            got = f"{type(err).__name__}: {err}"
        return got, time.monotonic() - start
    return body


def test_a_suspected_rank_that_never_comes_is_lost_after_the_grace_not_the_wait():
    wait_s = timing.bound(GRACE_S, 3)
    out = ThreadRanks(5).run(_attempt("one lost", lambda r: {3} if r in (2, 4) else (),
                                      wait_s=wait_s), ranks=[0, 1, 2, 4])
    for rank in (0, 1, 2, 4):
        got, took = out[rank]
        assert got == [3], (rank, got)
        assert took < wait_s, (rank, took, timing.describe())  # no wait_s spent on it


def test_a_rank_seen_dead_is_lost_at_once(monkeypatch):
    grace_s = timing.bound(GRACE_S, 2)
    monkeypatch.setattr(_survivors, "SUSPECT_GRACE_S", grace_s)
    out = ThreadRanks(5).run(_attempt("seen dead", dead=lambda r: {3} if r == 2 else (),
                                      wait_s=2 * grace_s), ranks=[0, 1, 2, 4])
    for rank in (0, 1, 2, 4):
        got, took = out[rank]
        assert got == [3] and took < grace_s, (rank, got, took)  # no grace, no wait


def test_a_suspect_that_is_alive_after_all_is_not_lost():
    out = ThreadRanks(5).run(_attempt("none lost", lambda r: {2} if r == 1 else (), wait_s=5))
    assert [got for got, _ in out] == [[]] * 5, out


@pytest.mark.parametrize("seen_alive", [False, True])
def test_a_rank_that_comes_after_the_verdict_is_told_it_was_lost(seen_alive):
    """Rank 4 comes once the others decided: it is lost, and its error says it was alive. When
    the deciding rank saw its process running on its host (``alive``), the verdict says that
    too (issue 41: the job's last line quoted such an error as the first failure)."""
    alive = (lambda: [4]) if seen_alive else (lambda: ())
    out = ThreadRanks(5).run(_attempt(f"late {seen_alive}", late={4}, wait_s=0.3, alive=alive))
    assert [got for got, _ in out[:4]] == [[4]] * 4, out
    seen = r"; lost though alive on rank [0-3]'s host: 4" if seen_alive else ""
    assert re.fullmatch(
        r"StaleEpochError: rank 4 was declared lost while alive: it reached the recovery after "
        r"the others had agreed it was lost \(lost: 4; decided by rank [0-3] after "
        r"(0\.[3-9]|[1-9]\d*\.\d) s, the wait ran out; seen dead: none; suspected: none"
        rf"{seen}\); it must leave the job\. Fix: make it reach the recovery sooner, or raise "
        r"the wait", out[4][0]), out[4]


def test_without_a_majority_every_survivor_gets_the_same_refusal():
    out = ThreadRanks(5).run(_attempt("no majority", timeout_s=0.5), ranks=[0, 1])
    for rank in (0, 1):
        assert re.fullmatch(
            r"ShrinkError: only ranks 0-1 of 5 members came to the recovery \(decided by rank "
            r"[01] after (0\.[5-9]|[1-9]\d*\.\d) s, the wait ran out; seen dead: none; "
            r"suspected: none\): no majority of the members not seen dead, so no part of the job "
            r"may go on alone\. "
            r"Fix: restart the job from its last checkpoint", out[rank][0]), out[rank]
    assert out[0][0] == out[1][0]  # the same words: one verdict, read by both
