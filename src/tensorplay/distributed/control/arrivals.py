"""Arrival marks of blocking barriers, posted only when the wait lasts.

A barrier that times out names the members that never came: those with no mark in the store.
Posting the mark at every call would cost each rank a round trip to rank 0's store per barrier
(a world barrier of 100,000 ranks: 100,000 writes to one server, and keys never read). Instead
one daemon thread per process posts the mark of a wait that has lasted MARK_AFTER_S; a barrier
that ends sooner writes nothing. A rank whose barrier timed out posts its own mark and waits
SETTLE_S, so that every rank that came before its deadline has posted, then reads who is
missing. The store's client serialises its operations, so the thread may share it.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import time
from typing import Any

from ..backends.protocol import StoreFailed
from ..job.watch import reported

MARK_AFTER_S = 0.2
POLL_S = 0.1
SETTLE_S = MARK_AFTER_S + 4 * POLL_S
LEAF = 16  # unset(): a part this small is checked key by key

_waiting: tuple[Any, str, float] | None = None  # (store, key, since) of this process's wait
_watching = False


def begin(store: Any, key: str, rank: int) -> None:
    """Rank ``rank`` (this process) starts a blocking wait whose arrival mark is ``key``."""
    global _waiting, _watching
    _waiting = (store, key, time.monotonic())
    if not _watching:
        _watching = True
        # not threading.Thread: its start() waits until the new thread has been scheduled
        _thread.start_new_thread(reported("the barrier arrival marks", rank, _watch,
                                          _stopped), ())


def end() -> None:
    """The wait begun last is over (passed or failed)."""
    global _waiting
    _waiting = None


def settle(store: Any, key: str) -> None:
    """After a timeout: post our own mark, then give late waiters time to post theirs."""
    end()
    try:
        store.set(key, "1")
    except StoreFailed:  # the store is gone: nobody can be named (absent() says)
        return
    time.sleep(SETTLE_S)


def unset(store: Any, keys: list[str]) -> list[int]:
    """Indices of ``keys`` that are not set in ``store`` (store errors propagate).

    Halves the list while one of its keys is missing, so k unset keys of N cost about
    2k*log2(N/LEAF) checks of many keys each plus LEAF single ones per unset key, not N
    round trips: naming one absent rank of 100,000 takes tens of round trips.
    """
    found: list[int] = []
    parts = [(0, len(keys))]
    while parts:
        lo, hi = parts.pop()
        if hi - lo <= LEAF:
            found += [i for i in range(lo, hi) if not store.check([keys[i]])]
        elif not store.check(keys[lo:hi]):
            mid = (lo + hi) // 2
            parts += [(mid, hi), (lo, mid)]
    return found


def _watch() -> None:
    posted = None  # (key, since) of the last mark posted; never the store, which must close
    while True:
        time.sleep(POLL_S)
        waiting = _waiting
        if (waiting is not None and waiting[1:] != posted
                and time.monotonic() - waiting[2] >= MARK_AFTER_S):
            posted = waiting[1:]
            with contextlib.suppress(StoreFailed):  # the store is gone; the wait will say so
                waiting[0].set(waiting[1], "1")
        del waiting


def _stopped(err: BaseException) -> None:
    """The thread ended on an error (said already): the next wait starts another."""
    global _watching
    _watching = False


def _forked() -> None:
    global _waiting, _watching
    _waiting, _watching = None, False  # the thread did not survive the fork


os.register_at_fork(after_in_child=_forked)
