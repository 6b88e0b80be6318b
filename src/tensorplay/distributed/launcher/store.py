"""The launcher's store: the few verbs the launchers use, and the one place that says what a failed
store call means.

The launcher of node 0 serves the job's store (ranks are its clients), and every launcher talks
to it for the join and the heartbeats. Its one implementation is torch's TCPStore
(``backends/torch_store.py``), imported here only when a store is served or connected to, so
that a launcher that never serves one never loads torch.

Every failure of a store call comes out of this module as ``StoreGone``: the implementation's
own errors (torch's DistError family, RuntimeErrors, and OSError from its sockets), a server
that the probe before a connection never met, and a call that did not answer within its
bound (``bounded``: torch's client can block for ever on a link gone silent). Anything else a
call raises is a bug and goes up as it is. ``StoreGone.refused`` is what a heartbeat needs to
know: True when a connection to the store's address was refused (its host is up and nothing
listens there: node 0's launcher is gone, so there is no point waiting --node-grace-s out),
False when the store only did not answer (a frozen node 0, a cut link). Worked example
(node 0, then a client, as ``nodes.JobNodes`` does)::

    listener = netif.listen("127.0.0.1", 29500)
    server = serve(listener, "127.0.0.1", 29500, timeout_s=300)
    client = connect("127.0.0.1", 29500, time.monotonic() + 2.0, CALL_S)
    client.add("tensorplay-run/beat/1/1", 1)          # -> 1
    server = None  # node 0 stops serving; 1 s later:
    client.add("tensorplay-run/beat/1/1", 1)          # StoreGone('Connection reset by peer')
    connect("127.0.0.1", 29500, time.monotonic() + 2.0, CALL_S)
    # StoreGone('Connection refused', refused=True), once the 2 s of probing are over
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from .. import backends
from ..host import netif
from .bugs import report_bug

CALL_S = 2.0  # a launcher's bounded store call gives up after this long
POLL_S = 0.05  # how often a launcher that waits for a key looks again

T = TypeVar("T")
R = TypeVar("R", bound="Posted")


class Posted:
    """A record launchers post in the job's store as one JSON object (a dataclass's fields):
    ``Verdict(kind="lost", text="node 1 ...", ranks=[4, 5, 6, 7]).dumps()`` is
    ``{"kind": "lost", "text": "node 1 ...", ...}``, and ``Verdict.loads`` of it the same
    record again."""

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def loads(cls: type[R], raw: bytes | str) -> R:
        return cls(**json.loads(raw))


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


class StoreGone(Exception):
    """A call to the job's store failed (see the module): ``str()`` is what it said, in one
    line; ``refused``: its address refused a connection, so its server has ended."""

    def __init__(self, said: str, refused: bool = False):
        super().__init__(said)
        self.refused = refused


def said(err: BaseException) -> str:
    """The first line of an error, without torch's source location (at most 200 chars)."""
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:200]


Failure = Callable[[BaseException], "str | None"]  # a store's reader of its own errors


def call(failure: Failure, verb: Callable[..., T], *args: Any) -> T:
    """``verb(*args)`` on the store; what its implementation's reader of errors
    (``failure``: ``torch_store.failure`` for torch's store, the torch engine's reader too)
    calls a failure, gone or a wait ran out, is a ``StoreGone``; anything else is a bug and
    goes up as it is."""
    try:
        return verb(*args)
    except Exception as err:
        if failure(err) is None:
            raise
        raise StoreGone(said(err)) from err


class Client:
    """A client of the job's store whose every failure is a ``StoreGone``. ``failure`` reads
    the implementation's errors: ``connect`` gives torch's (``torch_store.failure``), a test's
    in-memory store its own."""

    def __init__(self, raw: LauncherStore, failure: Failure):
        self._raw = raw
        self._failure = failure

    @property
    def raw(self) -> LauncherStore:
        """The store's implementation (for verbs only it has: etcd's leases and watches)."""
        return self._raw

    def add(self, key: str, amount: int) -> int:
        return int(call(self._failure, self._raw.add, key, amount))

    def set(self, key: str, value: str) -> None:
        call(self._failure, self._raw.set, key, value)

    def get(self, key: str) -> bytes:
        return call(self._failure, self._raw.get, key)

    def check(self, keys: list[str]) -> bool:
        return bool(call(self._failure, self._raw.check, keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return call(self._failure, self._raw.compare_set, key, expected, desired)


def can_serve() -> bool:
    """Whether this launcher can serve a job's store (its implementation is installed; this
    loads nothing)."""
    return backends.launcher_can_serve_store()


def preload() -> None:
    """Load the store's implementation (torch) on a thread, now. For a launcher that serves
    or joins the TCPStore (``--store tcp``) and whose warm process imports torch anyway: both
    imports run at once, on two cores, so the first rank that asks for the store is not kept
    waiting for the launcher's own import (about 2.5 s of an 8-rank start on 2 cores). A
    launcher of ``--store etcd`` never imports torch, so it does not call this."""

    def load() -> None:
        try:
            from ..backends import torch_store  # noqa: F401
        except (ImportError, OSError):  # a broken install: imported again, and raised, by
            return  # serve() on the main thread, which says it there

    threading.Thread(target=load, daemon=True, name="tensorplay-run store import").start()


def serve(listener: socket.socket, host: str, port: int, timeout_s: float) -> LauncherStore:
    """Serve the job's store on ``listener`` (taken over); the server is also a client."""
    from ..backends import torch_store

    return torch_store.serve(listener, host, port, timedelta(seconds=timeout_s))


def connect(host: str, port: int, deadline: float, timeout_s: float) -> Client:
    """A client of the store at ``host:port``: its address probed with plain connects until
    ``deadline`` (``_netif.await_listener``: torch's own client backs off for 250-420 ms and
    logs a C++ trace per refused try), then connected; each call gives up after the time left
    to ``deadline``, but never sooner than ``timeout_s``. StoreGone when the probe never met
    a server (``refused`` when the last try was refused) or the client fails."""
    problem = netif.await_listener(host, port, deadline)
    if problem is not None:  # await_listener gives the probe's strerror: compared, not parsed
        raise StoreGone(problem, refused=problem == os.strerror(errno.ECONNREFUSED))
    from ..backends import torch_store

    timeout = timedelta(seconds=max(deadline - time.monotonic(), timeout_s))
    return Client(call(torch_store.failure, torch_store.connect, host, port, timeout),
                  torch_store.failure)


def bounded(call: Callable[[], T], timeout_s: float) -> T:
    """``call()``, run on a daemon thread so that this thread waits at most ``timeout_s``
    (then StoreGone): torch's store client can block for ever on a link that went silent.
    A call that timed out is abandoned, still blocked, with its client (never reuse that
    client). What the call raises is raised here; if it raises only after it was abandoned,
    a store failure is dropped with it, and anything else is reported as a bug."""
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            value = call()
        except BaseException as err:  # noqa: BLE001 - raised again by the caller, or reported
            with lock:
                box["error"] = err
                late = "late" in box
            if late and not isinstance(err, StoreGone):
                report_bug("a store call given up on", err)
            return
        with lock:
            box["value"] = value

    thread = threading.Thread(target=run, daemon=True, name="tensorplay-run store call")
    thread.start()
    thread.join(timeout_s)
    with lock:
        if "error" in box:
            raise box["error"]
        if "value" in box:
            return box["value"]
        box["late"] = True
    raise StoreGone(f"the store did not answer within {timeout_s:g} s")
