"""The job's World and its lifecycle: the torch.distributed-shaped entry points.

init_process_group() reads the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...),
starts the engine that runs the backend (found in the registry, ``backends/``) and keeps one
World per process: this rank, the world size, the engine, its store, the SPMD counters and
epoch (``_keys.Spmd``), and the registry of groups, reached through World's methods only.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from . import _accounting, _env, _keys, _progress, backends
from ._control_gather import GatherControl, SoloControl
from ._control_store import StoreControl
from ._engine import GathersText, Severable
from ._failures import collective_error, dead_on_this_host, named_failures, unless_told
from ._layout import Layout
from ._mesh_spec import Ranks
from ._registry import GroupRegistry
from ._strict import StrictOps
from .errors import (
    AlreadyInitializedError,
    BackendError,
    LaunchEnvError,
    NotInitializedError,
    bad_argument,
    bad_type,
    check_int,
    format_ranks,
    rank_words,
)
from .process_group import ProcessGroup, check_ranks_in_world, group_name

if TYPE_CHECKING:
    from ._control import Control
    from ._engine import Engine, Running, Store
    from ._topology import Hosts

log = logging.getLogger("tensorplay.distributed")
T = TypeVar("T")


@dataclass(eq=False)
class World:
    """One joined job: the context every cross-rank helper reads (rank, size, backend,
    timeout, engine, control plane, SPMD counters, this host's ranks; ``_context.JobContext``
    is that view) and the registry of the current epoch's groups (``GroupRegistry``, swapped
    whole by ``open_epoch``). Only World's methods write its fields.

    Groups are registered by (ordered ranks, backend) within the current epoch: the same
    ranks and backend give the same ProcessGroup, made once.
    """

    rank: int
    size: int
    backend: str
    timeout: timedelta
    engine: Engine
    store: Store | None
    world_group: Any = None  # the engine's group of the whole world
    spmd: _keys.Spmd = field(default_factory=_keys.Spmd)
    # rank -> pid of this host's ranks, gathered at init: naming a dead peer must not need
    # the store, which dies with rank 0 (often just after its error)
    host_pids: dict[int, int] | None = None
    # rank -> launcher instance ("1.2") of a process admitted in its place by an elastic
    # mesh: a loss of node 1's first launcher ("1.1") no longer names that rank (_losses)
    admitted_from: dict[int, str] = field(default_factory=dict)
    alive: bool = True
    adopted: bool = False  # the engine's world was started outside the package
    strict: bool = False  # check every collective's fingerprint across its group (_strict)
    default_group: ProcessGroup = field(init=False)
    control: Control = field(init=False)  # what the ranks decide together (``_control``)
    _registry: GroupRegistry = field(init=False)  # the current epoch's groups
    present: list[int] | None = None  # ranks still in the job after an epoch change (None: all)
    severed_epoch: int = -1  # the newest epoch whose groups sever_epoch broke
    # what a layer over the core keeps here (``layer``), its calls at destroy (``at_destroy``)
    # and its advice after a lost rank (``expect_losses``): the elastic layer uses all three
    _layers: dict[str, Any] = field(default_factory=dict)
    _at_destroy: list[Callable[[], None]] = field(default_factory=list)
    recovery_fix: str | None = None

    def __post_init__(self) -> None:
        self.control = control_for(self)
        self._registry = GroupRegistry(self.spmd.epoch)
        ranks = Ranks(layout=Layout((((self.size, 1),),)))
        self.default_group = self._register(ranks, self.backend, "world", self.world_group,
                                            "world")

    @property
    def simulated(self) -> bool:
        """Whether this world exists only in this process (nothing moves)."""
        return self.engine.capabilities.simulated

    def find_group(self, ranks: Ranks, backend: str | None = None) -> ProcessGroup | None:
        """The registered group of ``ranks`` on ``backend``, or None."""
        return self._registry.find((ranks.key(), backend or self.backend))

    def group(self, ranks: Ranks, backend: str | None = None, kind: str = "",
              desc: str = "", *, make: bool = True, use: str = "",
              within: timedelta | None = None) -> ProcessGroup:
        """The group of ``ranks`` on ``backend``: reused when registered, else registered now.

        Only members make the engine group: now when ``make`` (then also one registered
        earlier but not made yet), else at the group's first use (``ProcessGroup.maker``: a
        collective, ``engine_group``), by every member at that same call. A non-member gets
        a ProcessGroup with rank -1. ``kind`` names it in errors ("'dp'" gives "the 'dp'
        group [1, 5]"); ``desc`` is the engine group's description (torch's ``group_desc``:
        "mesh_dp" for a mesh dim, as torch's own meshes name theirs), else the words of
        ``kind``; ``use`` says which mesh dim asked ("'ep' of (pp, dp_replicate, efsdp, ep)"),
        listed by ``communicators()``. ``within``: made now, it must be made within that long
        (then its calls wait the world's timeout), else the world's timeout bounds it too.
        """
        backend = backend or self.backend
        key = (ranks.key(), backend)
        group = self._registry.find(key)
        if group is None or group.retired:  # retired: the old epoch's world group, kept so that
            # its use says so; a mesh dim of the same ranks in this epoch gets a group of its own
            name = group_name(ranks, backend, self.spmd.epoch)
            group = self._register(ranks, backend, name, None, kind, bound=False)
            if group.is_member:
                what = f"mesh dim {kind}" if kind.startswith("'") else (kind or "new_group")
                group.maker = functools.partial(self._make_later, group, desc or what)
        if use:
            self._registry.note_use(key, use)
        if make and group.maker is not None and not group.retired:
            self._make(group, desc or kind or "new_group", within)
        return group

    def _make(self, group: ProcessGroup, desc: str, within: timedelta | None = None) -> None:
        """Make ``group``'s engine group on this member (the others make it at the same
        point) and bind its collectives."""
        ranks, backend = group.rank_seq, group.backend
        what = desc if not desc.startswith("mesh_") else f"mesh dim {desc[5:]!r}"
        bound: dict[str, Any] = {}
        if within is not None:  # given up at the bound, or once pointless (_severed_words)
            epoch, members = self.spmd.epoch, group.ranks
            bound = {"within_s": within.total_seconds(),
                     "stopped": lambda: self._severed_words(epoch, members)}
        # bounded: made on a helper thread that is left blocked when the making is given up
        # (unless_told), so over a store connection of its own, which the recovery that
        # follows here does not queue behind (TorchEngine.new_group's ``apart``)
        engine_group = unless_told(
            lambda: f"creating the group [{format_ranks(ranks.tolist())}] ({what})", self,
            backend, lambda: self.engine.new_group(group.name, ranks, backend,
                                                   within or self.timeout, desc,
                                                   apart=within is not None), **bound)
        if within is not None and isinstance(self.engine, Severable):
            self.engine.set_timeout(engine_group, self.timeout)
        self._registry.created += 1
        group.bind(engine_group, self._ops(group, engine_group))  # clears group.maker

    def _make_later(self, group: ProcessGroup, desc: str, call: str) -> None:
        """The engine group of a group made at first use: by its members at ``call``; a
        timeout names the members that never came to it (arrival marks, as a barrier's)."""
        step = f"creating {group.label} at its first use ({call})"
        with self.control.arrivals(step, group.name, group.ranks, 0), \
                named_failures(self, step):
            self._make(group, desc)

    def adopt(self, obj: object) -> ProcessGroup | None:
        """Our group for an engine group made outside the package (torch's new_group, say);
        None when ``obj`` is not an engine group of this world's engine."""
        found = self.engine.group_members(obj)
        if found is None:
            return None
        members, backend = found
        ranks = Ranks.of(members)
        return self.find_group(ranks, backend) or self._register(
            ranks, backend, f"adopted-{group_name(ranks, backend, self.spmd.epoch)}", obj, "")

    def _register(self, ranks: Ranks, backend: str, name: str, engine_group: Any,
                  kind: str, bound: bool = True) -> ProcessGroup:
        """A new group in the registry; ``bound``: its engine group is ``engine_group``
        already (else the caller makes it)."""
        group = ProcessGroup(ranks, self.rank, backend, name, engine_group, kind=kind)
        if group.is_member and bound:
            group.bind(engine_group, self._ops(group, engine_group))
        return self._registry.add((ranks.key(), backend), group)

    def _ops(self, group: ProcessGroup, engine_group: Any) -> Any:
        """The engine's collectives of ``group`` on a member (strict mode's wrapper around
        them when on)."""
        ops = self.engine.ops(
            engine_group, group, lambda err, what: collective_error(self, err, what, group))
        return StrictOps(ops, group) if self.strict and not self.simulated else ops

    def layer(self, name: str, make: Callable[[], T]) -> T:
        """The state a layer over the core keeps in this world under ``name``, made by
        ``make()`` on first use (the elastic layer's session, one per world)."""
        if name not in self._layers:
            self._layers[name] = make()
        return self._layers[name]

    def at_destroy(self, call: Callable[[], None]) -> None:
        """Run ``call()`` at destroy_process_group(), before the call counts are compared
        (a store error in it is ignored: the job is ending)."""
        self._at_destroy.append(call)

    def expect_losses(self, fix: str) -> None:
        """A layer recovers from lost ranks here: errors naming a loss advise ``fix``, and a
        collective that lost a peer is not blamed on a stray call."""
        self.recovery_fix = fix

    def note_admitted(self, rank: int, pid: int, on_this_host: bool, instance: str) -> None:
        """``rank`` now runs as process ``pid`` started by launcher ``instance`` ("1.2"; ""
        outside a multi-node tensorplay-run): on this host the death watch looks at it, and
        a loss of another launcher instance no longer names it."""
        if instance:
            self.admitted_from[rank] = instance
        if on_this_host and self.host_pids is not None:
            self.host_pids[rank] = pid

    def members(self) -> Sequence[int]:
        """The ranks that take part in cross-rank checks: every rank (a range, O(1)), or after
        an elastic mesh changed, the ranks of its current mesh."""
        return range(self.size) if self.present is None else self.present

    def groups(self) -> list[ProcessGroup]:
        """Every group of the current epoch, the world group included."""
        return self._registry.groups()

    def uses(self, group: ProcessGroup) -> list[str]:
        """The mesh dims that asked for ``group`` in this epoch, in order ("'ep' of (pp,
        dp_replicate, efsdp, ep)"); the world group's is "the world"."""
        uses = self._registry.uses((group.rank_seq.key(), group.backend))
        return ["the world", *uses] if group is self.default_group else uses

    def group_count(self) -> int:
        """How many groups the current epoch holds, the world group included."""
        return len(self._registry.groups())

    @property
    def created(self) -> int:
        """How many groups this rank helped create in the current epoch (not the world's)."""
        return self._registry.created

    def close_epoch(self, why: str, sever: bool = False) -> list[Any]:
        """Retire every group of this epoch, the world group included (it may hold a lost
        rank), and close their engine groups; ``sever`` (after a failure) breaks their
        connections first, so a peer blocked on this rank in one of them fails at once and
        comes to the recovery too. ``why`` ends "the 'dp' group [1, 5] ..." in the
        StaleEpochError of a later use. Returns the engine groups, for ``let_go``."""
        engine = self.engine if isinstance(self.engine, Severable) else None
        return self._registry.retire(why, engine, sever, keep=self.default_group)

    def sever_epoch(self, epoch: int) -> None:
        """Break the connections of this epoch's groups if ``epoch`` is still current (from the
        elastic watcher's thread: a recovery began elsewhere and this rank may be blocked in
        a collective with a peer that will never come). Nothing to break on an engine that
        is not ``Severable`` (it makes no elastic mesh)."""
        engine = self.engine
        if not isinstance(engine, Severable):
            return
        if self.spmd.epoch == epoch:  # a group of it still being made is given up (_make)
            self.severed_epoch = max(self.severed_epoch, epoch)
        for group in self._registry.groups():
            engine_group = group.made_engine_group()  # a group not made has nothing to break
            if (self.spmd.epoch == epoch and engine_group is not None and not group.retired
                    and group is not self.default_group):
                with suppress(Exception):
                    engine.sever(engine_group)

    def _severed_words(self, epoch: int, ranks: Sequence[int]) -> tuple[str, list[int]] | None:
        """Why a group of ``epoch`` still being made within a bound is given up, or None: a
        recovery of that epoch began (``sever_epoch``), or one of its ``ranks`` died on this
        host; with the ranks that names."""
        if self.severed_epoch >= epoch:
            return f"a recovery of epoch {epoch} began elsewhere while it was being made", []
        dead = [r for r, _ in dead_on_this_host(self, 0.0) if r in ranks]
        return (f"{rank_words(dead)} died while it was being made", dead) if dead else None

    @staticmethod
    def let_go(engine_groups: list[Any]) -> None:
        """Drop the last references to closed engine groups on a daemon thread, LET_GO_S
        later. On that thread, since a gloo group's teardown joins its threads and can block
        for ever (seen once in seven runs of examples/train_elastic.py); later, since it costs
        this process 0.3-0.7 s (8 ranks on 2 cores), which at once would all but make up the
        recovery's time (0.7 s from a failure seen to the shrunk mesh, 0.06 s with the
        teardown put off). A process that ends before then never tears them down."""
        threading.Thread(target=_drop, args=(engine_groups,), daemon=True,
                         name="tensorplay let go").start()

    def open_epoch(self, epoch: int | None = None, present: Sequence[int] | None = None
                   ) -> int:
        """Start the next generation of groups and store keys (or generation ``epoch``, for
        a rank joining a running job); returns its number.

        Every rank calls it in step (SPMD). The groups of the old epoch are retired and
        closed (``close_epoch``); afterwards the counters restart, checks and barriers use
        keys under the new ``e<epoch>/``, and a group asked for again is made afresh under a
        name carrying the new epoch. ``present``: the ranks still in the job (the end-of-job
        checks wait for them only).
        """
        old = self.spmd.epoch
        self.let_go(self.close_epoch(f"belongs to epoch {old}, which the job has left"))
        epoch = self.spmd.open_epoch(epoch)
        world_key = (self.default_group.rank_seq.key(), self.backend)
        self._registry = GroupRegistry(epoch)  # the old epoch's groups are found no more
        self._registry.add(world_key, self.default_group)  # retired: its use says so
        if present is not None:
            self.present = sorted(present)
        return epoch

    def register_flatten(self, root_key: tuple, name: str, dims: tuple) -> None:
        """Remember that ``name`` flattens ``dims`` of the root mesh with ``root_key``."""
        self._registry.register_flatten(root_key, name, dims)

    def flattened_names(self, root_key: tuple) -> dict[str, tuple]:
        """Flattened dim names registered for a root mesh in the current epoch."""
        return self._registry.flattened_names(root_key)

    def native_mesh(self, mesh: Hashable, make: Callable[[], Any]) -> Any:
        """The engine's own mesh object for ``mesh`` (a DeviceMesh value), made by ``make()``
        once per world and epoch, so equal meshes get the same object (torch's DeviceMesh for
        ``mesh.to_torch()``; ``DeviceMesh.from_torch`` puts the adopted one here)."""
        return self._registry.native_mesh(mesh, make)

    def hosts(self) -> Hosts:
        """The world's host map, read on first use (a simulated or 1-rank world is one host:
        this machine)."""
        return self.control.hosts()

    def known_hosts(self) -> Hosts | None:
        """The host map if this rank holds it already (rank 0 does from init), else None."""
        return self.control.known_hosts()

    def close(self) -> None:
        """Release every group and the engine: meshes may outlive the world, engine groups
        don't. Our references to the engine's objects go too, so that rank 0's store server
        closes now and a new world can listen on the same port."""
        self.alive = False
        _progress.stop()
        self._registry.release()
        self.world_group = self.store = None
        self.control = SoloControl(self)  # drops the store's last reference: its server closes
        self.engine.destroy(self.adopted)


LET_GO_S = 10.0  # how long after an epoch ends its engine groups are torn down


def _drop(objects: list[Any]) -> None:
    time.sleep(LET_GO_S)
    objects.clear()  # the destructors run here, on this thread
    gc.collect()  # and those of engine groups caught in a reference cycle


_WORLD: World | None = None


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
    strict = _env.strict_from_env() if strict is None else strict
    progress_s = _env.progress_from_env()
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
        master = _master_address(init_method, _env.detect(), world_size)
    started = engine.start(
        backend, init_method, rank=rank, world_size=world_size, timeout=wait, master=master
    )
    _join(World(rank, world_size, backend, wait, engine, started.store,
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
    _join(World(found.rank, found.world_size, found.backend, wait, engine, started.store,
                world_group=started.world_group, adopted=True, strict=strict), progress_s)


def control_for(world: World) -> Control:
    """The control plane of ``world``: over its store, over its engine's all-gather of texts
    (MPI's control communicator), or none needed (a simulated world, or 1 rank and no store)."""
    engine = world.engine
    if engine.capabilities.simulated:
        return SoloControl(world)
    if world.store is not None:  # 1 rank too: its elastic mesh needs the store's Board
        return StoreControl(world, world.store)
    if world.size == 1:
        return SoloControl(world)
    if isinstance(engine, GathersText):
        return GatherControl(world, engine)
    raise BackendError(f"init_process_group(): the {engine.name} engine offers neither a store "
                       f"nor an all-gather of texts, so a world of {world.size} ranks has no "
                       "control plane. Fix: use backend 'gloo', 'nccl' or 'mpi'")


def _join(world: World, progress_s: float) -> None:
    """Make ``world`` this process's world and meet the other ranks' hosts (rank -> pid of
    this host's ranks, which the death watch looks at)."""
    global _WORLD
    _WORLD = world
    _progress.watch(world, progress_s)
    world.host_pids = world.control.meet_hosts("init_process_group(): exchanging host names")
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
    return backend, init_method, rank, world_size, wait


def _from_launch(launch: _env.LaunchEnv | None, field: str, var: str) -> int:
    if launch is None:
        raise LaunchEnvError(
            f"init_process_group: {field} not given and {var} is not set. Fix: start the job "
            f"with tensorplay-run or torchrun (they set RANK, WORLD_SIZE, MASTER_ADDR, "
            f"MASTER_PORT), or pass rank=... and world_size=... ."
        )
    return getattr(launch, field)


def _master_address(
    init_method: str, launch: _env.LaunchEnv | None, world_size: int
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
    for call in world._at_destroy:
        with suppress(RuntimeError, OSError):
            call()
    try:
        with named_failures(world, "destroy_process_group(): comparing collective call counts"):
            _accounting.check_at_end(world)
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
        return world.group(Ranks.of(members), backend, desc)
