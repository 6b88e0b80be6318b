"""The tests' hang guard (tests/timing.py): a waiting process tree that uses no CPU is hung; one
that works is let go on."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests import timing

pytestmark = pytest.mark.slow  # each spins or waits a second or more of real time

SPIN = "import time\nwhile time.process_time() < {cpu}: pass\n"


@contextmanager
def child(code: str) -> Iterator[subprocess.Popen]:
    """A Python child running ``code``, killed (by pid) on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_an_idle_process_fails_the_guard_after_one_period():
    with child("import time; time.sleep(60)") as proc:
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            timing.communicate(proc, 0.5)
        assert time.monotonic() - start < 60  # it did not wait for the child's end
        assert proc.poll() is None  # left running for the caller to read its stacks


def test_a_working_process_outlasts_one_period():
    # 1 s of CPU against periods of 0.25 s (scaled): it needs several, and each shows work
    with child(SPIN.format(cpu=1.0)) as proc:
        timing.communicate(proc, 0.25, busy_cpu_s=0.02, periods=1000)
        assert proc.returncode == 0


def test_a_working_process_still_fails_after_the_last_period():
    with child(SPIN.format(cpu=60)) as proc:
        with pytest.raises(subprocess.TimeoutExpired):
            timing.communicate(proc, 0.25, busy_cpu_s=0.02, periods=2)
        assert proc.poll() is None


def test_a_wait_goes_on_while_the_process_works_and_ends_once_it_is_idle():
    with child(SPIN.format(cpu=1.0) + "time.sleep(60)") as proc:
        spun = timing.wait_until(lambda: timing.procfs.cpu_seconds(proc.pid) >= 0.9, 0.25,
                                 proc, busy_cpu_s=0.02, periods=1000)
        assert spun  # it outlasted the first periods while it spun
        start = time.monotonic()
        assert not timing.wait_until(lambda: False, 0.25, proc, busy_cpu_s=0.02, periods=1000)
        assert time.monotonic() - start < timing.guard(0.25) * 3  # asleep: one period (or two)
