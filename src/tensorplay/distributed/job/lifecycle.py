"""The job's lifecycle, shaped like torch.distributed's: ``init_process_group`` reads the
launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), starts the engine that runs the
backend (found in the registry, ``backends/``) and makes this process's one ``World``
(``job/world.py``); ``destroy_process_group`` ends it; ``current_world`` is how every other
module finds it. ``tensorplay.distributed.world`` is the public door to these functions.

Worked example: under ``tensorplay-run --nproc-per-node 8``, rank 5's ``init_process_group()``
reads RANK=5, WORLD_SIZE=8 and MASTER_ADDR/PORT, starts the gloo engine, and
``get_rank()``/``get_world_size()`` answer 5 and 8 until ``destroy_process_group()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from .. import backends
from ..control import accounting
from ..errors import (
    AlreadyInitializedError,
    LaunchEnvError,
    NotInitializedError,
    bad_argument,
    bad_type,
    check_int,
    format_ranks,
)
from ..geometry.spec import Ranks
from ..host import knobs, launchers
from ..process_group import ProcessGroup, check_ranks_in_world
from . import progress
from .failures import named_failures
from .world import GroupName, World

if TYPE_CHECKING:
    from ..backends.protocol import Engine, Running

log = logging.getLogger("tensorplay.distributed")


_WORLD: World | None = None


def to_timedelta(timeout: object, name: str = "timeout") -> timedelta:
    """Normalise a timeout given as timedelta or seconds; None reads TENSORPLAY_TIMEOUT."""
    if timeout is None:
        seconds = knobs.timeout_from_env()
        return timedelta(seconds=knobs.DEFAULT_TIMEOUT_S if seconds is None else seconds)
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise bad_type(name, timeout, "datetime.timedelta or seconds", "pass e.g. timeout=60")
    if not seconds > 0:
        raise bad_argument(name, timeout, "must be positive", "pass e.g. timeout=60")
    return timedelta(seconds=seconds)


@progress.entry("init_process_group()")
def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    timeout: timedelta | float | None = None,
    strict: bool | None = None,
) -> None:
    """Join the job: every rank calls it once before any mesh or collective.

    backend: "gloo" (CPU), "nccl" (GPU), "mpi" (MPI through mpi4py; numpy, no torch) or
    "fake" (a simulated world in this process); default "mpi" under mpiexec or mpirun without
    MASTER_ADDR, else nccl when CUDA is usable, else gloo. init_method: "env://" (default; RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT as tensorplay-run, torchrun, SLURM or mpirun set
    them), "tcp://host:port" or "file:///path". timeout bounds every wait (default 300 s or
    TENSORPLAY_TIMEOUT). strict=True (or TENSORPLAY_STRICT=1) checks, before each
    collective, that every member of its group makes the same call (one small all-gather per
    call; see bench/README.md).
    """
    global _WORLD
    if _WORLD is not None:
        raise AlreadyInitializedError(
            "init_process_group: this process already joined a world "
            f"(rank {_WORLD.rank} of {_WORLD.size}). Fix: call destroy_process_group() first."
        )
    if strict is not None and not isinstance(strict, bool):
        raise bad_type("strict", strict, "bool", "pass strict=True or leave it out")
    strict = knobs.strict_from_env() if strict is None else strict
    progress_s = knobs.progress_from_env()
    running = backends.running_world()
    if running is not None and (  # torch.distributed started by Lightning, accelerate, ...
            backend is None or backends.engine_name(str(backend).lower()) == running[0].name):
        _adopt(*running, backend, timeout, strict, progress_s)
        return
    backend, init_method, rank, world_size, wait = _canonical_args(
        backend, init_method, rank, world_size, timeout)
    engine = backends.engine_for(backend)
    master = None
    if engine.capabilities.has_store:  # a store needs an address to meet at
        master = _master_address(init_method, launchers.detect(), world_size)
    started = engine.start(
        backend, init_method, rank=rank, world_size=world_size, timeout=wait, master=master
    )
    if started.rank is not None and started.size is not None:  # a replacement the engine spawned
        rank, world_size = started.rank, started.size
    _join(World(rank, world_size, backend, wait, started.engine, started.store,
                world_group=started.world_group, strict=strict), progress_s)


def _adopt(engine: Engine, found: Running, backend: object, timeout: object,
           strict: bool, progress_s: float) -> None:
    """Join the world an engine already runs (same ranks, its store, its world group)."""
    if backend is not None and backend != found.backend:
        raise bad_argument("backend", backend, f"differs from the {found.backend!r} world "
                           "already started", f"pass backend={found.backend!r} or none")
    wait = to_timedelta(timeout)
    started = engine.adopt(wait)
    log.info("adopted the %s world already started: rank %d of %d", found.backend,
             found.rank, found.world_size)
    _join(World(found.rank, found.world_size, found.backend, wait, started.engine,
                started.store, world_group=started.world_group, strict=strict), progress_s)


def _join(world: World, progress_s: float) -> None:
    """Make ``world`` this process's world and meet the other ranks' hosts (rank -> pid of
    this host's ranks, which the death watch looks at)."""
    global _WORLD
    _WORLD = world
    progress.watch(world, progress_s)
    world.meet_hosts("init_process_group(): exchanging host names")
    log.debug("joined world: rank %d of %d, backend %s", world.rank, world.size,
              world.backend)


def _canonical_args(
    backend: object, init_method: object, rank: object, world_size: object, timeout: object
) -> tuple[str, str, int, int, timedelta]:
    """init_process_group's arguments checked, with rank and size read from the launcher."""
    if backend is not None and not isinstance(backend, str):
        raise bad_type("backend", backend, "str", f"use one of {backends.BACKENDS}")
    if init_method is not None and not isinstance(init_method, str):
        raise bad_type("init_method", init_method, "str", "use 'env://' or 'tcp://host:port'")
    world_size = check_int("world_size", world_size, "pass the number of processes")
    rank = check_int("rank", rank, "pass this process's rank")
    wait = to_timedelta(timeout)
    backend = (backend or backends.default_backend()).lower()
    if backends.engine_name(backend) is None:
        raise bad_argument("backend", backend, "unknown backend",
                           f"use one of {backends.BACKENDS}")
    init_method = init_method or "env://"
    scheme = init_method.split("://", 1)[0] if "://" in init_method else ""
    if scheme not in ("env", "tcp", "file"):
        raise bad_argument(
            "init_method", init_method, "unknown scheme",
            "use 'env://', 'tcp://host:port' or 'file:///shared/path'",
        )
    if rank < 0 or world_size < 0:
        launch = launchers.detect()
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
    return backend, init_method, rank, world_size, wait


def _from_launch(launch: launchers.LaunchEnv | None, field: str, var: str) -> int:
    if launch is None:
        raise LaunchEnvError(
            f"init_process_group: {field} not given and {var} is not set. Fix: start the job "
            f"with tensorplay-run or torchrun (they set RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT), or pass rank=... and world_size=... ."
        )
    return getattr(launch, field)


def _master_address(
    init_method: str, launch: launchers.LaunchEnv | None, world_size: int
) -> tuple[str, int] | None:
    """(host, port) of the rendezvous store for env:// and tcp://; None for file://, and for
    a world of one rank that was given no address (it has nobody to meet)."""
    if init_method.startswith("file://"):
        return None
    if init_method.startswith("tcp://"):
        from urllib.parse import urlparse

        url = urlparse(init_method)
        if not url.hostname or not url.port:
            raise bad_argument(
                "init_method", init_method, "needs a host and a port", "use 'tcp://host:port'"
            )
        return url.hostname, url.port
    addr = launch.master_addr if launch else None
    port = launch.master_port if launch else None
    if addr is None and port is None and world_size == 1:
        return None
    if addr is None or port is None:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
        raise LaunchEnvError(
            f"init_process_group(init_method='env://'): {' and '.join(missing)} not set. "
            f"Fix: set MASTER_ADDR to rank 0's address and MASTER_PORT to a free port "
            f"(tensorplay-run and torchrun set both), or use init_method='tcp://host:port'."
        )
    return addr, port


def current_or_adopted_world(what: str) -> World:
    """The joined world; when there is none but an engine's world was started outside the
    package (``torch.distributed.init_process_group``), that world, adopted now."""
    if _WORLD is None and backends.running_world() is not None:
        init_process_group()
    return current_world(what)


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


@progress.entry("destroy_process_group()")
def destroy_process_group() -> None:
    """Leave the world: every group and mesh of it stops working. A rank outside the job's
    current members (a spare of an elastic mesh that chose to leave) leaves as
    ``leave_unheard`` does: nobody compares its counts, and the store it would post them to
    may be gone with rank 0 (env:// and tcp://), which finished without it."""
    global _WORLD
    world = current_world("destroy_process_group()")
    if world.rank not in world.members():
        leave_unheard(world)
        return
    _WORLD = None
    for call in world.epochs.calls_at_destroy():
        call()  # each hook leaves out what a store gone cannot take (Session.finish)
    try:
        with named_failures(world, "destroy_process_group(): comparing collective call counts"):
            accounting.check_at_end(world)
    finally:
        world.close()


def leave_unheard(world: World) -> None:
    """Leave ``world`` as destroy_process_group does, but without comparing call counts: for
    a rank the others finished without (a spare of an elastic mesh), whose calls nobody waits
    for. Its engine groups are destroyed now, not by the interpreter's exit, where gloo's
    threads still running abort the process ("terminate called without an active exception")."""
    global _WORLD
    if _WORLD is world:
        _WORLD = None
    world.close()


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


@progress.entry("new_group()")
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
    if backend is not None:
        engine = backends.engine_name(backend)
        if engine is None:
            raise bad_argument("backend", backend, "unknown backend",
                               f"use one of {backends.BACKENDS}")
        if engine != world.engine.name:
            raise bad_argument(
                "backend", backend, f"cannot mix with a {world.backend!r} world",
                f"use backend={world.backend!r}",
            )
    with named_failures(world, f"new_group(ranks={format_ranks(members)})"):
        return world.group(Ranks.of(members), backend, GroupName(kind=desc))
