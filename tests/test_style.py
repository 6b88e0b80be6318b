"""The tree stays ruff-clean and mypy-clean (both are part of the test extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import timing


def test_ruff_is_clean():
    pytest.importorskip("ruff")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench",
                           "examples"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # mypy over the package: about 25 s cold on 2 cores, a few s with its cache
def test_mypy_is_clean():
    """`python -m mypy` from the root, with the project's [tool.mypy], reports no error."""
    pytest.importorskip("mypy", reason="mypy comes with the [test] extra")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=root, capture_output=True,
                          text=True, timeout=timing.guard(600))
    assert done.returncode == 0, done.stdout + done.stderr
