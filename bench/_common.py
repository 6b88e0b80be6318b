"""Shared by the benchmark scripts: number formatting, the tree measured, paired ratios, and
the process helpers of the benchmarks that start launchers (failover.py, recovery.py).

A script run as ``python bench/<script>.py`` has bench/ on its path already; importing this
module puts the repository root (for ``tests``) and src/ (for ``tensorplay``, when the package
is not installed) there too, and ``pythonpath()`` gives the same to the processes it starts.
"""

from __future__ import annotations

import contextlib
import operator
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SRC = os.path.join(ROOT, "src")
for _path in (ROOT, SRC):
    if _path not in sys.path:
        sys.path.insert(1, _path)  # after bench/ (sys.path[0] of a bench script)


def pythonpath(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a process a benchmark starts: src/ and the root first, then ``env``'s."""
    rest = (os.environ if env is None else env).get("PYTHONPATH")
    return os.pathsep.join(filter(None, [SRC, ROOT, rest]))


def fmt_time(seconds: float) -> str:
    """1.5e-4 -> '150 µs', 0.0123 -> '12.3 ms', 2.5 -> '2.50 s'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int | None) -> str:
    """4608 -> '4.5 KiB', 3 << 20 -> '3.0 MiB', None -> '-'."""
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < 1 << 20:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{n / (1 << 20):.1f} MiB"


def tree_state() -> str:
    """'commit abc1234' plus a note when src/tensorplay/ has uncommitted changes (read-only
    git)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "src/tensorplay")
    changed = len(dirty.splitlines())
    return f"commit {head}" + (f" + {changed} uncommitted file(s) in src/tensorplay/" if changed
                               else "")


def machine() -> str:
    """CPU count and 1-minute load average: the context every number here needs."""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPUs, load average {load:.1f} at start"


def paired(xs: list[float], ys: list[float], op=operator.truediv) -> float:
    """Median over samples of op(x, y) taken within each sample: drift between samples cancels.

    paired([2, 4], [1, 5]) -> median(2.0, 0.8) = 1.4.
    """
    return statistics.median(op(x, y) for x, y in zip(xs, ys, strict=True))


# -- for benchmarks that start launchers and kill what they leave (failover.py, recovery.py) --

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Processes orphaned below this one (ranks whose launcher died) are re-parented to it, not
    to init: they stay its descendants, so a benchmark finds and kills them after each run."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@contextlib.contextmanager
def no_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM off while cleaning up, so a second Ctrl-C cannot cut it short."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind as Ctrl-C does, so every run's clean-up still runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, zombies included (they still need reaping), children before
    grandchildren; read through tensorplay.distributed.host.procfs (imported here, not at the top:
    a benchmark's timed processes import this module and must not load the package early)."""
    from tensorplay.distributed.host import procfs

    found, todo = [], [pid]
    while todo:
        kids = procfs.children(todo.pop(0))
        found += kids
        todo += kids
    return found


def live(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that are live processes (zombies are not)."""
    from tensorplay.distributed.host import procfs

    return [pid for pid in pids if procfs.alive(pid)]


def send(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``; one already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def reap_orphans(skip: Iterable[int] = (), within_s: float = 10.0) -> None:
    """Collect the exits of the orphans this process adopted as subreaper: every child of it
    but ``skip`` (its own Popens, which their owners wait on), until none is left or
    ``within_s`` has passed. The children are read again each round: a process killed with
    its parent is adopted only once that parent is gone."""
    from tensorplay.distributed.host import procfs

    skip, deadline = set(skip), time.monotonic() + within_s
    while time.monotonic() < deadline:
        pending = [pid for pid in procfs.children(os.getpid()) if pid not in skip]
        if not pending:
            return
        for pid in pending:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
