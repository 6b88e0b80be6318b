"""The elastic mesh on an engine that shrinks its own world (``protocol.Shrinks``: MPI under
Open MPI's ULFM): the decisions that the chain of epochs makes on a Board elsewhere
(``chain.py``), made here by the engine's agreement, with no store. Each returns the record
``elastic.mesh.enter`` opens an epoch from, the same on every rank that reads it.

- a recovery: the engine's ``shrink`` (every communicator of the world revoked, so a rank
  blocked in any of them fails and comes to the recovery; ULFM's ``Shrink``: the same
  survivors on every one) gives the lost ranks; ``geometry.shrink`` removes their slices;
- a grow poll: one reduction over every rank present (members, and spares waiting in
  ``grow()``); from the second poll of an epoch on (the first step after a loss trains at once,
  on the shrunk mesh), when ranks are missing from the world the present ranks spawn them
  (``Shrinks.spawn``, which hands each the record), and the mesh grows back to full size;
- the members' end (destroy_process_group): a last poll that tells the spares waiting in
  ``grow()`` to leave (MembersFinished), then the two part (``Shrinks.part``), so that the
  members' end-of-job checks and exit meeting are theirs alone; a spare also leaves when a
  member's script ends.

Worked example, 8 ranks, (2, 4) ("dp", "tp"), elastic "dp", rank 5 SIGKILLed: the seven
survivors' ``shrink`` returns [5]; epoch 1 is (1, 4) over [0, 1, 2, 3]; 4, 6, 7 are spares in
``grow()``. The members train a step on (1, 4); at their next ``grow()`` the poll finds 1 of 8
ranks missing: the seven spawn one process, rank 5 again, and epoch 2 is (2, 4) with 4-7 fresh.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..backends.protocol import Shrinks
from ..geometry.shrink import grow, shrink

if TYPE_CHECKING:
    from ..geometry.spec import MeshSpec
    from ..job.world import World
    from .chain import Elastic

# what a rank brings to a grow poll (the largest wins): a spare waits; the members hold (their
# first poll of an epoch), or poll (grow if ranks are missing), or have finished
_WAITING, _HOLD, _POLL, _FINISHED = 0, 1, 2, 3


def engine_of(world: World) -> Shrinks | None:
    """The world's engine when it shrinks its own world, else None."""
    engine = world.engine
    return engine if isinstance(engine, Shrinks) else None


def _engine(world: World) -> Shrinks:
    engine = engine_of(world)
    assert engine is not None, "shrinking.* called on a world whose engine does not shrink"
    return engine


def after_loss(world: World, plan: Elastic, spec: MeshSpec) -> dict[str, Any]:
    """The record of the epoch after a loss: the engine's shrink names the lost ranks, the
    geometry removes their slices (ShrinkError below the minimum, on every survivor)."""
    step = f"recover(): the survivors of epoch {plan.epoch} agreeing on who is left"
    lost = _engine(world).shrink(step)
    names = spec.names
    shrunk = shrink(spec.shape, spec.ranks().tolist(), plan.dim, lost, minimum=plan.minimum,
                    dim_name=names[plan.dim] if names else None)
    return {"epoch": plan.epoch + 1, "shape": list(shrunk.shape), "ranks": list(shrunk.ranks),
            "lost": list(shrunk.lost), "spares": list(shrunk.spares)}


def poll(world: World, plan: Elastic) -> dict[str, Any] | None:
    """A member's grow poll: the record of the grown epoch (ranks missing from the world were
    spawned), or None when nothing is missing."""
    engine = _engine(world)
    first = world.spmd.next("elastic-poll") == 1  # the same on every member (SPMD)
    engine.poll(_HOLD if first else _POLL, f"grow(): the grow poll of epoch {plan.epoch}")
    return None if first else _grown(world, engine, plan)


def await_admission(world: World, plan: Elastic) -> dict[str, Any]:
    """A spare's wait in grow(): the record of the epoch that takes it back, or the members'
    end (``finished``: the spare leaves)."""
    engine = _engine(world)
    while True:
        said = engine.poll(_WAITING, f"grow(): rank {world.rank} waiting to rejoin the mesh")
        if said is None:
            return _finished(plan, "ended their script")
        if said == _FINISHED:  # the members' last poll: part from them, as they do
            engine.part(world.members(), f"grow(): rank {world.rank} leaving the members")
            return _finished(plan, "finished")
        if said == _HOLD:
            continue
        grown = _grown(world, engine, plan)
        if grown is not None:
            return grown


def _grown(world: World, engine: Shrinks, plan: Elastic) -> dict[str, Any] | None:
    """When job ranks are missing from the world: spawn them (collective over the ranks
    present), every rank learning the others' hosts again; the grown epoch's record."""
    present = set(engine.present())
    missing = [r for r in plan.full_ranks if r not in present]
    if not missing:
        return None
    shape, ranks = grow(plan.full_shape, plan.full_ranks, plan.dim, present | set(missing))
    members = set(world.members())
    decision = {"epoch": plan.epoch + 1, "shape": list(shape), "ranks": list(ranks),
                "fresh": sorted(r for r in ranks if r not in members)}
    engine.spawn(missing, json.dumps(decision), f"grow(): spawning {len(missing)} "
                 f"replacement{'s' if len(missing) > 1 else ''} at epoch {plan.epoch}")
    world.meet_hosts(f"grow(): meeting the ranks spawned at epoch {plan.epoch}")
    return decision


def admitted(world: World) -> dict[str, Any] | None:
    """On a rank the engine spawned into the job: the record of the epoch it joins."""
    engine = engine_of(world)
    note = engine.spawned_note() if engine is not None else None
    return None if note is None else json.loads(note)


def finish(world: World, epoch: int) -> None:
    """At destroy_process_group() on a member: the last poll, which tells the spares waiting in
    grow() that the members finished (only where some rank present is not a member)."""
    engine = _engine(world)
    if set(engine.present()) - set(world.members()):
        step = f"destroy_process_group(): the members' end of epoch {epoch}"
        engine.poll(_FINISHED, step)
        engine.part(world.members(), step)  # the end-of-job checks: the members only


def _finished(plan: Elastic, how: str) -> dict[str, Any]:
    return {"finished": f"the members {how} at epoch {plan.epoch}", "epoch": plan.epoch}
