"""How many cases each property test (hypothesis) draws: 100 in the full run, 20 in the daily
tier (``-m "not slow"``), which must stay quick. ``examples(1.5)`` scales a test's count with
its tier (150 in the full run, 30 daily); ``choose`` is called once, by tests/conftest.py."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("full", max_examples=100, deadline=None)
settings.register_profile("daily", max_examples=20, deadline=None)


def choose(markexpr: str) -> None:
    """Load the daily profile when the run leaves the slow tier out, else the full one."""
    settings.load_profile("daily" if "not slow" in markexpr else "full")


def examples(times: float) -> settings:
    """Settings drawing ``times`` the tier's number of cases."""
    return settings(max_examples=max(1, round(settings.default.max_examples * times)))
