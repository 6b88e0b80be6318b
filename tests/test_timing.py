"""The tests' hang guard (tests/timing.py): a waiting process tree that uses no CPU is hung; one
that works is let go on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import timing

SPIN = "import time\nwhile time.process_time() < {cpu}: pass\n"


def test_an_idle_process_fails_the_guard_after_one_period():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            timing.communicate(child, 0.5)
        assert time.monotonic() - start < 60  # it did not wait for the child's end
        assert child.poll() is None  # left running for the caller to read its stacks
    finally:
        child.kill()
        child.wait()


def test_a_working_process_outlasts_one_period():
    # 1 s of CPU against periods of 0.25 s (scaled): it needs several, and each shows work
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(cpu=1.0)])
    try:
        timing.communicate(child, 0.25, busy_cpu_s=0.02, periods=1000)
        assert child.returncode == 0
    finally:
        child.kill()
        child.wait()


def test_a_working_process_still_fails_after_the_last_period():
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(cpu=60)])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            timing.communicate(child, 0.25, busy_cpu_s=0.02, periods=2)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_wait_goes_on_while_the_process_works_and_ends_once_it_is_idle():
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(cpu=1.0) + "time.sleep(60)"])
    try:
        spun = timing.wait_until(lambda: timing._procfs.cpu_seconds(child.pid) >= 0.9, 0.25,
                                 child, busy_cpu_s=0.02, periods=1000)
        assert spun  # it outlasted the first periods while it spun
        start = time.monotonic()
        assert not timing.wait_until(lambda: False, 0.25, child, busy_cpu_s=0.02, periods=1000)
        assert time.monotonic() - start < timing.guard(0.25) * 3  # asleep: one period (or two)
    finally:
        child.kill()
        child.wait()
