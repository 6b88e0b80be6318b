"""Shared by the benchmark scripts: number formatting, the tree measured, paired ratios."""

from __future__ import annotations

import contextlib
import operator
import os
import signal
import statistics
import subprocess
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """'commit abc1234' plus a note when tensorplay/ has uncommitted changes (read-only git)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "tensorplay")
    changed = len(dirty.splitlines())
    return f"commit {head}" + (f" + {changed} uncommitted file(s) in tensorplay/" if changed
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
