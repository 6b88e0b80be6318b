"""etcd as torch's c10d store: under ``tensorplay-run --store etcd`` the ranks meet on the job's
etcd cluster, every rank a client, so gloo's rendezvous of every group and the elastic protocol
(which both use the world's store) outlive the loss of any host, node 0's included.

``EtcdStore`` is a ``torch.distributed.Store`` written in Python over ``backends/etcd.py``'s
``Etcd``: c10d (a ``PrefixStore``, ProcessGroupGloo's rendezvous) calls back into it for each
verb. What torch expects of such a store, found by trying it (torch 2.13):

- **The verbs and their names.** c10d looks up ``set``, ``get``, ``add``, ``compare_set``,
  ``check``, ``wait`` (``wait(keys)`` or ``wait(keys, timeout)``), ``multi_get``,
  ``multi_set`` and ``clone`` by those names, but ``deleteKey`` and ``getNumKeys`` by their
  C++ names: a Python ``delete_key`` alone is "Tried to call pure virtual function
  ::c10d::Store::deleteKey" through a PrefixStore. Both spellings are defined here.
- **The timeout.** ``timeout`` and ``set_timeout`` are the C++ base class's and not virtual:
  ``PrefixStore.set_timeout`` sets the base's value without calling a Python override. So the
  store reads ``self.timeout`` at every call instead of keeping a copy.
- **Errors.** c10d reads two kinds from a Python store: ``DistNetworkError`` (the store is
  gone: here, no member answered with a leader) and ``DistStoreError`` (a wait ran out). An
  ``EtcdFailed`` becomes the one it means (``etcd.failure``), its message naming the endpoints
  and what each said; anything else is a bug and goes up as it is.
- **Lifetime.** c10d keeps only the C++ half of a Python store: once the Python object is
  collected (a temporary handed straight to ``dist.PrefixStore``), its next call fails as
  "INTERNAL ASSERT FAILED ... Not implemented". Every ``EtcdStore`` is therefore kept in
  ``_LIVE`` for the life of the process (a client and its idle connections: a few per world).

Every call is bounded: a unary call by ``CALL_S`` (or the store's timeout when shorter), a
wait for keys by the store's timeout (or the one ``wait`` is given).

Worked example, ``TENSORPLAY_RUN_STORE=etcd://10.0.0.1:2379,10.0.0.2:2379/ranks/``::

    store = connect(["10.0.0.1:2379", "10.0.0.2:2379"], "ranks/", timedelta(seconds=300))
    world = dist.PrefixStore("tensorplay/attempt_0/tensorplay/world_1/", store)
    world.set("tensorplay/joined/5", "977 hostB")
    # the etcd key ranks/tensorplay/attempt_0/tensorplay/world_1//tensorplay/joined/5,
    # written through whichever member answers
    world.add("count", 1)               # 1
    world.compare_set("verdict", "", "lost")  # b"lost": it was missing, so it is set
    world.wait(["never"], timedelta(seconds=1))
    # DistStoreError: wait timeout after 1000ms, keys: tensorplay/.../never (etcd store ...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from . import etcd

T = TypeVar("T")
CALL_S = 30.0  # the bound of one unary call (a set, an add), when the store's timeout is longer
NO_TIMEOUT_S = 300.0  # what a timeout of zero (c10d's kNoTimeout, "no limit") bounds a wait by
_LIVE: list[EtcdStore] = []  # every EtcdStore made: c10d does not keep the Python half alive


class EtcdStore(dist.Store):
    """torch's Store over one etcd client, its keys under ``prefix`` (see the module).

    ``EtcdStore(["127.0.0.1:2379"], "ranks/", timedelta(seconds=30))``: a store whose ``get``
    waits up to 30 s for its key, and whose ``set("a", "1")`` writes the etcd key ``ranks/a``.
    """

    timeout: timedelta  # the C++ base's property (``set_timeout`` sets it): read at each call

    def __init__(self, endpoints: Sequence[str], prefix: str, timeout: timedelta):
        super().__init__()
        self.set_timeout(timeout)
        self._etcd = etcd.Etcd(list(endpoints), min(CALL_S, _seconds(timeout)), prefix)
        _LIVE.append(self)

    def __repr__(self) -> str:
        return f"EtcdStore({self._etcd.endpoints!r}, {self._etcd.prefix!r}, {self.timeout!r})"

    # ------------------------------------------------------------ the verbs (torch's semantics)

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` at ``key``."""
        self._call(f"set {key!r}", [key], lambda e: e.set(key, value))

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting for it up to the store's timeout (DistStoreError)."""
        return self._call(f"get {key!r}", [key],
                          lambda e: e.wait_for([key], self._wait_s(None))[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, waiting for them up to the store's timeout in all."""
        return self._call(f"multi_get {keys!r}", keys,
                          lambda e: e.wait_for(keys, self._wait_s(None)))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """``set`` each key to its value, in order."""
        def write(e: etcd.Etcd) -> None:
            for key, value in zip(keys, values, strict=True):
                e.set(key, value)

        self._call(f"multi_set {keys!r}", keys, write)

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the counter at ``key`` (0 when missing); the new count."""
        return self._call(f"add {key!r}", [key], lambda e: e.add(key, value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Write ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); the value after: ``desired`` when written, else the value that stands (for a
        missing key and a non-empty ``expected``, ``expected``, as TCPStore answers)."""
        return self._call(f"compare_set {key!r}", [key],
                          lambda e: e.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set now (no wait)."""
        return self._call(f"check {keys!r}", keys, lambda e: e.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every one of ``keys`` is set; DistStoreError naming them after
        ``timeout`` (default the store's)."""
        wait_s = self._wait_s(timeout)
        self._call(f"wait {keys!r}", keys, lambda e: e.wait_for(keys, wait_s), wait_s)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        return self._call(f"delete_key {key!r}", [key], lambda e: e.delete(key))

    def num_keys(self) -> int:
        """How many keys the store holds (every key under its prefix, as c10d counts a whole
        store, not a PrefixStore's part of it)."""
        return self._call("num_keys", [], lambda e: e.count(""))

    deleteKey = delete_key  # noqa: N815 - the names c10d looks these two up by
    getNumKeys = num_keys  # noqa: N815

    def clone(self) -> EtcdStore:
        """A store of its own client (its own connections), the same keys and timeout: what
        c10d asks for when another thread needs the store (``PrefixStore.clone``)."""
        return EtcdStore(self._etcd.endpoints, self._etcd.prefix, self.timeout)

    # ------------------------------------------------------------ bounds and errors

    def _wait_s(self, timeout: timedelta | None) -> float:
        """A wait's bound: ``timeout``, else the store's now (``set_timeout`` may change it)."""
        return _seconds(self.timeout if timeout is None else timeout)

    def _call(self, what: str, keys: list[str], call: Callable[[etcd.Etcd], T],
              wait_s: float | None = None) -> T:
        """``call`` on the client, its unary bound the store's timeout now (at most CALL_S);
        an EtcdFailed as the one of c10d's errors it means, saying what really happened
        (``wait_s``: the bound of the wait it made, default the store's timeout)."""
        client = self._etcd
        client.timeout_s = min(CALL_S, _seconds(self.timeout))
        try:
            return call(client)
        except etcd.EtcdFailed as err:
            where = f"etcd store {', '.join(client.endpoints)} (keys under {client.prefix!r})"
            if etcd.failure(err) == "timeout":
                raise dist.DistStoreError(
                    f"wait timeout after {int((wait_s or self._wait_s(None)) * 1000)}ms, keys: "
                    f"{', '.join(keys)} ({where}: {err})") from None
            raise dist.DistNetworkError(
                f"{what}: the {where} did not answer with a leader: {err}") from None


def connect(endpoints: Sequence[str], prefix: str, timeout: timedelta) -> EtcdStore:
    """A store over the cluster at ``endpoints``, checked to answer now (one count of its
    keys): DistNetworkError naming each endpoint and what it said when none does.
    ``connect(["127.0.0.1:2379"], "ranks/", timedelta(seconds=30))``."""
    store = EtcdStore(endpoints, prefix, timeout)
    store.num_keys()
    return store


def _seconds(timeout: timedelta) -> float:
    """A timeout in seconds; zero (c10d's "no limit") bounded by NO_TIMEOUT_S."""
    return timeout.total_seconds() or NO_TIMEOUT_S
