"""The launcher's daily-tier tests start plain ranks: their scripts use the standard library
only, and a warm process (which imports torch once to fork every rank) would cost them more
than it saves. Warm start is tested by test_warm.py and by every slow test whose ranks import
torch (the examples, the elastic and multi-host jobs)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _plain_ranks_in_the_daily_tier(request, monkeypatch):
    if request.node.get_closest_marker("slow") is None and "test_warm" not in request.node.nodeid:
        monkeypatch.setenv("TENSORPLAY_NO_WARM", "1")
