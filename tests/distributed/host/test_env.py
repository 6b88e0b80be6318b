"""Tests for tensorplay.distributed.host.env: each name it gives its importers is the object
``host/launchers.py`` or ``host/knobs.py`` defines, so the two can never drift apart."""

from __future__ import annotations

from tensorplay.distributed.host import env, knobs, launchers


def test_every_name_is_the_defining_modules_own():
    for name in env.__all__:
        home = knobs if name in knobs.__dict__ else launchers
        assert getattr(env, name) is getattr(home, name), name
    assert set(env.__all__) == {"DEFAULT_TIMEOUT_S", "agent_store_attempt", "detect",
                                "eager_groups_from_env", "hostname", "local_rank_from_env"}
