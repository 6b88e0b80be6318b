"""What a waiting rank watches (``job/watch.py``), and how a watching thread of ours reports an
error nothing expected: once, the same way for every such thread, naming the rank."""

from __future__ import annotations

import logging
import os
import time

from tensorplay.distributed.job import watch
from tests import timing
from tests.fakes import ThreadRanks, exited_pid


def _said(caplog, text: str, within_s: float) -> list[logging.LogRecord]:
    """The ERROR records holding ``text``, once there is one (or after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        found = [r for r in caplog.records
                 if r.levelno == logging.ERROR and text in r.getMessage()]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)


def test_a_death_watch_whose_notice_fails_says_so_once_and_the_wait_goes_on(caplog, capsys):
    caplog.set_level(logging.ERROR, logger="tensorplay.distributed")
    world = ThreadRanks(2, host_pids={0: os.getpid(), 1: exited_pid()}).world(0)

    def notify(dead):
        raise KeyError("a notice's bug")

    with watch.death_watch(world, notify):
        said = _said(caplog, "the death watch stopped", timing.bound(10 * watch.WATCH_S, 5))
    assert [r.getMessage() for r in said] == [
        "rank 0: the death watch stopped on an unexpected error: KeyError: \"a notice's bug\""]
    assert said[0].exc_info is not None and said[0].exc_info[0] is KeyError
    assert "tensorplay.distributed: rank 0: the death watch stopped" in capsys.readouterr().err


def test_a_reported_thread_hands_its_error_on_after_saying_it(caplog):
    caplog.set_level(logging.ERROR, logger="tensorplay.distributed")
    handed: list[BaseException] = []

    def body():
        raise ValueError("a body's bug")

    watch.reported("a test's thread", 5, body, handed.append)()
    assert [r.getMessage() for r in caplog.records] == [
        "rank 5: a test's thread stopped on an unexpected error: ValueError: a body's bug"]
    assert len(handed) == 1 and isinstance(handed[0], ValueError)
