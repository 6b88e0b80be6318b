"""The torch.distributed (c10d) engine: gloo on CPU, NCCL on GPU. The only importer of c10d.

Groups are made with c10d's own group helper under a name we derive from the group's ranks
and backend, so a group's identity never depends on how many groups were made before it
(torch's new_group names hashed groups with a running count of all groups).
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import _arrivals, _env
from ..errors import BackendError, DistributedTimeoutError

NAME = "torch"
BACKENDS = ("gloo", "nccl")
JOINED = "tensorplay/joined/"  # + rank: "<pid> <host>", posted as each rank joins
OPENED = "tensorplay/opened"  # set by rank 0 in its world's namespace once it serves it
_worlds_started = 0  # worlds this process has started: the k of their key prefix


def _joined_mark() -> str:
    """What a rank posts as it joins: its pid and host, which the host exchange reads."""
    return f"{os.getpid()} {_env.hostname()}"


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def check_available(backend: str) -> None:
    """Raise BackendError when this torch build lacks ``backend``."""
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    if not available.get(backend, False):
        raise BackendError(
            f"backend={backend!r} is not available in this torch build "
            f"(gloo: {available['gloo']}, nccl: {available['nccl']}). Fix: use "
            f"backend='gloo' on CPU, or install a CUDA build of torch for nccl."
        )


def make_tcp_store(
    host: str, port: int, *, rank: int, world_size: int, timeout: timedelta
) -> dist.Store:
    """The store of this process's next world, its keys under ``tensorplay/world_<k>/``.

    Rank 0 serves it, listening only on ``host``; under torchrun the agent serves it and
    every rank is a client. Either way a store can outlive a world (torchrun's agent; rank
    0's old server, still up while a fast rank re-inits), so each world this process starts
    gets its own prefix and reads none of an older world's keys (every rank counts alike,
    SPMD). A client waits for rank 0 to open its world there, so it never joins an old one.
    """
    global _worlds_started
    _worlds_started += 1
    prefix = f"tensorplay/world_{_worlds_started}/"
    attempt = _env.agent_store_attempt()
    if attempt is not None:
        client = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        return dist.PrefixStore(f"tensorplay/attempt_{attempt}/{prefix}", client)
    if rank != 0:
        return _join_opened_world(host, port, world_size, timeout, prefix)
    store = dist.PrefixStore(prefix, _serve(host, port, world_size, timeout))
    store.set(OPENED, "1")
    return store


def _serve(host: str, port: int, world_size: int, timeout: timedelta) -> dist.Store:
    """Rank 0's TCPStore server, bound to ``host`` alone."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as err:
        listener.close()
        raise BackendError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous store: {err}. Fix: set "
            f"MASTER_ADDR to an address of rank 0's machine and MASTER_PORT to a free port."
        ) from err
    listener.listen(max(128, world_size))
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def _join_opened_world(
    host: str, port: int, world_size: int, timeout: timedelta, prefix: str
) -> dist.Store:
    """A client of rank 0's store once rank 0 has opened world ``prefix`` there.

    Connected to rank 0's previous server (still up while rank 0 leaves its last world), the
    wait ends when that server closes; then connect again, to the new one.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    answered = False
    while True:
        _await_listener(host, port, deadline)
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            client = dist.TCPStore(host, port, world_size, False, timeout=left)
        except dist.DistError:
            if not answered:
                raise
            break
        answered = True
        store = dist.PrefixStore(prefix, client)
        try:
            store.wait([OPENED], left)
            return store
        except dist.DistNetworkError:  # that server closed: rank 0 may be starting a new one
            if time.monotonic() < deadline:
                continue
        except dist.DistStoreError:  # timed out
            pass
        break
    raise dist.DistStoreError(
        f"it answered but never opened world {prefix!r}, this process's world number "
        f"{_worlds_started}; every rank must call init_process_group the same number of times"
    )


def _await_listener(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts connections, or at ``deadline``.

    A TCPStore client refused by a server that is not listening yet backs off (250-420 ms
    measured with torch 2.13), most of a job's start when every rank starts at once; probing
    with short, growing pauses (2 ms to 250 ms, jittered) meets rank 0's server within
    milliseconds.
    """
    pause = 0.002
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(max(left, 0.05), 1.0)):
                return
        except OSError:
            if left <= 0:
                return  # the TCPStore client says what went wrong
            time.sleep(min(pause * (0.5 + random.random()), max(left, 0.0)))
            pause = min(pause * 2, 0.25)


def init_world(
    backend: str,
    init_method: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    master: tuple[str, int] | None,
) -> tuple[Any, Any]:
    """Start c10d's default group; returns (engine group, store).

    A rendezvous that times out says which ranks never joined (each rank marks its arrival
    in the store first).
    """
    check_available(backend)
    if master is not None:
        step = f"init_process_group rendezvous at {master[0]}:{master[1]}"
        try:
            store = make_tcp_store(
                master[0], master[1], rank=rank, world_size=world_size, timeout=timeout
            )
        except (RuntimeError, dist.DistError) as err:
            raise DistributedTimeoutError(
                step, timeout.total_seconds(), [0],
                f"Rank 0 serves the store there ({_first_line(err)}).",
            ) from err
        store.set(f"{JOINED}{rank}", _joined_mark())
        try:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        except (RuntimeError, dist.DistError) as err:
            raise DistributedTimeoutError(
                step, timeout.total_seconds(), absent(store, range(world_size), JOINED),
                f"({_first_line(err)})",
            ) from err
    else:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        store = c10d._get_default_store()
        store.set(f"{JOINED}{rank}", _joined_mark())
    return dist.group.WORLD, store


def absent(store: Any, ranks: Iterable[int], prefix: str) -> list[int] | None:
    """Those of ``ranks`` that never set ``prefix + rank`` in the store; None if it is gone."""
    ranks = list(ranks)
    try:
        return [ranks[i] for i in _arrivals.unset(store, [f"{prefix}{r}" for r in ranks])]
    except (RuntimeError, dist.DistError):  # rank 0, which serves the store, has left
        return None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


def new_group(name: str, ranks: list[int], backend: str, timeout: timedelta, desc: str) -> Any:
    """Create a c10d group named ``name`` of ``ranks`` (in this order); members only call it."""
    check_available(backend)
    store = c10d._get_default_store()
    group_rank = ranks.index(dist.get_rank())
    group, _ = c10d._new_process_group_helper(
        len(ranks),
        group_rank,
        ranks,
        backend,
        store,
        name,
        timeout=timeout,
        group_desc=desc,
    )
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    return group


def destroy() -> None:
    """Tear c10d down (all groups)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# Groups inside torch's coalescing manager: a call there must be queued by torch's wrapper.
COALESCING: dict = getattr(c10d._world, "pg_coalesce_state", {})


def allreduce_options(op: Any) -> Any:
    """c10d's options for a blocking all_reduce with ``op``, made once and reused per call."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.8 tells the engine the caller will wait
        opts.asyncOp = False
    return opts


def is_engine_group(obj: object) -> bool:
    """True for a c10d ProcessGroup object."""
    return isinstance(obj, dist.ProcessGroup)


def parse_tcp(init_method: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// URL, None for other schemes."""
    url = urlparse(init_method)
    if url.scheme != "tcp":
        return None
    return url.hostname or "127.0.0.1", int(url.port or 0)
