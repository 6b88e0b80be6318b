"""The elastic session's watcher (``elastic/session.py``), on thread ranks over the in-memory
store: an error it did not expect is said once (the log and stderr, naming the rank), and
reaches the main thread at its next grow() or recover(), this rank's groups broken meanwhile:
within a watch period, not the world's timeout."""

from __future__ import annotations

import logging
import threading
import time

from tensorplay.distributed.elastic import mesh as elastic_mesh
from tensorplay.distributed.errors import RankFailedError
from tensorplay.distributed.host import wire
from tests import timing
from tests.fakes import ThreadRanks

SAID = "the elastic watcher stopped on an unexpected error: ZeroDivisionError: a watcher's bug"


def _until_grow_raises(world, bound_s: float, made: threading.Barrier):
    """A training loop's grow() polls on an elastic (2, 2) mesh, one 20 ms step apart, until
    one raises: (what grow() raised, seconds after every rank made its mesh, what recover()
    raised then), or None after ``bound_s``."""
    mesh = elastic_mesh.init(world, "cpu", (2, 2), ("dp", "tp"), ("gloo", "gloo"), False,
                             (0, 1), given=True)
    made.wait(bound_s)
    began = time.monotonic()
    while time.monotonic() - began < bound_s:
        try:
            mesh = mesh.grow()
        except RuntimeError as err:
            took = time.monotonic() - began
            try:
                mesh.recover(RankFailedError("a step failed"))
            except RuntimeError as again:
                return err, took, again
            return err, took, None
        time.sleep(0.02)
    return None


def test_a_watcher_that_fails_is_said_once_and_the_next_grow_and_recover_raise_it(
        monkeypatch, caplog, capsys):
    bites = threading.Event()  # once every rank made its mesh and groups
    made = threading.Barrier(4, action=bites.set)
    ranks = ThreadRanks(4)
    # this test's worlds only: the worlds of earlier tests live on, and their watchers too
    ours = {id(ranks.world(r).epochs.admitted_from) for r in range(4)}

    def broken(members, admitted_from):
        if bites.is_set() and id(admitted_from) in ours:
            raise ZeroDivisionError("a watcher's bug")
        return None  # no node lost

    monkeypatch.setattr(wire, "naming", broken)  # the watcher asks it first, every look
    caplog.set_level(logging.ERROR, logger="tensorplay.distributed")
    out = ranks.run(_until_grow_raises, timing.bound(ranks.timeout_s, 5), made)
    for rank, got in enumerate(out):
        assert got is not None, f"rank {rank}: grow() never said the watcher stopped"
        err, took, again = got
        assert str(err).startswith(f"grow(): rank {rank}'s elastic watcher stopped "), err
        assert "(ZeroDivisionError: a watcher's bug)" in str(err) and "Fix: " in str(err)
        assert isinstance(err.__cause__, ZeroDivisionError)
        assert took < ranks.timeout_s  # within moments, not the world's timeout
        assert again is not None and str(again).startswith("recover(): "), again
    said = [r for r in caplog.records if r.levelno == logging.ERROR and SAID in r.getMessage()]
    assert sorted(r.getMessage() for r in said) == [f"rank {r}: {SAID}" for r in range(4)]
    assert all(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in said)  # traceback
    err_text = capsys.readouterr().err
    assert all(f"tensorplay.distributed: rank {r}: {SAID}" in err_text for r in range(4))
    # each rank broke its groups of the epoch: a call blocked in one fails at once
    assert len(ranks.engine.severed) == 8  # 4 ranks x their "dp" and "tp" groups
