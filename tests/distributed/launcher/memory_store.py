"""An in-memory stand-in for the launcher's store (``launcher.store.LauncherStore``), for tests
that run the launcher's join, heartbeat and verdicts as threads of this process.

Values are set as str and read as bytes, as torch's TCPStore does; ``get`` of a missing key
raises at once (the launcher only gets keys it checked). ``kill()`` stops the server: every
later call raises ``Gone("Connection reset by peer")``, as a client of a dead TCPStore
raises a RuntimeError; ``failure`` is this store's reader of its errors (``torch_store.failure``
is torch's), and ``client(raw)`` a launcher client of it. ``broken`` replaces one verb with a
function that raises what a bug would::

    raw = MemoryStore()
    raw.broken["add"] = ZeroDivisionError("division by zero")
    client(raw).add("k", 1)  # ZeroDivisionError: not a store failure, so not a StoreGone
"""

from __future__ import annotations

import threading

from tensorplay.distributed.launcher.store import Client


class Gone(RuntimeError):
    """What a call of a killed MemoryStore raises."""


def failure(err: BaseException) -> str | None:
    """This store's reading of its errors: "gone" once killed; anything else is a bug."""
    return "gone" if isinstance(err, Gone) else None


def client(raw: MemoryStore) -> Client:
    """A launcher client of ``raw``."""
    return Client(raw, failure)


class MemoryStore:
    """A thread-safe dict with the launcher store's five verbs (see the module)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.broken: dict[str, BaseException] = {}  # verb -> what it raises instead
        self._lock = threading.Lock()
        self._dead = False

    def kill(self) -> None:
        self._dead = True

    def _enter(self, verb: str) -> None:
        if verb in self.broken:
            raise self.broken[verb]
        if self._dead:
            raise Gone("Connection reset by peer")

    def add(self, key: str, amount: int, /) -> int:
        self._enter("add")
        with self._lock:
            value = int(self.kv.get(key, b"0")) + amount
            self.kv[key] = str(value).encode()
            return value

    def set(self, key: str, value: str, /) -> None:
        self._enter("set")
        with self._lock:
            self.kv[key] = value.encode()

    def get(self, key: str, /) -> bytes:
        self._enter("get")
        with self._lock:
            return self.kv[key]

    def check(self, keys: list[str], /) -> bool:
        self._enter("check")
        with self._lock:
            return all(k in self.kv for k in keys)

    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes:
        self._enter("compare_set")
        with self._lock:
            now = self.kv.get(key)
            if (now is None and expected == "") or now == expected.encode():
                self.kv[key] = desired.encode()
            elif now is None:
                return expected.encode()
            return self.kv[key]
