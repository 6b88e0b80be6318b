"""One joined job: ``World``, the object every cross-rank helper reads (through
``job/context.py``'s view) and the only writer of its own fields.

A World holds this rank, the world size, the backend, the timeout, the engine (the one this
world runs: ``Started.engine``) and its store, the SPMD counters and epoch (``control/keys.py``'s
``Spmd``), the control plane (``control_for``), the registry of the current epoch's groups
(``registry``: others find groups, their uses and flattened names and the engine's meshes
there) and what the world learned as ranks came and went (``epochs``, ``job/epochs.py``). It
makes groups (``group``, now or at first use) and ends epochs (``close_epoch``,
``sever_epoch``, ``open_epoch``). The torch-shaped lifecycle that makes and ends one
(``init_process_group``, ``destroy_process_group``) is ``job/lifecycle.py``.

Worked example, rank 5 of a (2, 4) gloo world: ``World(rank=5, size=8, backend="gloo", ...)``;
``world.group(Ranks.of([4, 5, 6, 7]), name=GroupName("'tp'", "mesh_tp"))`` makes the "tp"
group once (torch's ``group_desc`` "mesh_tp"; its errors say "the 'tp' group [4-7]"), and a
second call with the same ranks and backend returns the same ProcessGroup:
``world.registry.find(Ranks.of([4, 5, 6, 7]), "gloo")``.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

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
from .epochs import Epochs
from .failures import collective_error, named_failures
from .registry import GroupRegistry
from .watch import dead_on_this_host, unless_told

if TYPE_CHECKING:
    from ..backends.protocol import Joined, Store
    from ..control.plane import Control

log = logging.getLogger("tensorplay.distributed")


@dataclass(frozen=True)
class GroupName:
    """How the caller of ``World.group`` names the group it asks for, in three words:
    ``kind`` in errors, ``desc`` to the engine (torch's ``group_desc``, as torch's own meshes
    name theirs) and ``use``, the mesh dim that asked (listed by ``communicators()``).

    ``GroupName("'dp'", "mesh_dp", "'dp' of (dp, tp)")`` on rank 5 of a (2, 4) mesh: errors
    say "the 'dp' group [1, 5]" and "creating the group [1, 5] (mesh dim 'dp')", torch's
    group_desc is "mesh_dp", and describe() lists "'dp' of (dp, tp)" beside [1, 5].
    ``GroupName()``, a ``new_group`` without a description: "creating the group [1, 3]
    (new_group)"."""

    kind: str = ""
    desc: str = ""
    use: str = ""

    @property
    def words(self) -> str:
        """The group in a step of an error: "mesh dim 'dp'" for a mesh dim (desc "mesh_dp",
        or kind "'dp'"), else its description or kind, else "new_group"."""
        if self.desc.startswith("mesh_"):
            return f"mesh dim {self.desc[5:]!r}"
        if self.kind.startswith("'"):
            return f"mesh dim {self.kind}"
        return self.desc or self.kind or "new_group"

    @property
    def engine_desc(self) -> str:
        """What the engine group is described as: ``desc``, else ``words``."""
        return self.desc or self.words


NEW_GROUP = GroupName()  # a new_group() without a description: "new_group" in errors


@dataclass(eq=False)
class World:
    """One joined job: the context every cross-rank helper reads (rank, size, backend,
    timeout, engine, control plane, SPMD counters; ``job/context.py``'s ``JobContext`` is
    that view), the current epoch's groups (``registry``, swapped whole by ``open_epoch``)
    and what the world learned as ranks came and went (``epochs``). Only World's methods
    assign its fields; the others read them and call their objects' methods.

    Groups are registered by (ordered ranks, backend) within the current epoch: the same
    ranks and backend give the same ProcessGroup, made once.
    """

    rank: int
    size: int
    backend: str
    timeout: timedelta  # the bound of every wait of this world, owned here: the engine is
    # given it at start (and each group as it is made), and keeps no other
    engine: Joined  # the engine as this world runs it (``Started.engine``)
    store: Store | None
    world_group: InitVar[Any] = None  # the engine's group of the whole world
    spmd: keys.Spmd = field(default_factory=keys.Spmd)
    host_pids: InitVar[dict[int, int] | None] = None  # this host's ranks, if known already
    strict: bool = False  # check each collective across its group (control/strict.py)
    default_group: ProcessGroup = field(init=False)
    control: Control = field(init=False)  # what the ranks decide together (``control/``)
    registry: GroupRegistry = field(init=False)  # the current epoch's groups
    epochs: Epochs = field(init=False)  # who takes part, admitted, severed; layers' state

    def __post_init__(self, world_group: Any, host_pids: dict[int, int] | None) -> None:
        self.epochs = Epochs(host_pids)
        self.control = control_for(self)
        self.registry = GroupRegistry(self.spmd.epoch)
        ranks = Ranks(layout=Layout((((self.size, 1),),)))
        self.default_group = self._register(ranks, self.backend, "world", world_group, "world")
        self.registry.note_use(self.default_group, "the world")

    @property
    def alive(self) -> bool:
        """Whether the world still runs (``close`` has not released it)."""
        return not self.registry.released

    def meet_hosts(self, what: str) -> None:
        """Learn rank -> pid of this host's ranks from the others (``Control.meet_hosts``),
        which the death watch looks at: on a (2, 4) world over two hosts, rank 5 keeps
        {4: pid, 5: pid, 6: pid, 7: pid}."""
        self.epochs.host_pids = self.control.meet_hosts(what)

    def group(self, ranks: Ranks, backend: str | None = None, name: GroupName = NEW_GROUP,
              *, make: bool = True, within: timedelta | None = None) -> ProcessGroup:
        """The group of ``ranks`` on ``backend``: reused when registered, else registered now.

        Only members make the engine group: now when ``make`` (then also one registered
        earlier but not made yet), else at the group's first use (``ProcessGroup.maker``: a
        collective, ``engine_group``), by every member at that same call. A non-member gets
        a ProcessGroup with rank -1. ``name`` says how errors, the engine and ``describe()``
        name it (``GroupName``). ``within``: made now, it must be made within that long
        (then its calls wait the world's timeout), else the world's timeout bounds it too.
        """
        backend = backend or self.backend
        group = self.registry.find(ranks, backend)
        if group is None or group.retired:  # retired: the old epoch's world group, kept so that
            # its use says so; a mesh dim of the same ranks in this epoch gets a group of its own
            label = group_name(ranks, backend, self.spmd.epoch)
            group = self._register(ranks, backend, label, None, name.kind, bound=False)
            if group.is_member:
                group.maker = functools.partial(self._make_later, group, name)
        if name.use:
            self.registry.note_use(group, name.use)
        if make and group.maker is not None and not group.retired:
            self._make(group, name, within)
        return group

    def _make(self, group: ProcessGroup, name: GroupName, within: timedelta | None = None
              ) -> None:
        """Make ``group``'s engine group on this member (the others make it at the same
        point) and bind its collectives."""
        ranks, backend = group.rank_seq, group.backend
        bound: dict[str, Any] = {}
        if within is not None:  # given up at the bound, or once pointless (_severed_words)
            epoch, members = self.spmd.epoch, group.ranks
            bound = {"within_s": within.total_seconds(),
                     "stopped": lambda: self._severed_words(epoch, members)}
        # bounded: made on a helper thread that is left blocked when the making is given up
        # (unless_told), so over a store connection of its own, which the recovery that
        # follows here does not queue behind (TorchWorld.new_group's ``apart``)
        engine_group = unless_told(
            lambda: f"creating the group [{format_ranks(ranks.tolist())}] ({name.words})",
            self, backend, lambda: self.engine.new_group(group.name, ranks, backend,
                                                         within or self.timeout,
                                                         name.engine_desc,
                                                         apart=within is not None), **bound)
        if within is not None and isinstance(self.engine, Severable):
            self.engine.set_timeout(engine_group, self.timeout)
        self.registry.created += 1
        group.bind(engine_group, self._ops(group, engine_group))  # clears group.maker

    def _make_later(self, group: ProcessGroup, name: GroupName, call: str) -> None:
        """The engine group of a group made at first use: by its members at ``call``; a
        timeout names the members that never came to it (arrival marks, as a barrier's)."""
        step = f"creating {group.label} at its first use ({call})"
        with self.control.arrivals(step, group.name, group.ranks, 0), \
                named_failures(self, step):
            self._make(group, name)

    def adopt(self, obj: object) -> ProcessGroup | None:
        """Our group for an engine group made outside the package (torch's new_group, say);
        None when ``obj`` is not an engine group of this world's engine."""
        found = self.engine.group_members(obj)
        if found is None:
            return None
        members, backend = found
        ranks = Ranks.of(members)
        return self.registry.find(ranks, backend) or self._register(
            ranks, backend, f"adopted-{group_name(ranks, backend, self.spmd.epoch)}", obj, "")

    def _register(self, ranks: Ranks, backend: str, name: str, engine_group: Any,
                  kind: str, bound: bool = True) -> ProcessGroup:
        """A new group in the registry; ``bound``: its engine group is ``engine_group``
        already (else the caller makes it)."""
        group = ProcessGroup(ranks, self.rank, backend, name, engine_group, kind=kind)
        if group.is_member and bound:
            group.bind(engine_group, self._ops(group, engine_group))
        return self.registry.add(group)

    def _ops(self, group: ProcessGroup, engine_group: Any) -> Any:
        """The engine's collectives of ``group`` on a member (strict mode's wrapper around
        them when on; a simulated world has nothing to compare)."""
        ops = self.engine.ops(
            engine_group, group, lambda err, what: collective_error(self, err, what, group))
        strict = self.strict and not self.engine.capabilities.simulated
        return StrictOps(ops, group) if strict else ops

    def members(self) -> Sequence[int]:
        """The ranks that take part in cross-rank checks: every rank (a range, O(1)), or after
        an elastic mesh changed, the ranks of its current mesh."""
        present = self.epochs.present
        return range(self.size) if present is None else present

    def close_epoch(self, why: str, sever: bool = False) -> list[Any]:
        """Retire every group of this epoch, the world group included (it may hold a lost
        rank), and close their engine groups; ``sever`` (after a failure) breaks their
        connections first, so a peer blocked on this rank in one of them fails at once and
        comes to the recovery too. ``why`` ends "the 'dp' group [1, 5] ..." in the
        StaleEpochError of a later use. Returns the engine groups, for ``let_go``."""
        engine = self.engine if isinstance(self.engine, Severable) else None
        return self.registry.retire(why, engine, sever, keep=self.default_group)

    def sever_epoch(self, epoch: int) -> None:
        """Break the connections of this epoch's groups if ``epoch`` is still current (from the
        elastic watcher's thread: a recovery began elsewhere and this rank may be blocked in
        a collective with a peer that will never come). Nothing to break on an engine that
        is not ``Severable`` (it makes no elastic mesh)."""
        engine = self.engine
        if not isinstance(engine, Severable):
            return
        if self.spmd.epoch == epoch:  # a group of it still being made is given up (_make)
            self.epochs.severed = max(self.epochs.severed, epoch)
        self.registry.sever(epoch, engine, keep=self.default_group)

    def _severed_words(self, epoch: int, ranks: Sequence[int]) -> tuple[str, list[int]] | None:
        """Why a group of ``epoch`` still being made within a bound is given up, or None: a
        recovery of that epoch began (``sever_epoch``), or one of its ``ranks`` died on this
        host; with the ranks that names."""
        if self.epochs.severed >= epoch:
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
        self.registry = GroupRegistry(epoch)  # the old epoch's groups are found no more
        self.registry.add(self.default_group)  # retired: its use says so
        if present is not None:
            self.epochs.present = sorted(present)
        return epoch

    def close(self) -> None:
        """Release every group and the engine: meshes may outlive the world, engine groups
        don't. Our references to the engine's objects go too, so that rank 0's store server
        closes now and a new world can listen on the same port."""
        self.registry.release()  # not alive from here
        progress.stop()
        self.store = None
        self.control = SoloControl(self)  # drops the store's last reference: its server closes
        self.engine.destroy()


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
