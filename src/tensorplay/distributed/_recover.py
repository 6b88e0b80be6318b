"""An elastic mesh changes shape: recover (shrink after a loss), grow (admit waiting ranks),
join (a restarted rank's first mesh). Each ends in ``enter``: a new epoch, new groups.

recover, on every survivor after a RankFailedError (or a timeout):

1. say a recovery began (``_elastic.recovering``: every rank's watcher breaks its groups of
   this epoch) and close this rank's groups of the failed epoch, connections first
   (``World.close_epoch(sever=True)``): a rank blocked in one of them fails at once
   ("Connection closed by peer") and comes to the recovery too, instead of waiting out its
   timeout (a rank in a "dp" group with a survivor of the broken "tp" row would otherwise
   wait for ever);
2. ``_survivors.agree_lost``: the same lost ranks on every survivor, decided once in the store;
3. ``_shrink.shrink``: the slices of the elastic dim holding a lost rank removed (below the
   minimum: ShrinkError on every survivor, and the job's end written for ranks waiting);
4. the shrunk mesh written as what follows this epoch (``_elastic.next_of``), then entered.

Worked example, 8 gloo ranks, (2, 4) named ("dp", "tp"), elastic "dp", rank 5 SIGKILLed:
ranks 4, 6, 7 (its "tp" row) and 1 (its "dp" pair) fail at once and close their groups; 0, 2
and 3, blocked in "dp" reductions with 4, 6, 7, fail next. All seven agree on [5]; the mesh of
epoch 1 is (1, 4) over [0, 1, 2, 3]; 4, 6 and 7 are spares (get_coordinate() is None) and wait
in ``mesh.grow()``. When rank 5's replacement waits too, the members' next grow() poll opens
epoch 2 at (2, 4) with 4-7 fresh; ``sync_replicas`` copies the state to them along "dp".
"""

from __future__ import annotations

import os
import traceback
from typing import TYPE_CHECKING, Any

from . import _elastic, _env
from ._elastic import Elastic
from ._failures import dead_on_this_host
from ._mesh_spec import MeshSpec
from ._shrink import shrink
from ._survivors import agree_lost
from .errors import NotAMemberError, ShrinkError, StaleEpochError, bad_argument, format_ranks

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh
    from .world import World

WAIT_S = 5.0  # a rank not seen dead that never comes to the recovery is lost after this


def plan_of(mesh: DeviceMesh, what: str) -> Elastic:
    """The mesh's elastic plan, or the error saying the mesh is not elastic."""
    plan = mesh._elastic
    if plan is None:
        raise bad_argument("mesh", mesh, f"is not elastic, so {what} cannot change it",
                           "make it with init_device_mesh(..., elastic='dp') (its replica "
                           "dim), and call it on that mesh, not on a slice of it")
    return plan


def recover(mesh: DeviceMesh, err: BaseException, *, wait_s: float = WAIT_S,
            timeout_s: float | None = None) -> DeviceMesh:
    """The mesh without the slices that held a lost rank (see the module docstring)."""
    plan = plan_of(mesh, "recover()")
    world, spec = mesh._world, mesh._spec
    if spec.coordinate_of(world.rank) is None:
        raise NotAMemberError(
            f"recover(): rank {world.rank} is a spare, not in the mesh of epoch {plan.epoch}. "
            f"Fix: a spare waits in mesh.grow() until its slice is filled again")
    board = _elastic.board_of(world)
    _elastic.recovering(board, plan.epoch, world.rank)
    closed = world.close_epoch(f"was closed by the recovery after a failure in epoch "
                               f"{plan.epoch}", sever=True)
    _let_go(err)  # the failed call's frames let go of its engine group; this thread keeps
    world.let_go(closed)  # the last reference, dropped on another (see World.let_go)
    suspects = getattr(err, "ranks", None) or getattr(err, "missing", None) or []
    members = spec.ranks().tolist()
    limit = world.timeout.total_seconds() if timeout_s is None else timeout_s
    try:
        lost = agree_lost(board, plan.epoch, world.rank, members, suspects,
                          wait_s=wait_s, timeout_s=limit,
                          dead=lambda: [r for r, _ in dead_on_this_host(world, 0.0)])
        names = spec.names
        shrunk = shrink(spec.shape, members, plan.dim, lost, minimum=plan.minimum,
                        dim_name=names[plan.dim] if names else None)
    except ShrinkError as failure:
        _elastic.end(board, plan.epoch, str(failure))
        raise
    decision = _elastic.next_of(board, plan.epoch, {
        "epoch": plan.epoch + 1, "shape": list(shrunk.shape), "ranks": list(shrunk.ranks),
        "lost": list(shrunk.lost), "spares": list(shrunk.spares)})
    return enter(world, mesh, plan, decision)


def _let_go(err: BaseException | None) -> None:
    """Clear the finished frames of ``err``'s tracebacks (and of its causes): they hold the
    failed call's engine group, which would otherwise live (threads, sockets, buffers) as long
    as the caller keeps ``err``, however long the job trains on."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def grow(mesh: DeviceMesh) -> DeviceMesh:
    """On a member: this mesh, or the grown mesh when waiting ranks complete a removed slice
    (decided once per call for every member). On a spare: wait until admitted, or until the
    members finished (then the last mesh, which still does not hold it)."""
    plan = plan_of(mesh, "grow()")
    world = mesh._world
    if mesh._spec.coordinate_of(world.rank) is None:
        decision = _elastic.await_admission(_elastic.board_of(world), world.rank, token(),
                                            plan.epoch, world.timeout.total_seconds())
        return enter(world, mesh, plan, decision)
    n = world.spmd.next("elastic-poll")
    board = _elastic.board_of(world)
    grown = _elastic.poll(board, plan, n, set(mesh._spec.ranks().tolist()))
    if grown is None:
        return mesh
    return enter(world, mesh, plan, _elastic.next_of(board, plan.epoch, grown))


def join(world: World, like: DeviceMesh, plan: Elastic) -> DeviceMesh:
    """A restarted rank's mesh: wait until the members admit it, then enter that epoch.
    ``like`` carries the device, names and backends (a mesh of no groups, never used)."""
    decision = _elastic.await_admission(_elastic.board_of(world), world.rank, token(), 0,
                                        world.timeout.total_seconds())
    return enter(world, like, plan, decision)


def token() -> str:
    """How a waiting process names itself: "<pid> <host>" (members learn its pid from it)."""
    return f"{os.getpid()} {_env.hostname()}"


def enter(world: World, mesh: DeviceMesh, plan: Elastic, decision: dict[str, Any]
          ) -> DeviceMesh:
    """The mesh of the epoch ``decision`` opens, with its groups made afresh."""
    if "end" in decision:
        raise ShrinkError(decision["end"])
    spec = MeshSpec.from_ranks(tuple(decision["shape"]), decision["ranks"], mesh._spec.names)
    if "finished" in decision:  # a waiting rank: the last mesh, without it; no groups
        return mesh._next(spec, plan.at(decision))
    if world.rank in decision.get("lost", ()):
        raise StaleEpochError(
            f"rank {world.rank} is still in epoch {plan.epoch}, but the others agreed it was "
            f"lost (lost: {format_ranks(decision['lost'])}) and went on to epoch "
            f"{decision['epoch']} without it; it must leave. Fix: make it reach the recovery "
            f"sooner (a rank stalled this long counts as lost)")
    world.open_epoch(decision["epoch"], present=decision["ranks"])
    world.elastic = tuple(decision["shape"])
    for rank, who in decision.get("admitted", {}).items():
        pid, _, host = who.partition(" ")
        if world.host_pids is not None and host == _env.hostname():
            world.host_pids[int(rank)] = int(pid)  # the death watch knows the new process
    return mesh._next(spec, plan.at(decision))
