"""etcd as torch's c10d store: under ``tensorplay-run --store etcd`` the ranks meet there, so
that gloo's rendezvous of every new group, and the elastic chain of epochs, outlive any host.

``EtcdStore`` is a ``torch.distributed.Store`` written in Python (c10d calls back into it for
every verb) over ``backends/etcd.py``: ``set``, ``get`` (waits for the key, up to the store's
timeout), ``add``, ``compare_set``, ``check``, ``wait``, ``delete_key``, ``num_keys`` and
``clone`` (a client of its own, for torch's threads). c10d reads only two kinds of error from
a Python store, so a failure is one of them, in our words: ``DistNetworkError`` when no member
answers with a leader (the store lost its majority, or is not there), ``DistStoreError`` when a
wait for a key ran out. Anything else would reach the user as c10d's "Not implemented".

Worked example: ``TENSORPLAY_RUN_STORE=etcd://198.18.0.2:29502,198.18.0.3:29504/ranks/``:
``connect(["198.18.0.2:29502", "198.18.0.3:29504"], "ranks/", timedelta(seconds=300))``; a
rank's ``store.set("tensorplay/world_0/joined/5", ...)`` writes the etcd key
``ranks/tensorplay/world_0/joined/5`` through whichever member answers. Cost: one etcd call
per store call (2-3 ms here, against ~0.1 ms for a TCPStore on one host): making a (2, 4)
mesh's groups is bench/etcd_store.py's figure.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from . import etcd

T = TypeVar("T")
_LIVE: list[EtcdStore] = []  # c10d keeps only the C++ half of a Python store: the Python
# object must outlive every use, or its next call fails as "Not implemented"


class EtcdStore(dist.Store):
    """torch's Store over one etcd client (see the module)."""

    timeout: timedelta  # c10d's own property (``set_timeout`` sets it), read at each call

    def __init__(self, endpoints: list[str], prefix: str, timeout: timedelta):
        super().__init__()
        self.set_timeout(timeout)
        self._etcd = etcd.Etcd(endpoints, timeout.total_seconds(), prefix)
        _LIVE.append(self)

    def _client(self) -> etcd.Etcd:
        """The client, its bounds the store's timeout now (``set_timeout`` may change it)."""
        self._etcd.timeout_s = self._etcd.wait_s = self.timeout.total_seconds()
        return self._etcd

    def set(self, key: str, value: str | bytes) -> None:
        _torch_error(lambda: self._client().set(key, value))

    def get(self, key: str) -> bytes:
        return _torch_error(lambda: self._client().get(key))

    def add(self, key: str, value: int) -> int:
        return _torch_error(lambda: self._client().add(key, value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return _torch_error(lambda: self._client().compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return _torch_error(lambda: self._client().check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = None if timeout is None else timeout.total_seconds()
        _torch_error(lambda: self._client().wait_for(keys, wait_s))

    def delete_key(self, key: str) -> bool:
        return _torch_error(lambda: self._client().delete(key))

    def num_keys(self) -> int:
        return _torch_error(lambda: self._client().count(""))

    def clone(self) -> EtcdStore:
        """A store of its own connections, the same keys (c10d clones for its threads)."""
        e = self._etcd
        return EtcdStore(e.endpoints, e.prefix, self.timeout)


def connect(endpoints: list[str], prefix: str, timeout: timedelta) -> EtcdStore:
    """A store over the cluster at ``endpoints``, checked to answer (DistNetworkError naming
    each endpoint and what it said when none does within ``timeout``)."""
    store = EtcdStore(endpoints, prefix, timeout)
    store.num_keys()  # one real call: the members answer
    return store


def _torch_error(call: Callable[[], T]) -> T:
    """``call()``, its EtcdFailed as the one of c10d's errors it means (see the module)."""
    try:
        return call()
    except etcd.EtcdFailed as err:
        kind = etcd.failure(err)
        if kind == "timeout":
            raise dist.DistStoreError(f"the job's etcd store: {err}") from None
        raise dist.DistNetworkError(f"the job's etcd store did not answer with a majority "
                                    f"({err})") from None
