"""torch's TCPStore, served on one address only: for rank 0's world and for tensorplay-run.

``TCPStore(is_master=True)`` alone listens on every interface of the machine. We bind the
socket ourselves (``netif.listen``) to the address the job was given (MASTER_ADDR, or
tensorplay-run's --master-addr: loopback on one node) and hand it over
(``master_listen_fd``), so the store is reachable from where the ranks are and from nowhere
else. ``connect`` is a client with its
own timeout, for the launcher's heartbeats, which must give up in seconds, not minutes.
``failure`` is the one reader of what a store call's exception means, for the torch engine
(``TorchEngine.store_failure``) and the launcher (``launcher/store.py``) alike.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Literal

import torch.distributed as dist


def serve(listener: socket.socket, host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The store's server on ``listener`` (which it takes over), as an ordinary store client."""
    return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def connect(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the store at ``host:port``; connecting and each call give up after
    ``timeout`` (torch.distributed.DistError, DistNetworkError when the server is gone)."""
    return dist.TCPStore(host, port, None, False, timeout=timeout)


def failure(err: BaseException) -> Literal["gone", "timeout"] | None:
    """What a TCPStore call's exception means: "gone" for DistNetworkError (a ``set`` once
    the server's process has exited: "Broken pipe"; a ``clone`` whose connect timed out) and
    for any other RuntimeError or OSError not worded as a timeout ("Connection reset by
    peer"); "timeout" for DistStoreError ("wait timeout after 1000ms, keys: /nokey") and a
    RuntimeError worded so; None for anything else (a TypeError: a bug, raised as it is)."""
    if isinstance(err, dist.DistNetworkError | ConnectionError):
        return "gone"
    if not isinstance(err, RuntimeError | OSError):
        return None
    lowered = str(err).lower()
    if isinstance(err, dist.DistStoreError) or "timeout" in lowered or "timed out" in lowered:
        return "timeout"
    return "gone"
