"""What reaches the supervising thread, one typed event at a time, through one queue.

Threads put events on the job's queue; the supervise loop (``job.py``) takes them off and
matches them by type:

- ``Exit``: a waiter thread saw a rank's process end (its Popen return code);
- ``Report``: the rank's ``rank_main`` said how its script ended (a ``RankReport``);
- ``Beat``: with --hang-timeout-s, the rank's main thread has been still this long, here;
- ``Recovered``: an elastic mesh changed epoch; what it cost (``host/wire.py``'s ``Recovery``),
  sent by the new mesh's first rank (again once it synced the fresh ranks);
- ``Signal``: SIGINT or SIGTERM reached the launcher;
- ``Notice``: SIGUSR1 or SIGUSR2 reached it: a warning, such as Slurm's ``--signal=USR1@60``
  sixty seconds before the time limit, passed on to the ranks; the job goes on;
- ``Verdict`` (``verdicts.Verdict``): the job stopped elsewhere (a node lost, a failure on
  another node, the store could not be served);
- ``NodeChange`` (``roster.NodeChange``, elastic mode): a node was lost, or taken back by a
  new launcher; the job goes on.

Worked example: the report pipe's lines become events with ``from_report_line``::

    >>> from_report_line(3, b'{"event": "beat", "t": 5.0, "still": 2.5, "where": "a.py:7"}')
    Beat(rank=3, still=2.5, where='a.py:7')
    >>> from_report_line(3, b'{"event": "returned", "t": 9.5}')
    Report(rank=3, report=RankReport(event='returned', t=9.5, code=1, what=None, first=None))
"""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass

from ..host.wire import Recovery
from .rank_ends import RankReport
from .roster import NodeChange
from .verdicts import Verdict

__all__ = ["Beat", "Event", "Events", "Exit", "NodeChange", "Notice", "Recovered", "Report",
           "Signal", "Verdict", "from_report_line"]


@dataclass(frozen=True)
class Exit:
    """A rank's process ended with Popen return ``code`` (negative: killed by that signal),
    seen at ``t`` (time.monotonic())."""

    rank: int
    code: int
    t: float


@dataclass(frozen=True)
class Report:
    """A rank said how its script ended (its first report is the one that counts)."""

    rank: int
    report: RankReport


@dataclass(frozen=True)
class Beat:
    """A rank's main thread has been at one place (``where``) for ``still`` seconds."""

    rank: int
    still: float
    where: str


@dataclass(frozen=True)
class Recovered:
    """A rank's elastic mesh entered a new epoch at this cost (the latest record per epoch
    counts: the first says the change, a second adds the sync time)."""

    rank: int
    recovery: Recovery


@dataclass(frozen=True)
class Signal:
    """The launcher itself got SIGINT or SIGTERM (``signum``)."""

    signum: int


@dataclass(frozen=True)
class Notice:
    """The launcher got SIGUSR1 or SIGUSR2 (``signum``): a warning to pass on, not a stop."""

    signum: int


Event = Exit | Report | Beat | Recovered | Signal | Notice | Verdict | NodeChange
Events = queue.SimpleQueue[Event]  # reentrant: the launcher's signal handlers may put too


def from_report_line(rank: int, raw: bytes) -> Report | Beat | Recovered:
    """The event one line of a rank's report pipe stands for (ValueError when it is none)."""
    record = json.loads(raw)
    if not isinstance(record, dict):
        raise ValueError(f"not a report: {raw!r}")
    if record.get("event") == "recovery":
        said = record.get("record")
        if not isinstance(said, dict):
            raise ValueError(f"not a recovery: {raw!r}")
        return Recovered(rank, Recovery.from_json(said))
    if record.get("event") == "beat":
        still = record.get("still", 0.0)
        return Beat(rank, float(still) if isinstance(still, (int, float)) else 0.0,
                    str(record.get("where", "")))
    return Report(rank, RankReport.from_json(record))
