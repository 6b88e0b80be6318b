"""The launcher's own bugs: said once on stderr, the same way from every thread, never swallowed.

A launcher thread that must not die quietly (the heartbeat, node 0's link watch) runs its body
through ``guarded``: what the body raises is not an expected failure (those are caught where
they happen, by name: ``store.StoreGone``, ``OSError``), so it is a bug in the launcher. It is
printed once, with its traceback, and handed to ``on_bug``, which fails the job, since a node
whose heartbeat died is one the others can no longer judge. Worked example, a KeyError in
node 1's heartbeat::

    tensorplay-run: internal error in the heartbeat: Traceback (most recent call last):
      ...
    KeyError: 3
    tensorplay-run: node 1 (hostB, ranks 4-7)'s launcher failed: internal error in the
    heartbeat (KeyError: 3; traceback above); stopping ranks 4-7 on this node.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from .options import PROG


def report_bug(where: str, err: BaseException) -> None:
    """Print ``tensorplay-run: internal error in <where>: <traceback>`` on stderr, in one write
    (the lines of two threads do not interleave)."""
    text = "".join(traceback.format_exception(err)).rstrip()
    sys.stderr.write(f"{PROG}: internal error in {where}: {text}\n")
    sys.stderr.flush()


def summary(where: str, err: BaseException) -> str:
    """One line for a verdict: 'internal error in the heartbeat (KeyError: 3; traceback
    above)'."""
    return f"internal error in {where} ({type(err).__name__}: {err}; traceback above)"


def guarded(where: str, body: Callable[[], None],
            on_bug: Callable[[str, BaseException], None]) -> Callable[[], None]:
    """``body`` as a thread's target that reports a bug (``report_bug``) and then calls
    ``on_bug(where, err)``: the thread ends, but the job does not go on without it unseen."""

    def run() -> None:
        try:
            body()
        except Exception as err:  # noqa: BLE001 - a bug: reported here, then on_bug fails the job
            report_bug(where, err)
            on_bug(where, err)

    return run
