"""tensorplay-run's view of ranks that are alive but stuck: stopped, or not moving.

Two signs, each judged by the launcher of the rank's node (pure standard library):

- **stopped**: the process is in state T (SIGSTOP, SIGTSTP) in ``/proc/<pid>/stat``. Nothing
  in a healthy job stops a rank (a debugger's stop is state t, not T), so a rank stopped for
  longer than ``stopped_s`` (--node-grace-s, 10 s) is hung. On by default on Linux;
- **not moving** (only with --hang-timeout-s H): each rank's ``rank_main`` sends a beat over
  its report pipe once a second, saying for how long its main thread has been at the same
  place (same frame, same bytecode offset, no collective made: a frame's id may be reused by
  the next call at the same place, so the count of collectives is part of the place). A rank
  whose beats stop for H seconds (frozen, or the interpreter lock held), or whose main thread
  has not moved for H seconds (a deadlock, a collective that never returns, and also one call
  longer than H), is hung.

Worked example: ``--hang-timeout-s 60``, rank 5 enters an all_reduce that rank 1 never joins
at t = 100 s. Its beats say ``still`` 0, 1, 2, ... s; at t = 160 s ``still`` passes 60 and the
launcher kills rank 5 and reports it as hung, with where it was.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..host.procfs import stopped


class HangWatch:
    """Per rank: since when it is stopped, and its last beat. A process is judged hung once:
    until its exit is heard (milliseconds, or seconds on a loaded machine) it is still among
    the running, and would otherwise be killed and reported again at every look."""

    def __init__(self, stopped_s: float, hang_s: float | None):
        self.stopped_s = stopped_s
        self.hang_s = hang_s
        self.stopped_since: dict[int, float] = {}
        self.beats: dict[int, tuple[float, float, str]] = {}  # rank -> (when, still_s, where)
        self.started = time.monotonic()
        self.judged: set[int] = set()  # pids found hung

    def beat(self, rank: int, still: float, where: str) -> None:
        """A beat from the rank's report pipe: its main thread has been ``still`` seconds at
        ``where`` (an ``events.Beat``)."""
        self.beats[rank] = (time.monotonic(), still, where)

    def hung(self, pids: Mapping[int, int], now: float | None = None) -> dict[int, str]:
        """The ranks (of ``pids``: rank -> pid, the running ones) that are hung, and why."""
        now = time.monotonic() if now is None else now
        found: dict[int, str] = {}
        for rank, pid in pids.items():
            if pid in self.judged:
                continue
            if stopped(pid):
                since = self.stopped_since.setdefault(rank, now)
                limit = min(self.stopped_s, self.hang_s or self.stopped_s)
                if now - since > limit:
                    found[rank] = f"its process was stopped (SIGSTOP) for {now - since:.1f} s"
                continue
            self.stopped_since.pop(rank, None)
            if self.hang_s is None:
                continue
            when, still, where = self.beats.get(rank, (self.started, 0.0, ""))
            at = f" at {where}" if where else ""
            if now - when > self.hang_s:
                found[rank] = f"it gave no sign of life for {now - when:.1f} s"
            elif still + (now - when) > self.hang_s:
                found[rank] = (f"its main thread has not moved for {still + now - when:.1f} s"
                               f"{at} (limit {self.hang_s:g} s, --hang-timeout-s)")
        self.judged.update(pids[rank] for rank in found)
        return found
