"""Where a torch world's ranks meet: the TCPStore rendezvous, and the address gloo advertises.

Rank 0 serves the store of its next world on MASTER_ADDR alone (``torch_store.serve`` on a
socket bound to that address); every other rank is a client that waits until rank 0 opened
that world there, so a fast rank re-initialising never joins rank 0's old world. Each world
of the process keeps its keys under ``tensorplay/world_<k>/`` (``control/keys.py``). Under
torchrun the agent serves the store and every rank is a client; under ``tensorplay-run --store
etcd`` the job's etcd is the store (``torch_etcd``), every rank a client, no host special.
Before c10d's world group is made, ``pick_interface`` makes gloo (and NCCL) advertise the
address this host reaches MASTER_ADDR from (``forget_interface`` undoes it at the world's
end), and a rank that tensorplay-run restarted makes its world group without meeting the
others (``alone_if_restarted``). ``torch_c10d.start`` runs these in that order.

Worked example: 8 ranks, MASTER_ADDR 10.0.0.1:29500, this process's second world: rank 0
serves 10.0.0.1:29500 and sets ``tensorplay/world_2/tensorplay/opened``; rank 5 connects and
waits for that key (on rank 0's first server, still closing, it waits for the new one), posts
``tensorplay/world_2/tensorplay/joined/5`` = "<pid> <host>", and sets GLOO_SOCKET_IFNAME to
the interface its route to 10.0.0.1 leaves by (eth0, say) unless the user set one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ..control import keys
from ..errors import BackendError
from ..host import knobs, launchers, netif, wire
from . import torch_store

log = logging.getLogger("tensorplay.distributed")


def joined_mark() -> str:
    """What a rank posts as it joins: its pid and host, which the host exchange reads."""
    return f"{os.getpid()} {knobs.hostname()}"


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
    prefix = keys.world_prefix(keys.next_world())
    attempt = launchers.agent_store_attempt()
    if (cluster := wire.etcd_store()) is not None:  # tensorplay-run --store etcd: no host's
        return _etcd_world(*cluster, timeout, prefix)  # process serves it
    if attempt is not None:
        netif.await_listener(host, port, time.monotonic() + timeout.total_seconds())
        client = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        return dist.PrefixStore(keys.ATTEMPT_PREFIX.format(attempt=attempt) + prefix, client)
    if rank != 0:
        return _join_opened_world(host, port, world_size, timeout, prefix)
    store = dist.PrefixStore(prefix, _serve(host, port, world_size, timeout))
    store.set(keys.OPENED, "1")
    return store


def _etcd_world(endpoints: list[str], cluster_prefix: str, timeout: timedelta, prefix: str
                ) -> dist.Store:
    """The job's etcd as this world's store, the keys laid out as under an agent's store
    (attempt 0: tensorplay-run restarts ranks, not worlds); every rank a client."""
    from . import torch_etcd

    try:
        store = torch_etcd.connect(endpoints, cluster_prefix, timeout)
    except dist.DistError as err:
        raise BackendError(f"the job's etcd store ({', '.join(endpoints)}, from "
                           f"{wire.STORE}) did not answer: {err}. Fix: check that "
                           f"tensorplay-run's launchers are up and reach each other") from None
    return dist.PrefixStore(keys.ATTEMPT_PREFIX.format(attempt=0) + prefix, store)


def _serve(host: str, port: int, world_size: int, timeout: timedelta) -> dist.Store:
    """Rank 0's TCPStore server, bound to ``host`` alone."""
    try:
        listener = netif.listen(host, port, world_size)
    except OSError as err:
        raise BackendError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous store: {err}. Fix: set "
            f"MASTER_ADDR to an address of rank 0's machine and MASTER_PORT to a free port."
        ) from err
    return torch_store.serve(listener, host, port, timeout)


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
        netif.await_listener(host, port, deadline)  # the client says what went wrong
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
            store.wait([keys.OPENED], left)
            return store
        except dist.DistNetworkError:  # that server closed: rank 0 may be starting a new one
            if time.monotonic() < deadline:
                continue
        except dist.DistStoreError:  # timed out
            pass
        break
    raise dist.DistStoreError(
        f"it answered but never opened world {prefix!r}, this process's world number "
        f"{keys.worlds_started()}; every rank must call init_process_group the same number "
        f"of times"
    )


@contextmanager
def alone_if_restarted() -> Iterator[None]:
    """For a rank tensorplay-run restarted (elastic mode): c10d's world group is made
    without meeting the other ranks (gloo connects a pair on its first use, and this group is
    never used), since they are far past their own start. Its mesh groups, made later by
    their members, connect at once as usual."""
    if wire.rank_restart_count() == 0 or os.environ.get(_GLOO_LAZY) is not None:
        yield
        return
    os.environ[_GLOO_LAZY] = "1"
    try:
        yield
    finally:
        del os.environ[_GLOO_LAZY]


_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_picked: dict[str, str] = {}  # the interface variables this process set (not the user's)


def pick_interface(master_host: str) -> None:
    """Make gloo (and NCCL) advertise the address this host reaches ``master_host`` from.

    Left alone, gloo advertises the address its host name resolves to, and falls back to
    127.0.0.1 when the name does not resolve: ranks on other hosts then connect to their own
    loopback ("Connection refused, remote=[127.0.0.1]"). The interface that routes to
    MASTER_ADDR is the one every other host can reach this one on. A user's
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME always wins, but a loopback one in a job whose
    MASTER_ADDR is another host's fails now, naming this host, not after a timeout.
    """
    route = netif.route_to(master_host)
    users = {v: os.environ[v] for v in _IFNAME_VARS
             if os.environ.get(v) and os.environ[v] != _picked.get(v)}
    chosen = users.get("GLOO_SOCKET_IFNAME")
    if (chosen and route is not None and not netif.is_local(master_host)
            and netif.interface_addresses().get(chosen, "").startswith("127.")):
        raise BackendError(
            f"host {knobs.hostname()}: GLOO_SOCKET_IFNAME={chosen} makes gloo advertise a "
            f"loopback address, which ranks on other hosts cannot reach (MASTER_ADDR "
            f"{master_host} is another host's, reached through {route.interface}, "
            f"{route.address}). Fix: unset GLOO_SOCKET_IFNAME, or set "
            f"GLOO_SOCKET_IFNAME={route.interface}."
        )
    if users or route is None:  # the user's choice, or gloo's own (an error then says why)
        return
    for var in _IFNAME_VARS:
        _picked[var] = os.environ[var] = route.interface
    log.info("gloo advertises %s (interface %s), the address this host %s reaches "
             "MASTER_ADDR %s from", route.address, route.interface, knobs.hostname(), master_host)


def forget_interface() -> None:
    """Unset the interface variables ``pick_interface`` set, where they still hold what it
    set: the interface was a world's choice, not the process's (a later world, or a child,
    chooses anew)."""
    for var, value in _picked.items():
        if os.environ.get(var) == value:
            del os.environ[var]
    _picked.clear()
