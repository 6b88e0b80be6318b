"""The tree stays ruff-clean (the linter is part of the test extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_ruff_is_clean():
    pytest.importorskip("ruff")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench",
                           "examples"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
