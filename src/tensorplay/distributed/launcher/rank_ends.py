"""How the ranks of a job ended, and the one summary line the launcher prints about it (pure).

The launcher knows three things per rank: the report of ``rank_main`` (a ``RankReport``: how
the script ended, and when), the exit status, and whether the launcher itself stopped it. From
them each rank is

- ``failed``: its script raised or called ``sys.exit(n != 0)``, or it died while its script
  ran (no report, a non-zero status, not stopped by us); it failed at the report's time, or at
  its exit;
- ``after``: its script finished, then the process died at exit (``terminate called without an
  active exception``: SIGABRT from a C++ destructor) or hung there until stopped;
- ``stopped``: still in its script when the launcher stopped it;
- ``ok``.

The cause is the failed rank that failed first in time (a RankFailedError, raised because a peer
died, only when nothing else failed); ranks that failed alike (the same error once pids and
addresses are blanked, or the same status) are named together. Only when no
script failed are the ranks that died after finishing the cause. Worked examples::

    rank 1 failed first (exit code 3); stopped ranks 0, 2-3
    all 4 ranks failed alike (exit code 1): MeshMismatchError: ranks disagree on mesh_shape ...
    rank 0 failed first (exit code 1): RankFailedError: ...; ranks 1-3 finished their script,
        then died at exit (killed by signal SIGABRT)
    ranks 1-3 finished their script, then died at exit (killed by signal SIGABRT); rank 0 had
        not finished its script (stopped)
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import rank_words

_VARYING = [  # what differs between ranks that failed alike: blanked before comparing
    (re.compile(r"\bpid \d+"), "pid N"),
    (re.compile(r"\[[0-9a-fA-F.:]+\]:\d+"), "ADDR"),  # [127.0.0.1]:9368, [::1]:80
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b"), "ADDR"),  # 10.0.0.1:29500
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x?"),
]


def blank_varying(text: str) -> str:
    """text with pids, addresses and hex pointers blanked, so ranks' reports compare equal."""
    for pattern, stand_in in _VARYING:
        text = pattern.sub(stand_in, text)
    return text


SUMMARY_CHARS = 240  # the error in a summary line is cut here, at a word


def shorten(what: str) -> str:
    """An error for the summary line: without its 'Fix: ...' advice (the traceback printed
    above has it) and no longer than SUMMARY_CHARS."""
    what = re.split(r"(?:^|\s)Fix:\s", what, maxsplit=1)[0].rstrip(" .;")
    if len(what) > SUMMARY_CHARS:
        what = what[:SUMMARY_CHARS].rsplit(" ", 1)[0] + " ..."
    return what


def describe_code(code: int) -> str:
    """Word a Popen return code: 'exit code 1' or 'killed by signal SIGKILL'."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def exit_status(code: int) -> int:
    """The launcher's own exit status for a rank's Popen code: itself, or 128+signal."""
    return code if code >= 0 else 128 - code


@dataclass(frozen=True)
class RankReport:
    """How a rank's script ended, as ``rank_main`` reported it (or the launcher, for a hang).

    ``event``: "returned", "exit" (sys.exit), "raised", or "hung" (the launcher killed it);
    ``t``: time.monotonic() when it was said; ``code``: the status its script chose (1 for an
    exception); ``what``: "ValueError: bad lr" or a sys.exit message; ``first``: the first line
    of the traceback about to be printed. Worked example::

        >>> RankReport.from_json({"event": "exit", "t": 12.3, "code": 3, "what": None})
        RankReport(event='exit', t=12.3, code=3, what=None, first=None)
        >>> RankReport("returned", 12.3).failed
        False
    """

    event: str
    t: float
    code: int = 1
    what: str | None = None
    first: str | None = None

    @staticmethod
    def from_json(record: Mapping[str, object]) -> RankReport:
        """The report from its JSON object (ValueError when it is not one)."""
        event, t, code = record.get("event"), record.get("t"), record.get("code", 1)
        what, first = record.get("what"), record.get("first")
        if not isinstance(event, str) or not isinstance(t, (int, float)) or isinstance(t, bool):
            raise ValueError(f"not a rank report: {record!r}")
        return RankReport(event, float(t), code if isinstance(code, int) else 1,
                          what if isinstance(what, str) else None,
                          first if isinstance(first, str) else None)

    @property
    def failed(self) -> bool:
        """Whether the script did not return (it raised, exited non-zero, or hung)."""
        return self.event != "returned"


@dataclass
class RankEnd:
    """What the launcher saw of one rank; filled in as events arrive.

    ``report`` is how its script ended (the first ``RankReport``); ``code`` the Popen return
    code; ``exit_t`` when the launcher saw the exit; ``stop_t`` when the launcher signalled it,
    if it was still running. Worked example: a rank that raised, then exited 1::

        >>> end = RankEnd(1, RankReport("raised", 4.0, 1, "ValueError: bad lr"), 1, 4.2)
        >>> end.kind(), end.fate(), end.error()
        ('failed', 'exit code 1', 'ValueError: bad lr')
    """

    rank: int
    report: RankReport | None = None
    code: int | None = None
    exit_t: float | None = None
    stop_t: float | None = None

    def report_in_time(self) -> RankReport | None:
        """The report, if the rank made it before the launcher stopped it."""
        rep = self.report
        if rep is None or (self.stop_t is not None and rep.t > self.stop_t):
            return None
        return rep

    def failing(self) -> bool:
        """Whether its script failed (any report but "returned") or its process ended badly."""
        return bool(self.code) or (self.report is not None and self.report.failed)

    def kind(self) -> str:
        """'failed', 'after', 'stopped' or 'ok' (see the module docstring)."""
        rep = self.report_in_time()
        if rep is not None and rep.failed:
            return "failed"
        if rep is not None:
            return "after" if self.stop_t is not None or self.code else "ok"
        if self.stop_t is not None:
            return "stopped"
        return "failed" if self.code else "ok"

    def failed_at(self) -> float:
        """When it failed: its report, else its exit as the launcher saw it."""
        rep = self.report_in_time()
        return rep.t if rep is not None else (self.exit_t or 0.0)

    def exit_code(self) -> int:
        """Its Popen code; for a rank stopped while exiting, the code its script chose."""
        rep = self.report_in_time()
        if self.stop_t is not None and rep is not None and rep.failed:
            return rep.code
        return self.code or 0

    def fate(self) -> str:
        """'exit code 1', 'killed by signal SIGKILL', or 'stopped while exiting' (it had failed
        and was still exiting when the launcher stopped it)."""
        rep = self.report_in_time()
        if self.stop_t is not None and rep is not None and rep.failed:
            return "stopped while exiting"
        return describe_code(self.exit_code())

    def error(self) -> str | None:
        """'ValueError: bad lr' (or a sys.exit message); None when there is none."""
        rep = self.report_in_time()
        return rep.what if rep is not None else None

    def chosen_code(self) -> int:
        """The code its script chose (1 for an exception), else its Popen code."""
        rep = self.report_in_time()
        return rep.code if rep is not None else self.exit_code()

    def is_consequence(self) -> bool:
        """Whether it failed because a peer died (our RankFailedError): another rank's
        failure caused it."""
        what = self.error()
        return what is not None and what.startswith("RankFailedError")

    def alike_key(self) -> tuple[str | None, int]:
        """Equal for ranks that failed the same way."""
        what = self.error()
        return (blank_varying(what) if what else None, self.chosen_code())

    def exit_fate(self) -> str:
        """'died at exit (killed by signal SIGABRT)', or 'did not exit (stopped)'."""
        if self.stop_t is not None:
            return "did not exit (stopped)"
        return f"died at exit ({describe_code(self.code or 0)})"


def _their(ranks: list[int]) -> str:
    return "its" if len(ranks) == 1 else "their"


def first_failure(failed: list[RankEnd]) -> RankEnd:
    """The cause among failed ranks: the earliest, but a RankFailedError (raised because a
    peer died) only when nothing else failed, since it is a consequence. The launcher sees a
    SIGKILLed rank's exit when its waiter thread runs, which can be after a peer reported the
    RankFailedError that the death caused."""
    return min(failed, key=lambda e: (e.is_consequence(), e.failed_at(), e.rank))


def _cause(failed: list[RankEnd], n_ranks: int, node_ranks: str) -> tuple[list[str], int]:
    """The clauses about failed scripts: the first (with those that failed alike), the rest."""
    first = first_failure(failed)
    alike = [e.rank for e in failed if e.alike_key() == first.alike_key()]
    what = first.error()
    # a group is worded by the code its scripts chose: some may have been stopped while exiting
    fate = first.fate() if len(alike) == 1 else describe_code(first.chosen_code())
    said = f" ({fate})" + (f": {shorten(what)}" if what else "")
    if len(alike) == n_ranks > 1:
        parts = [f"all {n_ranks} {node_ranks} failed alike{said}"]
    elif len(alike) > 1:
        parts = [f"{rank_words(alike)} failed first, alike{said}"]
    else:
        parts = [f"rank {first.rank} failed first{said}"]
    others = [e.rank for e in failed if e.rank not in alike]
    if others:
        parts.append(f"then {rank_words(others)} failed too")
    return parts, exit_status(first.exit_code())


def summarize(ends: list[RankEnd], *, node_ranks: str = "ranks") -> tuple[str, int]:
    """(the summary line without the program name, the launcher's exit status) of a failed job.

    ``node_ranks`` words "all N ranks" on a multi-node job ("ranks on this node").
    """
    by_kind: dict[str, list[RankEnd]] = {"failed": [], "after": [], "stopped": [], "ok": []}
    for end in sorted(ends, key=lambda e: e.rank):
        by_kind[end.kind()].append(end)
    failed, after, stopped = by_kind["failed"], by_kind["after"], by_kind["stopped"]
    if failed:
        parts, code = _cause(failed, len(ends), node_ranks)
    else:
        parts, code = [], 1
        died = [e for e in after if e.stop_t is None]
        if died:
            code = exit_status(min(died, key=lambda e: (e.exit_t or 0.0, e.rank)).code or 0)
    fates: dict[str, list[int]] = {}
    for end in after:
        fates.setdefault(end.exit_fate(), []).append(end.rank)
    for fate, ranks in fates.items():
        parts.append(f"{rank_words(ranks)} finished {_their(ranks)} script, then {fate}")
    if stopped:
        ranks = [e.rank for e in stopped]
        parts.append(f"stopped {rank_words(ranks)}" if failed else
                     f"{rank_words(ranks)} had not finished {_their(ranks)} script (stopped)")
    if len(parts) == 1 and failed and not parts[0].startswith("all ") and len(ends) > 1:
        parts.append("no other rank was still running")
    if not parts:
        parts.append("no rank failed")
    return "; ".join(parts) + ".", code
