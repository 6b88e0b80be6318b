"""One joined job: ``World``, the object every cross-rank helper reads (through
``job/context.py``'s view) and the only writer of its own fields.

A World holds this rank, the world size, the engine and its store, the SPMD counters and epoch
(``control/keys.py``'s ``Spmd``), the control plane (``control_for``) and the registry of the
current epoch's groups. The torch-shaped lifecycle that makes and ends one
(``init_process_group``, ``destroy_process_group``) is ``job/lifecycle.py``.

Worked example, rank 5 of a (2, 4) gloo world: ``World(rank=5, size=8, backend="gloo", ...)``;
``world.group(Ranks([4, 5, 6, 7]))`` makes the "tp" group once, and a second call with the same
ranks and backend returns the same ProcessGroup.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.protocol import GathersText, Severable
from ..control import keys
from ..control.gather import GatherControl, SoloControl
from ..control.store import StoreControl
from ..control.strict import StrictOps
from ..errors import (
    BackendError,
    format_ranks,
    rank_words,
)
from ..geometry.layout import Layout
from ..geometry.spec import Ranks
from ..process_group import ProcessGroup, group_name
from . import progress
from .failures import collective_error, named_failures
from .registry import GroupRegistry
from .watch import dead_on_this_host, unless_told

if TYPE_CHECKING:
    from ..backends.protocol import Engine, Store
    from ..control.plane import Control
    from ..geometry.topology import Hosts

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
    spmd: keys.Spmd = field(default_factory=keys.Spmd)
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

    def meet_hosts(self, what: str) -> None:
        """Learn rank -> pid of this host's ranks from the others (``Control.meet_hosts``),
        which the death watch looks at: on a (2, 4) world over two hosts, rank 5 keeps
        {4: pid, 5: pid, 6: pid, 7: pid}."""
        self.host_pids = self.control.meet_hosts(what)

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
        engine_group = unless_told(
            lambda: f"creating the group [{format_ranks(ranks.tolist())}] ({what})", self,
            backend, lambda: self.engine.new_group(group.name, ranks, backend,
                                                   within or self.timeout, desc), **bound)
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
        self._registry.sever(epoch, engine, keep=self.default_group)

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
        progress.stop()
        self._registry.release()
        self.world_group = self.store = None
        self.control = SoloControl(self)  # drops the store's last reference: its server closes
        self.engine.destroy(self.adopted)


LET_GO_S = 10.0  # how long after an epoch ends its engine groups are torn down


def _drop(objects: list[Any]) -> None:
    time.sleep(LET_GO_S)
    objects.clear()  # the destructors run here, on this thread
    gc.collect()  # and those of engine groups caught in a reference cycle


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
