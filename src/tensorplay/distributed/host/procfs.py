"""What Linux's /proc says of a process: its state, its children, its command line.

The one place that parses ``/proc/<pid>/stat`` (the package, the tests and the benchmarks all
read it here). The state letter is the first field after the command name, which is in
parentheses and may itself hold spaces or parentheses: "1234 (python x) S 1 ..." -> "S". So
the text is split at the *last* ")".

Where /proc is missing (macOS), ``state`` is None and ``alive`` asks the kernel with signal 0.
"""

from __future__ import annotations

import os
from pathlib import Path

DEAD = ("Z", "X")  # a zombie (ended, not yet reaped) or dead
STOPPED = ("T", "t")  # stopped by a signal (SIGSTOP, SIGTSTP) or by a tracer


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 onward: the state
    is [0], the parent pid [1], the start time in clock ticks [19]); None when there is no
    such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter ("R", "S", "T", "Z", ...); None when it cannot be read."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    found = state(pid)
    if found is not None:
        return found not in DEAD
    if os.path.isdir("/proc"):  # /proc is there and the process is not
        return False
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T); False where /proc is missing."""
    return state(pid) in STOPPED


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (all its threads' children); [] when it is gone."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return kids
    return kids


def comm(pid: int) -> str | None:
    """The process's name (``/proc/<pid>/comm``: 15 characters at most); None when gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    """The process's command line, one word per argument; [] when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [w.decode(errors="replace") for w in raw.split(b"\0") if w]


def environ(pid: int) -> dict[str, str]:
    """The process's environment as it started; {} when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used, with that of its reaped children (user + system:
    ``/proc/<pid>/stat`` fields 14-17, in clock ticks); 0.0 when it cannot be read. A process
    importing torch uses ~1.7 s; one asleep in a wait, a few ticks a minute."""
    fields = stat_fields(pid)
    if fields is None:
        return 0.0
    return sum(int(tick) for tick in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, children before grandchildren: a launcher's warm
    process, then the ranks forked from it."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop(0))
        found += below
        todo += below
    return found


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` summed over ``pid`` and every live descendant."""
    return sum(cpu_seconds(p) for p in [pid, *descendants(pid)])
