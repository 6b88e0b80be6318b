"""Start and stop the job's world, and ask it about ranks: the torch.distributed-shaped entry.

init_process_group() reads the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...),
starts the engine (gloo, nccl, or the in-process "fake" world) and keeps one World per process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from . import _env
from ._consensus import named_failures
from ._mesh_spec import Ranks
from .errors import (
    ArgumentError,
    NotInitializedError,
    bad_argument,
    bad_type,
    format_ranks,
)
from .process_group import ProcessGroup, World, check_ranks_in_world

log = logging.getLogger("tensorplay.distributed")

BACKENDS = ("gloo", "nccl", "fake")
_WORLD: World | None = None


def _engine_for(backend: str):
    """The engine module that runs ``backend`` (imported only when needed)."""
    if backend == "fake":
        from .backends import fake

        return fake
    from .backends import torch_c10d

    return torch_c10d


def _check_int(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(name, value, "int", fix)
    return value


def to_timedelta(timeout: object, name: str = "timeout") -> timedelta:
    """Normalise a timeout given as timedelta or seconds; None reads TENSORPLAY_TIMEOUT."""
    if timeout is None:
        seconds = _env.timeout_from_env()
        return timedelta(seconds=_env.DEFAULT_TIMEOUT_S if seconds is None else seconds)
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise bad_type(name, timeout, "datetime.timedelta or seconds", "pass e.g. timeout=60")
    if not seconds > 0:
        raise bad_argument(name, timeout, "must be positive", "pass e.g. timeout=60")
    return timedelta(seconds=seconds)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    timeout: timedelta | float | None = None,
) -> None:
    """Join the job: every rank calls it once before any mesh or collective.

    backend: "gloo" (CPU), "nccl" (GPU) or "fake" (a simulated world in this process);
    default nccl when CUDA is usable, else gloo. init_method: "env://" (default; RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT as tensorplay-run, torchrun, SLURM or mpirun set
    them), "tcp://host:port" or "file:///path". timeout bounds every wait (default 300 s or
    TENSORPLAY_TIMEOUT).
    """
    global _WORLD
    if _WORLD is not None:
        raise ArgumentError(
            "init_process_group: this process already joined a world "
            f"(rank {_WORLD.rank} of {_WORLD.size}). Fix: call destroy_process_group() first."
        )
    if backend is not None and not isinstance(backend, str):
        raise bad_type("backend", backend, "str", f"use one of {BACKENDS}")
    if init_method is not None and not isinstance(init_method, str):
        raise bad_type("init_method", init_method, "str", "use 'env://' or 'tcp://host:port'")
    world_size = _check_int("world_size", world_size, "pass the number of processes")
    rank = _check_int("rank", rank, "pass this process's rank")
    wait = to_timedelta(timeout)
    if backend is None:
        from .backends import torch_c10d

        backend = torch_c10d.default_backend()
    backend = backend.lower()
    if backend not in BACKENDS:
        raise bad_argument("backend", backend, "unknown backend", f"use one of {BACKENDS}")
    init_method = init_method or "env://"
    scheme = init_method.split("://", 1)[0] if "://" in init_method else ""
    if scheme not in ("env", "tcp", "file"):
        raise bad_argument(
            "init_method", init_method, "unknown scheme",
            "use 'env://', 'tcp://host:port' or 'file:///shared/path'",
        )
    launch = _env.detect()
    if rank < 0:
        rank = _from_launch(launch, "rank", "RANK")
    if world_size < 0:
        world_size = _from_launch(launch, "world_size", "WORLD_SIZE")
    if world_size < 1:
        raise bad_argument("world_size", world_size, "must be at least 1", "pass world_size>=1")
    if not 0 <= rank < world_size:
        raise bad_argument(
            "rank", rank, f"must be in 0..{world_size - 1} for world_size={world_size}",
            "give each process a distinct rank below world_size",
        )
    engine = _engine_for(backend)
    master = None
    if backend != "fake":
        master = _master_address(scheme, init_method, launch)
    engine_group, store = engine.init_world(
        backend, init_method, rank=rank, world_size=world_size, timeout=wait, master=master
    )
    _WORLD = World(
        rank, world_size, backend, wait, engine, store, engine_default_group=engine_group
    )
    if store is not None and world_size > 1:
        with named_failures(_WORLD, "init_process_group(): exchanging host names"):
            _WORLD.host_pids = _exchange_hosts(_WORLD)
    log.debug("joined world: rank %d of %d, backend %s", rank, world_size, backend)


HOSTS = "tensorplay/hosts"  # every rank's host name, one per line, posted by rank 0
ON_HOST = "tensorplay/host/{host}"  # "<rank>:<pid>;..." of one host, posted by rank 0


def _exchange_hosts(world: World) -> dict[int, int]:
    """Return rank -> pid of the ranks on this host.

    Each rank posted "<pid> <host>" as it joined (the engine's JOINED mark); rank 0 reads them
    all with one multi_get and posts, with one multi_set, every host's rank:pid list and the
    list of all host names. Every other rank reads only its own host's list: 1 store
    operation and O(ranks per host) bytes per rank, O(N) in all. The full list is read later,
    only where needed (hosts()); rank 0 keeps it, so it can advise on meshes at no cost. Plain
    text, no pickles; every wait is bounded by the store's timeout.
    """
    store, here, joined = world.store, _env.hostname(), world.engine.JOINED
    if world.rank == 0:
        entries = [v.decode().split(" ", 1) for v in
                   store.multi_get([f"{joined}{r}" for r in range(world.size)])]
        names = [host for _, host in entries]
        per_host: dict[str, str] = {}
        for rank, (pid, host) in enumerate(entries):
            per_host[host] = per_host.get(host, "") + f"{rank}:{pid};"
        keys = [ON_HOST.format(host=h) for h in per_host] + [HOSTS]
        store.multi_set(keys, [*per_host.values(), "\n".join(names)])
        world.hosts = _hosts_from_names(names)
        mine = per_host[here]
    else:
        mine = store.get(ON_HOST.format(host=here)).decode()  # waits for rank 0
    pairs = (item.split(":") for item in mine.split(";") if item)
    return {int(rank): int(pid) for rank, pid in pairs}


def _hosts_from_names(names):
    from ._topology import hosts_from_names

    return hosts_from_names(names)


def hosts(world: World):
    """The world's host map (a _topology.Hosts), read from the store on first use.

    A fake or 1-rank world is one host: this machine.
    """
    if world.hosts is None:
        if world.store is None or world.size == 1:
            from ._topology import Hosts

            return Hosts.blocks(world.size, 1, names=[_env.hostname()])
        world.hosts = _hosts_from_names(world.store.get(HOSTS).decode().split("\n"))
    return world.hosts


def _from_launch(launch: _env.LaunchEnv | None, field: str, var: str) -> int:
    if launch is None:
        raise ArgumentError(
            f"init_process_group: {field} not given and {var} is not set. Fix: start the job "
            f"with tensorplay-run or torchrun (they set RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT), or pass rank=... and world_size=... ."
        )
    return getattr(launch, field)


def _master_address(
    scheme: str, init_method: str, launch: _env.LaunchEnv | None
) -> tuple[str, int] | None:
    """(host, port) of the rendezvous store for env:// and tcp://; None for file://."""
    if scheme == "file":
        return None
    if scheme == "tcp":
        from urllib.parse import urlparse

        url = urlparse(init_method)
        if not url.hostname or not url.port:
            raise bad_argument(
                "init_method", init_method, "needs a host and a port", "use 'tcp://host:port'"
            )
        return url.hostname, url.port
    addr = launch.master_addr if launch else None
    port = launch.master_port if launch else None
    if addr is None or port is None:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
        raise ArgumentError(
            f"init_process_group(init_method='env://'): {' and '.join(missing)} not set. "
            f"Fix: set MASTER_ADDR to rank 0's address and MASTER_PORT to a free port "
            f"(tensorplay-run and torchrun set both), or use init_method='tcp://host:port'."
        )
    return addr, port


def current_world(what: str) -> World:
    """The joined world, or NotInitializedError naming the call that needed it."""
    if _WORLD is None:
        raise NotInitializedError(
            f"{what} needs a process group, and none is initialised in this process. "
            f"Fix: call tensorplay.distributed.init_process_group() first "
            f"(it may also have been destroyed by destroy_process_group())."
        )
    return _WORLD


def is_initialized() -> bool:
    """Whether init_process_group() has run (and destroy_process_group() has not)."""
    return _WORLD is not None


def destroy_process_group() -> None:
    """Leave the world: every group and mesh of it stops working."""
    global _WORLD
    world = current_world("destroy_process_group()")
    world.alive = False
    _WORLD = None
    for group in world.groups.values():  # meshes may outlive the world; engine groups don't
        group.release()
    world.groups.clear()
    # drop our references to the engine's objects too, so that rank 0's store server closes
    # now (meshes may keep the World alive) and a new world can listen on the same port
    world.engine_default_group = world.store = None
    world.engine.destroy()


def resolve_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    """The group a call acts on: the world's default group when None."""
    world = current_world(what)
    if group is None:
        return world.default_group
    if not isinstance(group, ProcessGroup):
        raise bad_type("group", group, "tensorplay ProcessGroup or None", "pass mesh.get_group()")
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when not a member."""
    return resolve_group(group, "get_rank()").rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    return resolve_group(group, "get_world_size()").size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """Backend name of ``group`` (default: the world)."""
    return resolve_group(group, "get_backend()").backend


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """Global ranks of ``group``'s members in group order."""
    return resolve_group(group, "get_process_group_ranks()").ranks


def new_group(
    ranks: Sequence[int] | None = None, *, backend: str | None = None, desc: str = ""
) -> ProcessGroup:
    """The group of ``ranks`` in the given order (not sorted): group rank i is ranks[i].

    Only members need to call it; a non-member gets a group whose rank() is -1. The same
    ranks and backend give the same group object (made once).
    """
    world = current_world("new_group()")
    if ranks is None:
        members = list(range(world.size))
    else:
        try:
            members = [int(r) for r in ranks]
        except (TypeError, ValueError) as err:
            raise bad_type("ranks", ranks, "a sequence of int ranks", "pass e.g. [0, 2]") from err
    if not members:
        raise bad_argument("ranks", ranks, "is empty", "pass at least one rank")
    if len(set(members)) != len(members):
        raise bad_argument("ranks", ranks, "contains duplicates", "list each rank once")
    check_ranks_in_world("ranks", members, world.size)
    if backend is not None and backend not in BACKENDS:
        raise bad_argument("backend", backend, "unknown backend", f"use one of {BACKENDS}")
    if backend is not None and (backend == "fake") != (world.backend == "fake"):
        raise bad_argument(
            "backend", backend, f"cannot mix with a {world.backend!r} world",
            f"use backend={world.backend!r}",
        )
    with named_failures(world, f"new_group(ranks={format_ranks(members)})"):
        return world.group(Ranks.of(members), backend, desc or "new_group")
