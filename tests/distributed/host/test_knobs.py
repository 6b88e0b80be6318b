"""Tests for tensorplay.distributed.host.knobs: the TENSORPLAY_* settings, each read and
checked on its own (a bad value names the variable, the value and the fix)."""

from __future__ import annotations

import pytest

from tensorplay.distributed.host import knobs
from tensorplay.distributed.host.knobs import (
    DEFAULT_PROGRESS_S,
    DEFAULT_TIMEOUT_S,
    eager_groups_from_env,
    hostname,
    progress_from_env,
    strict_from_env,
    timeout_from_env,
)
from tests.distributed.host.test_launchers import raises_naming

# --- TENSORPLAY_TIMEOUT, TENSORPLAY_HOSTNAME ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("600", 600.0), ("0.5", 0.5), (" 30 ", 30.0), ("1e3", 1000.0), ("", None)],
)
def test_timeout_good(value, expected):
    assert timeout_from_env({"TENSORPLAY_TIMEOUT": value}) == expected


def test_timeout_unset():
    assert timeout_from_env({}) is None
    assert DEFAULT_TIMEOUT_S == 300.0


@pytest.mark.parametrize("value", ["0", "-5", "ten", "inf", "nan", "30s"])
def test_timeout_bad(value):
    with raises_naming(f"TENSORPLAY_TIMEOUT={value!r}", "positive number of seconds", "Fix:"):
        timeout_from_env({"TENSORPLAY_TIMEOUT": value})


def test_hostname_override_and_default(monkeypatch):
    assert hostname({"TENSORPLAY_HOSTNAME": "sim-host-3"}) == "sim-host-3"
    monkeypatch.setattr(knobs.socket, "gethostname", lambda: "real-host")
    assert hostname({}) == "real-host"
    monkeypatch.setenv("TENSORPLAY_HOSTNAME", "from-os-environ")
    assert hostname() == "from-os-environ"


# --- TENSORPLAY_PROGRESS_S, TENSORPLAY_STRICT, TENSORPLAY_EAGER_GROUPS --------------------------


@pytest.mark.parametrize(("value", "expected"), [("60", 60.0), ("0", 0.0), ("", 30.0)])
def test_progress_good(value, expected):
    assert progress_from_env({"TENSORPLAY_PROGRESS_S": value}) == expected


def test_progress_unset_is_the_default():
    assert progress_from_env({}) == DEFAULT_PROGRESS_S == 30.0


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_progress_bad(value):
    with raises_naming(f"TENSORPLAY_PROGRESS_S={value!r}", "non-negative", "default 30 s"):
        progress_from_env({"TENSORPLAY_PROGRESS_S": value})


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("", False),
                                                 (" 1 ", True)])
def test_strict_good(value, expected):
    assert strict_from_env({"TENSORPLAY_STRICT": value}) is expected
    assert strict_from_env({}) is False


def test_strict_bad():
    with raises_naming("TENSORPLAY_STRICT='yes'", "expected 1 or 0", "Fix:"):
        strict_from_env({"TENSORPLAY_STRICT": "yes"})


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("", None)])
def test_eager_groups_good(value, expected):
    assert eager_groups_from_env({"TENSORPLAY_EAGER_GROUPS": value}) is expected
    assert eager_groups_from_env({}) is None


def test_eager_groups_bad():
    with raises_naming("TENSORPLAY_EAGER_GROUPS='true'", "expected 1 or 0", "Fix:"):
        eager_groups_from_env({"TENSORPLAY_EAGER_GROUPS": "true"})
