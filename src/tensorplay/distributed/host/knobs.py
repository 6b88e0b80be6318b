"""The package's own settings, read from the environment: ``TENSORPLAY_*`` knobs a user sets.

Each is read where it is used (at ``init_process_group``, at a mesh's making) and checked
there, a bad value a ``LaunchEnvError`` naming the variable, its value and the fix:

- ``TENSORPLAY_TIMEOUT``: the default timeout of every blocking call, in seconds
  (``timeout_from_env``; 300 s unset, ``DEFAULT_TIMEOUT_S``);
- ``TENSORPLAY_PROGRESS_S``: how long a call waits before it logs what it waits for
  (``progress_from_env``; 30 s unset, 0 off);
- ``TENSORPLAY_STRICT=1``: every collective's fingerprint checked across its group
  (``strict_from_env``);
- ``TENSORPLAY_EAGER_GROUPS``: 1 makes every mesh group at once, 0 each at its first use
  (``eager_groups_from_env``; unset: a mesh's own groups at once, its views' at first use);
- ``TENSORPLAY_HOSTNAME``: this host's name, so that one machine can play many hosts in
  tests (``hostname``);
- ``TENSORPLAY_ETCD_BINARY``: the etcd server ``tensorplay-run --store etcd`` runs, a path
  (``etcd_binary_from_env``; unset: ``etcd`` on PATH, else beside the Python running).

Worked example: ``TENSORPLAY_TIMEOUT=600 TENSORPLAY_PROGRESS_S=0`` gives
``timeout_from_env() == 600.0`` and ``progress_from_env() == 0.0`` (no notice);
``TENSORPLAY_TIMEOUT=30s`` raises ``TENSORPLAY_TIMEOUT='30s': expected a positive number of
seconds. Fix: set it like TENSORPLAY_TIMEOUT=600, or unset it for the default 300 s.``

The launchers' variables are ``host/launchers.py``'s; what tensorplay-run tells its ranks is
``host/wire.py``'s.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping

from ..errors import LaunchEnvError
from .launchers import environ_of, value

TENSORPLAY_TIMEOUT = "TENSORPLAY_TIMEOUT"
TENSORPLAY_PROGRESS_S = "TENSORPLAY_PROGRESS_S"
TENSORPLAY_STRICT = "TENSORPLAY_STRICT"
TENSORPLAY_EAGER_GROUPS = "TENSORPLAY_EAGER_GROUPS"
TENSORPLAY_HOSTNAME = "TENSORPLAY_HOSTNAME"
TENSORPLAY_ETCD_BINARY = "TENSORPLAY_ETCD_BINARY"
DEFAULT_PROGRESS_S = 30.0
DEFAULT_TIMEOUT_S = 300.0


def _text(environ: Mapping[str, str] | None, name: str) -> str | None:
    """The stripped value of name in environ (else os.environ); None when unset or blank."""
    return value(environ_of(environ), name)


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """TENSORPLAY_TIMEOUT in seconds (a finite number > 0); None when unset."""
    return _seconds(environ, TENSORPLAY_TIMEOUT, DEFAULT_TIMEOUT_S, "600", minimum_zero=False)


def progress_from_env(environ: Mapping[str, str] | None = None) -> float:
    """TENSORPLAY_PROGRESS_S: how long a call waits before it says what it waits for
    (default 30 s; 0 turns the notice off)."""
    seconds = _seconds(environ, TENSORPLAY_PROGRESS_S, DEFAULT_PROGRESS_S, "60",
                       minimum_zero=True)
    return DEFAULT_PROGRESS_S if seconds is None else seconds


def strict_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """TENSORPLAY_STRICT=1: check every collective's fingerprint across its group."""
    text = _text(environ, TENSORPLAY_STRICT)
    if text is None or text == "0":
        return False
    if text == "1":
        return True
    raise LaunchEnvError(f"{TENSORPLAY_STRICT}={text!r}: expected 1 or 0. Fix: set "
                         f"{TENSORPLAY_STRICT}=1 to check every collective, or unset it.")


def eager_groups_from_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """TENSORPLAY_EAGER_GROUPS: 1 makes every mesh group at once (views too), 0 none until its
    first use (init_device_mesh's too); unset (None): a mesh's own groups at once, its views'
    at first use."""
    text = _text(environ, TENSORPLAY_EAGER_GROUPS)
    if text is None:
        return None
    if text in ("0", "1"):
        return text == "1"
    raise LaunchEnvError(f"{TENSORPLAY_EAGER_GROUPS}={text!r}: expected 1 or 0. Fix: set "
                         f"{TENSORPLAY_EAGER_GROUPS}=1 to make every group when its mesh is "
                         "made, 0 to make each at its first use, or unset it.")


def _seconds(environ: Mapping[str, str] | None, name: str, default: float, example: str,
             minimum_zero: bool) -> float | None:
    """A duration in seconds read from ``name``; None when unset: " 30 " -> 30.0, "1e3" ->
    1000.0; "inf", "nan" and "30s" refused."""
    text = _text(environ, name)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds >= 0 if minimum_zero else seconds > 0)):
        kind = "non-negative" if minimum_zero else "positive"
        raise LaunchEnvError(
            f"{name}={text!r}: expected a {kind} number of seconds. Fix: set it"
            f" like {name}={example}, or unset it for the default {default:g} s."
        )
    return seconds


def hostname(environ: Mapping[str, str] | None = None) -> str:
    """This host's name: TENSORPLAY_HOSTNAME (to simulate many hosts in tests), else the OS's."""
    return _text(environ, TENSORPLAY_HOSTNAME) or socket.gethostname()


def etcd_binary_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """TENSORPLAY_ETCD_BINARY: the etcd server to run, as given ("/opt/etcd/bin/etcd"); None
    when unset (the launcher's ``etcd_members.find_binary`` checks that it runs)."""
    return _text(environ, TENSORPLAY_ETCD_BINARY)
