"""How slow this machine is now: the one source of the margins of the tests' time bounds.

A test that asserts speed ("the launcher stopped within the node grace plus a little") bounds
the time by what it configured (a grace, a world timeout) plus a margin for the work around it
(starting processes, importing torch, reaping). On a busy machine that work takes longer, so
the margin is scaled by ``factor()``: how much slower than a quiet machine a fixed small CPU
workload runs here (timed once per session), or the load average per core, whichever is more;
never below 1. ``bound(configured, margin)`` is the bound to assert. ``guard(seconds)`` only
catches a hang, and ``communicate`` waits for a process that way while it still works.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Callable, Iterator

from tensorplay.distributed.host import procfs

QUIET_WORKLOAD_S = 0.0095  # the workload's best time on one quiet core of the reference machine
# (2 cores: 0.0095-0.0098 s best of 15, beside a test run at load average 1.5)
_ROUNDS = 7


def _workload() -> float:
    """Seconds one fixed small CPU-bound job takes (pure Python: the interpreter's speed)."""
    start = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i * i % 7
    return time.perf_counter() - start


@functools.cache
def _measured() -> float:
    """The workload's slowdown against a quiet machine: the median of a few rounds (a median,
    not the best, so that sharing the cores with other work shows)."""
    times = sorted(_workload() for _ in range(_ROUNDS))
    return times[_ROUNDS // 2] / QUIET_WORKLOAD_S


def factor() -> float:
    """How many times slower than a quiet machine this one runs now; >= 1."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] / cores if hasattr(os, "getloadavg") else 0.0
    return max(1.0, _measured(), load)


def bound(configured_s: float, margin_s: float) -> float:
    """A time bound: what the test configured (a grace, a timeout) plus ``margin_s`` for the
    work around it, that margin scaled by ``factor()``."""
    return configured_s + margin_s * factor()


def guard(seconds: float) -> float:
    """A limit that only catches a hang (a subprocess's timeout, say): ``seconds`` on a quiet
    machine, ``factor()`` times that on a busy one, so that a slow run is not taken for a
    hung one."""
    return seconds * factor()


BUSY_CPU_S = 0.5  # CPU a process tree must use in one guard period to count as working:
# an asleep launcher with 4 ranks used 0.02 s in 20 s; one torch import is ~1.7 s
GUARD_PERIODS = 5  # a working tree gets at most this many guard periods


def _working_periods(proc: subprocess.Popen | None, seconds: float, busy_cpu_s: float,
                     periods: int) -> Iterator[float]:
    """``guard(seconds)``, then once more after each period in which ``proc``'s tree (it and
    its descendants) used ``busy_cpu_s`` of CPU, ``periods`` at most (once without ``proc``).
    On a busy machine the work of a launch (a warm process's torch import, then each rank's)
    can outlast any fixed guard while it goes on; a hang uses next to no CPU."""
    for _ in range(periods):
        used = 0.0 if proc is None else procfs.tree_cpu_seconds(proc.pid)
        yield guard(seconds)
        if proc is None or procfs.tree_cpu_seconds(proc.pid) - used < busy_cpu_s:
            return


def communicate(proc: subprocess.Popen, seconds: float, busy_cpu_s: float = BUSY_CPU_S,
                periods: int = GUARD_PERIODS) -> tuple:
    """``proc.communicate()``, failing only on a hang: its guard periods go on while it works
    (``_working_periods``). Raises subprocess.TimeoutExpired, the process left running, when
    it is still there at the end of a period it spent idle (or of the last)."""
    for limit in _working_periods(proc, seconds, busy_cpu_s, periods):
        try:
            return proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired as err:
            expired = err
    raise expired


def wait_until(check: Callable[[], bool], seconds: float, proc: subprocess.Popen | None = None,
               busy_cpu_s: float = BUSY_CPU_S, periods: int = GUARD_PERIODS) -> bool:
    """Poll ``check`` (every 50 ms) until it holds; whether it did. With ``proc`` (the
    launcher the wait is on) its guard periods go on while that works, as for
    ``communicate``: ranks that wrote nothing yet may still be importing torch."""
    for limit in _working_periods(proc, seconds, busy_cpu_s, periods):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.05)
    return check()


def describe() -> str:
    """'speed factor 1.3 (workload 1.1, load 2.6 on 2 cores)', for a failing test's message."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (f"speed factor {factor():.2f} (workload {_measured():.2f}, load {load:.2f} on "
            f"{cores} cores)")
