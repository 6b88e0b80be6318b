"""The launcher's tests start plain ranks (TENSORPLAY_NO_WARM=1) unless marked ``warm_ranks``:
most of their scripts use the standard library only, and a warm process (which imports torch
once to fork every rank: 1.8 s of CPU) would cost them more than it saves (a 4-rank job:
about 3.5 s of CPU warm, 0.6 s plain). Marked: tests whose ranks import torch, and those
whose ranks must all fail within the default 1 s --settle-s (a plain rank can take longer
than that to start on a busy machine). Warm start itself is tested by test_warm.py (marked
whole) and by the elastic, multi-host and example jobs."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _plain_ranks_unless_marked_warm(request, monkeypatch):
    if request.node.get_closest_marker("warm_ranks") is None:
        monkeypatch.setenv("TENSORPLAY_NO_WARM", "1")
