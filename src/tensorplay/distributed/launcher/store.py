"""The launcher's store: the few verbs ``nodes`` uses, behind one small interface.

The launcher of node 0 serves the job's store (ranks are its clients), and every launcher talks
to it for the join and the heartbeats. Its one implementation is torch's TCPStore
(``backends/torch_store.py``), imported here only when a store is served or connected to, so
that a launcher that never serves one never loads torch. Worked example (node 0, then a
client, as ``nodes.Board`` does)::

    listener = netif.listen("127.0.0.1", 29500)
    server = serve(listener, "127.0.0.1", 29500, timeout_s=300)
    client = connect("127.0.0.1", 29500, timeout_s=2)
    client.add("tensorplay-run/beat/1", 1)          # -> 1
    client.compare_set("tensorplay-run/verdict", "", '{"kind": "lost", ...}')
"""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
from datetime import timedelta
from typing import Protocol

from .. import backends


class LauncherStore(Protocol):
    """The verbs the launchers use (torch's TCPStore has them; its errors are its own)."""

    def add(self, key: str, amount: int, /) -> int:
        """Add ``amount`` to the counter at ``key`` (0 when new); return the new value."""
        ...

    def set(self, key: str, value: str, /) -> None:
        """Write ``value`` at ``key``."""
        ...

    def get(self, key: str, /) -> bytes:
        """The value at ``key``, waiting until it is there."""
        ...

    def check(self, keys: list[str], /) -> bool:
        """Whether every key is there, without waiting."""
        ...

    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes:
        """Write ``desired`` at ``key`` if it holds ``expected`` (or is missing and
        ``expected`` is ""); return the value that stands."""
        ...


def can_serve() -> bool:
    """Whether this launcher can serve a job's store (its implementation is installed; this
    loads nothing)."""
    return backends.launcher_can_serve_store()


def preload() -> None:
    """Load the store's implementation (torch) on a thread, now. For a launcher whose warm
    process imports torch anyway: both imports run at once, on two cores, so the first rank
    that asks for the store is not kept waiting for the launcher's own import (about 2.5 s of
    an 8-rank start on 2 cores). A failed import is said again when the store is served."""

    def load() -> None:
        with suppress(Exception):
            from ..backends import torch_store  # noqa: F401

    threading.Thread(target=load, daemon=True, name="tensorplay-run store import").start()


def serve(listener: socket.socket, host: str, port: int, timeout_s: float) -> LauncherStore:
    """Serve the job's store on ``listener`` (taken over); the server is also a client."""
    from ..backends import torch_store

    return torch_store.serve(listener, host, port, timedelta(seconds=timeout_s))


def connect(host: str, port: int, timeout_s: float) -> LauncherStore:
    """A client of the store at ``host:port``; connecting and each call give up after
    ``timeout_s``."""
    from ..backends import torch_store

    return torch_store.connect(host, port, timedelta(seconds=timeout_s))
