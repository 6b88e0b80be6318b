"""The elastic mesh: a DeviceMesh that changes shape. ``init`` makes one (the one branch of
``init_device_mesh`` that leads here); recover (shrink after a loss), grow (admit waiting
ranks), join (a restarted rank's first mesh) each end in ``enter``: a new epoch, new groups;
``sync_replicas`` fills the ranks that joined. On an engine that shrinks its own world (MPI
under Open MPI's ULFM) recover, grow and a spawned rank's first mesh take their records from
``shrinking`` (the engine's agreement) instead of the Board; ``enter`` is the same.

recover, on every survivor after a RankFailedError (or a timeout):

1. say a recovery began (``chain.recovering``: every rank's watcher breaks its groups of
   this epoch) and close this rank's groups of the failed epoch, connections first
   (``World.close_epoch(sever=True)``): a rank blocked in one of them fails at once
   ("Connection closed by peer") and comes to the recovery too, instead of waiting out its
   timeout (a rank in a "dp" group with a survivor of the broken "tp" row would otherwise
   wait for ever);
2. ``survivors.agree_lost``: the same lost ranks on every survivor, decided once on the Board;
3. ``shrink.shrink``: the slices of the elastic dim holding a lost rank removed (below the
   minimum: ShrinkError on every survivor, and the job's end written for ranks waiting);
4. the shrunk mesh written as what follows this epoch (``chain.next_of``), then entered.

Worked example, 8 gloo ranks, (2, 4) named ("dp", "tp"), elastic "dp", rank 5 SIGKILLed:
ranks 4, 6, 7 (its "tp" row) and 1 (its "dp" pair) fail at once and close their groups; 0, 2
and 3, blocked in "dp" reductions with 4, 6, 7, fail next. All seven agree on [5]; the mesh of
epoch 1 is (1, 4) over [0, 1, 2, 3]; 4, 6 and 7 are spares (get_coordinate() is None) and wait
in ``mesh.grow()``. When rank 5's replacement waits too, the members' next grow() poll opens
epoch 2 at (2, 4) with 4-7 fresh; ``sync_replicas`` copies the state to them along "dp".
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from ..backends.protocol import StoreFailed
from ..control.consensus import agree
from ..errors import (
    ArgumentError,
    DistributedTimeoutError,
    MembersFinished,
    NotAMemberError,
    RankFailedError,
    ShrinkError,
    StaleEpochError,
    bad_argument,
    format_ranks,
    rank_words,
)
from ..geometry.roles import Roles
from ..geometry.shrink import shrink
from ..geometry.spec import MeshSpec
from ..host import knobs, wire
from ..host.wire import Recovery
from ..job import progress
from ..job.lifecycle import leave_unheard
from ..job.watch import dead_on_this_host
from ..job.world import World
from ..mesh.groups import laid_out, make_groups
from ..mesh.parts import MeshParts
from ..mesh.value import DeviceMesh, not_elastic
from . import chain, shrinking
from .chain import Elastic
from .session import Session, session_of
from .survivors import agree_lost

WAIT_S = 5.0  # a rank not seen dead that never comes to the recovery is lost after this


@dataclass(frozen=True, eq=False)
class ElasticParts(MeshParts):
    """What an elastic mesh is made of: a root mesh's parts, the plan of its epoch (elastic
    dim, minimum, full shape and ranks, epoch, fresh ranks) and this process's ``Session``
    (the watcher of the world's Board, the recoveries so far)."""

    plan: Elastic
    session: Session


class ElasticMesh(DeviceMesh):
    """A DeviceMesh whose elastic dim's slices may be lost and put back (one epoch each).

    Like every mesh a frozen value, made of ``ElasticParts`` only (``DeviceMesh.of``);
    ``recover`` and ``grow`` return the mesh of the next epoch (or this one). Its slices and
    flattened views are plain meshes of its epoch.
    """

    __slots__ = ()
    _parts: ElasticParts  # the slot DeviceMesh declares, holding ElasticParts here

    @property
    def parts(self) -> ElasticParts:
        """This epoch's parts: the mesh's, its plan and this process's session."""
        return self._parts

    @property
    def epoch(self) -> int:
        """0 at init_device_mesh, one more at each recover() or grow() that changed it."""
        return self.parts.plan.epoch

    @property
    def last_recovery(self) -> Recovery | None:
        """What the epoch change that opened this mesh cost on this rank (lost and joined
        ranks, seconds detecting, agreeing, rebuilding groups, syncing): None at epoch 0.
        See ``host/wire.py``'s ``Recovery``."""
        return self.parts.session.recovery_of(self.parts.plan.epoch)

    @property
    def recoveries(self) -> list[Recovery]:
        """Every epoch change this process went through in this world, oldest first."""
        return list(self.parts.session.recoveries)

    @property
    def fresh_ranks(self) -> list[int]:
        """The ranks that joined this elastic mesh at its epoch and hold no training state
        yet (a replacement, a spare back in its slice): ``sync_replicas`` fills them."""
        return list(self.parts.plan.fresh)

    @progress.entry("recover()")
    def recover(self, err: BaseException) -> DeviceMesh:
        """The elastic mesh without the slices of its elastic dim that held a lost rank.

        Call it on every survivor after a RankFailedError or DistributedTimeoutError caught
        in a step (``err``: what was caught; the ranks it names are suspects only). The
        survivors agree on the lost ranks on the world's Board, the same set on every one;
        the groups of the old epoch are closed; the new mesh's groups are made by its members.
        On (2, 4) ("dp", "tp") with elastic "dp", rank 5 lost: every survivor gets (1, 4) over
        [0, 1, 2, 3]; ranks 4, 6, 7 get a mesh that does not hold them (spares: they wait in
        ``grow()`` or leave). Raises ShrinkError on every survivor below ``elastic_min`` or
        without a majority, StaleEpochError on a rank the others already declared lost.
        """
        self.parts.alive("recover()")
        self.parts.session.watching("recover()")
        return recover(self, err)

    @progress.entry("grow()")
    def grow(self) -> DeviceMesh:
        """This elastic mesh, or the mesh grown back with ranks waiting to join.

        Members call it at the same point of every step (SPMD; it costs one store round
        trip): all get the same answer. When a restarted rank and the spares of its removed
        slice all wait, the mesh returns to that slice (a new epoch, new groups; the joiners
        are ``fresh_ranks``). On a spare it waits until its slice is filled again, and
        raises MembersFinished (``SystemExit(0)``: uncaught, the process ends with exit code
        0) once the members finished without it, so no loop waits on for ever.
        """
        self.parts.alive("grow()")
        self.parts.session.watching("grow()")
        return grow(self)

    def next_epoch(self, spec: MeshSpec, plan: Elastic, make: bool = True,
                   within: timedelta | None = None) -> ElasticMesh:
        """The mesh of a new epoch: ``spec``'s groups made in the current epoch (by their
        members: none outside the mesh; at first use where the mesh was made with
        eager_groups=False, or ``make`` is False; each ``within`` that long if given), this
        mesh's device, backends and roles (so ``abstract`` is the same again once the mesh
        grows back to its shape)."""
        parts = self.parts
        groups = make_groups(parts.world, spec, parts.backends, plan.own_groups and make,
                             within)
        return ElasticMesh.of(replace(parts, spec=spec, root=spec, groups=groups, plan=plan))


def init(world: World, device: str, shape: tuple[int, ...], names: tuple[str, ...] | None,
         backends: tuple[str, ...], host_aware: bool, replicas: tuple[int, int],
         given: object, roles: Roles | None = None,
         eager: tuple[bool, bool] = (True, False)) -> ElasticMesh:
    """``init_device_mesh(..., elastic=...)`` once its arguments are checked: the elastic
    mesh of epoch 0, or on a rank tensorplay-run restarted, the mesh of the epoch the members
    admit it to (its peers are far past the cross-rank check, so it skips it)."""
    refused = chain.elastic_refused(world)
    if refused is not None:
        raise bad_argument("elastic", given, *refused)
    shrinks = shrinking.engine_of(world) is not None
    spawned = shrinking.admitted(world)
    joining = spawned is not None if shrinks else wire.rank_restart_count() > 0
    if not joining:
        agree(world, "init_device_mesh()", {
            "device_type": device, "mesh_shape": shape, "mesh_dim_names": names,
            "backend_override": backends, "host_aware": host_aware, "elastic": replicas,
            "mesh_dim_roles": roles, "eager_groups": list(eager),
        })
    spec = laid_out(world, device, shape, names, host_aware)
    plan = Elastic(replicas[0], replicas[1], shape, tuple(spec.ranks().tolist()),
                   own_groups=eager[0])
    if not shrinks:
        world.engine.prepare_elastic()  # type: ignore[attr-defined]  # Severable: refused above
    session = session_of(world)
    session.shape = shape
    parts = ElasticParts(world, device, spec, spec, backends, (),
                         roles if roles is not None else (None,) * spec.ndim, eager[1],
                         plan, session)
    if spawned is not None:  # spawned into the job: the epoch its spawners opened for it
        return enter(world, ElasticMesh.of(parts), plan, spawned, kind="join")
    if joining:  # a mesh of no groups, never used: it carries the device, names, backends
        return join(world, ElasticMesh.of(parts), plan)
    return ElasticMesh.of(replace(parts, groups=make_groups(world, spec, backends, eager[0])))


def elastic_parts(mesh: DeviceMesh, what: str) -> ElasticParts:
    """The parts of an elastic mesh, or the error saying the mesh is not elastic (a plain
    mesh, a slice of an elastic one)."""
    if not isinstance(mesh, ElasticMesh):
        raise not_elastic(mesh, what)
    return mesh.parts


@progress.entry("sync_replicas()", group="group")
def sync_replicas(mesh: DeviceMesh, tensors: Sequence[Any]) -> None:
    """Bring the fresh ranks of an elastic mesh in line: each tensor broadcast along the
    elastic dim from the first member of this rank's replica group that is not fresh.

    Call it on every member after ``recover()`` or ``grow()`` returned a new mesh (and on a
    joiner after init_device_mesh), with the same tensors in the same order: torch tensors or
    numpy arrays, in place. On (2, 4) ("dp", "tp") grown back with ranks 4-7 fresh, rank 5's
    tensors come from rank 1 over the "dp" group [1, 5]; a group without a fresh rank moves
    nothing. O(state size) per fresh rank.
    """
    from ..collectives import broadcast

    parts = elastic_parts(mesh, "sync_replicas()")
    plan = parts.plan
    fresh = set(plan.fresh)
    if not fresh or mesh.get_coordinate() is None:
        return
    group = mesh.get_group(plan.dim)
    if not fresh & set(group.ranks):
        return
    sources = [r for r in group.ranks if r not in fresh]
    if not sources:
        raise ArgumentError(
            f"sync_replicas(): every member of {group.label} joined at epoch {plan.epoch}, so "
            f"none holds the training state. Fix: restore it from a checkpoint instead")
    started = time.monotonic()
    for tensor in tensors:
        broadcast(tensor, sources[0], group=group)
    parts.session.synced(plan.epoch, time.monotonic() - started)


def recover(mesh: ElasticMesh, err: BaseException, *, wait_s: float | None = None,
            timeout_s: float | None = None) -> ElasticMesh:
    """The mesh without the slices that held a lost rank (see the module docstring); a rank
    neither seen dead nor come to the recovery is lost after ``wait_s`` (WAIT_S)."""
    plan, world, spec = mesh.parts.plan, mesh.parts.world, mesh.spec
    if spec.coordinate_of(world.rank) is None:
        raise NotAMemberError(
            f"recover(): rank {world.rank} is a spare, not in the mesh of epoch {plan.epoch}. "
            f"Fix: a spare waits in mesh.grow() until its slice is filled again")
    started = time.monotonic()
    if shrinking.engine_of(world) is not None:  # the engine's own agreement, no Board
        world.close_epoch(f"was closed by the recovery after a failure in epoch {plan.epoch}")
        _let_go(err)
        return enter(world, mesh, plan, shrinking.after_loss(world, plan, spec), kind="shrink",
                     agree_s=time.monotonic() - started)
    board = chain.board_of(world)
    waited = getattr(err, "waited_s", None)
    first = chain.recovering(board, plan.epoch, world.rank, waited)
    closed = world.close_epoch(f"was closed by the recovery after a failure in epoch "
                               f"{plan.epoch}", sever=True)
    _let_go(err)  # the failed call's frames let go of its engine group; this thread keeps
    world.let_go(closed)  # the last reference, dropped on another (see World.let_go)
    suspects = getattr(err, "ranks", None) or getattr(err, "missing", None) or []
    members = spec.ranks().tolist()
    limit = world.timeout.total_seconds() if timeout_s is None else timeout_s
    try:
        lost = agree_lost(board, plan.epoch, world.rank, members, suspects,
                          wait_s=WAIT_S if wait_s is None else wait_s, timeout_s=limit,
                          dead=lambda: _seen_dead(world), alive=lambda: _seen_alive(world))
        names = spec.names
        shrunk = shrink(spec.shape, members, plan.dim, lost, minimum=plan.minimum,
                        dim_name=names[plan.dim] if names else None,
                        hosts=_hosts_of(world, tuple(lost)), alive=_seen_alive(world))
    except ShrinkError as failure:
        chain.end(board, plan.epoch, str(failure))
        raise
    decision = chain.next_of(board, plan.epoch, {
        "epoch": plan.epoch + 1, "shape": list(shrunk.shape), "ranks": list(shrunk.ranks),
        "lost": list(shrunk.lost), "spares": list(shrunk.spares)})
    return enter(world, mesh, plan, decision, kind="shrink",
                 detect_s=first if waited is None else waited,
                 agree_s=time.monotonic() - started)


def _seen_dead(world: World) -> list[int]:
    """The ranks this rank knows are gone: their process ended on this host, or the launcher
    declared their node lost (and no newer launcher of it runs them, ``wire.lost_ranks``)."""
    return ([r for r, _ in dead_on_this_host(world, 0.0)]
            + wire.lost_ranks(world.epochs.admitted_from))


def _seen_alive(world: World) -> list[int]:
    """The other ranks whose process still runs on this host: one of them declared lost came
    to the recovery late (a stall, a wait in another call), and did not die; the verdict and
    the errors say so, so that it is not taken for the rank that failed."""
    dead = {r for r, _ in dead_on_this_host(world, 0.0)}
    return [r for r in (world.epochs.host_pids or {}) if r != world.rank and r not in dead]


def _let_go(err: BaseException | None) -> None:
    """Clear the finished frames of ``err``'s tracebacks (and of its causes): they hold the
    failed call's engine group, which would otherwise live (threads, sockets, buffers) as long
    as the caller keeps ``err``, however long the job trains on."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def grow(mesh: ElasticMesh) -> DeviceMesh:
    """On a member: this mesh, or the grown mesh when waiting ranks complete a removed slice
    (decided once per call for every member). On a spare: wait until admitted; MembersFinished
    (exit code 0) once the members finished without it."""
    plan, world = mesh.parts.plan, mesh.parts.world
    if shrinking.engine_of(world) is not None:  # the engine's own agreement, no Board
        return _grow_shrinking(world, mesh, plan)
    if mesh.spec.coordinate_of(world.rank) is None:
        decision = chain.await_admission(chain.board_of(world), world.rank, token(),
                                            plan.epoch, world.timeout.total_seconds())
        return enter(world, mesh, plan, decision, kind="join")
    started = time.monotonic()
    n = world.spmd.next("elastic-poll")
    board = chain.board_of(world)
    grown = chain.poll(board, plan, n, set(mesh.spec.ranks().tolist()))
    if grown is None:
        return mesh
    decision = chain.next_of(board, plan.epoch, grown)
    return enter(world, mesh, plan, decision, kind="grow", agree_s=time.monotonic() - started)


def _grow_shrinking(world: World, mesh: ElasticMesh, plan: Elastic) -> DeviceMesh:
    """grow() on an engine that shrinks its own world (``shrinking``): a member's poll, or a
    spare's wait; the grown mesh, this one, or MembersFinished."""
    started = time.monotonic()
    if mesh.spec.coordinate_of(world.rank) is None:
        return enter(world, mesh, plan, shrinking.await_admission(world, plan), kind="join")
    grown = shrinking.poll(world, plan)
    if grown is None:
        return mesh
    return enter(world, mesh, plan, grown, kind="grow", agree_s=time.monotonic() - started)


def join(world: World, like: ElasticMesh, plan: Elastic) -> ElasticMesh:
    """A restarted rank's mesh: wait until the members admit it, then enter that epoch.
    ``like`` carries the device, names and backends (a mesh of no groups, never used)."""
    decision = chain.await_admission(chain.board_of(world), world.rank, token(), 0,
                                        world.timeout.total_seconds())
    return enter(world, like, plan, decision, kind="join")


def token() -> str:
    """How a waiting process names itself: "<pid> <host>", and under a multi-node
    tensorplay-run its launcher's "<node>.<claim>" ("977 hostB 1.2"): members learn its pid
    from it, and whether its node was lost."""
    return f"{os.getpid()} {knobs.hostname()} {wire.instance()}".strip()


def enter(world: World, mesh: ElasticMesh, plan: Elastic, decision: dict[str, Any], *,
          kind: str, detect_s: float | None = None, agree_s: float | None = None
          ) -> ElasticMesh:
    """The mesh of the epoch ``decision`` opens, with its groups made afresh; its cost
    (``kind`` of change, the seconds measured so far and the groups' making) is recorded."""
    if "end" in decision:
        raise ShrinkError(decision["end"])
    if "finished" in decision:  # a waiting rank: the members are done; so is this one
        said = (f"rank {world.rank} waited outside the elastic mesh, and {decision['finished']} "
                f"without it: it ends (exit code 0)")
        print(f"tensorplay.distributed: {said}", file=sys.stderr, flush=True)
        leave_unheard(world)
        raise MembersFinished(said, epoch=decision["epoch"])
    spec = MeshSpec.from_ranks(tuple(decision["shape"]), decision["ranks"], mesh.spec.names)
    if world.rank in decision.get("lost", ()):
        raise StaleEpochError(
            f"rank {world.rank} is still in epoch {plan.epoch}, but the others agreed it was "
            f"lost (lost: {format_ranks(decision['lost'])}) and went on to epoch "
            f"{decision['epoch']} without it; it must leave. Fix: make it reach the recovery "
            f"sooner (a rank stalled this long counts as lost)")
    world.open_epoch(decision["epoch"], present=decision["ranks"])
    session = mesh.parts.session
    session.entered(decision)
    joined = (bool(decision.get("fresh")) and world.rank in decision["ranks"]
              and shrinking.engine_of(world) is None)  # the engine's spawn: all arrived
    try:  # a fresh rank lost on the way in, or as the groups are made (each within ENTER_S)
        never = chain.enter_together(chain.board_of(world), decision, world.rank,
                                     lambda: _seen_dead(world)) if joined else []
        if never:
            raise RankFailedError(
                f"{rank_words(never).capitalize()} admitted into epoch {decision['epoch']} of "
                f"the elastic mesh {spec.shape} never arrived (died, or not there within "
                f"{chain.ENTER_S:g} s)", ranks=never)
        started = time.monotonic()
        entered = mesh.next_epoch(spec, plan.at(decision),
                             within=timedelta(seconds=chain.ENTER_S) if joined else None)
    except (RankFailedError, DistributedTimeoutError) as err:
        if not joined:
            raise
        # recover from this epoch, on its mesh without groups, before going on
        return recover(mesh.next_epoch(spec, plan.at(decision), make=False), err)
    lost = tuple(decision.get("lost", ()))
    session.record(Recovery(
        epoch=decision["epoch"], kind=kind, shape=spec.shape, lost_ranks=lost,
        lost_hosts=_hosts_of(world, lost),
        joined_ranks=tuple(decision.get("fresh", ())), detect_s=detect_s, agree_s=agree_s,
        rebuild_s=time.monotonic() - started), first=_teller(decision) == world.rank)
    return entered


def _teller(decision: dict[str, Any]) -> int:
    """The rank that sends an epoch change's cost to tensorplay-run: the new mesh's first rank
    that trained before (it saw the whole change), else its first rank."""
    fresh = set(decision.get("fresh", ()))
    return next((r for r in decision["ranks"] if r not in fresh), decision["ranks"][0])


def _hosts_of(world: World, ranks: tuple[int, ...]) -> tuple[str, ...]:
    """The host names of ``ranks`` (one store read, the first time), () when unknown."""
    if not ranks:
        return ()
    try:
        hosts = world.control.hosts()
    except StoreFailed:  # the store is gone: a record without hosts, not a failed recovery
        return ()
    return tuple(sorted({hosts(r) for r in ranks}))
