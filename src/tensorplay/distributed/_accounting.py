"""Collective accounting: every rank counts its calls on each group, and a difference is named.

A stray collective (one rank calls all_reduce once more than its peers) pairs with the peers'
next call: gloo and NCCL move the bytes and every later sum is silently wrong. Counting costs
one integer increment per call (``group.calls``, in ``collectives.py``). The counts are
compared through the store when the job ends or fails:

- ``destroy_process_group()``: each rank posts its count of every group it is in; the first
  member of each group waits a moment (``GRACE_S``) for the others' counts and raises
  CallMismatchError when they differ. A member still missing then is only logged: it may be
  slow to finish, or stuck in the stray call, which it reports itself:
- a collective that fails (a peer left while this rank still waited in it): the rank posts its
  count and compares it with those posted, so the rank that made the extra call names itself.

On the (2, 4) mesh of the main job, rank 0 calling all_reduce on "tp" once more than ranks 1-3
ends with: "rank 0 made 11 collective calls on the 'tp' group [0-3]; ranks 1-3 made 10".

An engine without a store (MPI) compares the counts at destroy_process_group() with one
all-gather over the world (``Engine.allgather_text``: each rank's counts as JSON, O(world
size) text per rank); each group's first member raises as above. After a failed collective
nothing is compared there: a stray call leaves the rank that made it waiting, and its timeout
error says what the other members wait in (the engine asks them).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import suppress
from typing import TYPE_CHECKING

from . import _arrivals, _env, _keys, _netif
from .errors import CallMismatchError, rank_words

if TYPE_CHECKING:
    from .process_group import ProcessGroup
    from .world import World

log = logging.getLogger("tensorplay.distributed")
GRACE_S = 2.0  # how long a group's first member waits for the others' counts at the end
_LARGEST = 4096  # groups larger than this are not compared (reading N counts costs O(N))


def post(world: World, groups: list[ProcessGroup]) -> None:
    """Post this rank's call count of each of ``groups`` (best effort: the store may be gone)."""
    if world.store is None:
        return
    keys = [_key(world, g, world.rank) for g in groups]
    with suppress(RuntimeError, OSError):
        world.store.multi_set(keys, [str(g.calls) for g in groups])


def check_at_end(world: World) -> None:
    """At destroy: post every count; each group's first member compares its group's counts.

    Raises CallMismatchError for the first group whose posted counts differ.
    """
    if world.simulated or world.size == 1:
        return
    mine = [g for g in world.groups() if g.is_member and g.size() > 1 and not g.retired]
    if world.store is None:
        _check_by_gather(world, mine)
        return
    post(world, mine)
    grace = min(GRACE_S, world.timeout.total_seconds())
    try:
        for group in mine:
            if group.rank() == 0 and group.size() <= _LARGEST:
                error = mismatch(world, group, wait_s=grace)
                if error is not None:
                    raise error
    finally:
        _leave(world, grace)


def _check_by_gather(world: World, mine: list[ProcessGroup]) -> None:
    """At destroy, without a store: every rank's counts all-gathered; each group's first
    member compares its group's."""
    counted = [g for g in mine if g.size() <= _LARGEST]
    step = "destroy_process_group(): comparing collective call counts"
    every = [json.loads(t) for t in world.engine.allgather_text(
        json.dumps({g.name: g.calls for g in counted}), step)]
    for group in counted:
        if group.rank() != 0:
            continue
        by_count: dict[int, list[int]] = {}
        for member in group.ranks:
            by_count.setdefault(every[member].get(group.name, 0), []).append(member)
        if len(by_count) > 1:
            raise CallMismatchError(group.label, by_count)


def _leave(world: World, grace: float) -> None:
    """Mark this rank done with the store; rank 0, whose process serves it (env://, tcp://),
    lingers until every rank is done or ``grace`` is over, so no rank's last read meets a
    closed server."""
    keys = [world.spmd.key(_keys.LEFT, rank=r) for r in world.members()]
    with suppress(RuntimeError, OSError):
        world.store.set(world.spmd.key(_keys.LEFT, rank=world.rank), "1")
        if world.rank == 0:
            deadline = time.monotonic() + grace + 1.0
            while _arrivals.unset(world.store, keys) and time.monotonic() < deadline:
                time.sleep(0.02)


def check_after_failure(world: World, group: ProcessGroup) -> CallMismatchError | None:
    """After a collective on ``group`` failed: post this rank's count and compare with those
    posted; the error naming who made more or fewer calls, or None."""
    if world.store is None or group.size() > _LARGEST or _store_gone():
        return None
    post(world, [group])
    return mismatch(world, group, wait_s=0.0)


def mismatch(world: World, group: ProcessGroup, wait_s: float) -> CallMismatchError | None:
    """Compare the members' posted counts of ``group`` (waiting up to ``wait_s`` for all)."""
    keys = [_key(world, group, r) for r in group.ranks]
    deadline = time.monotonic() + wait_s
    try:
        while True:
            unset = _arrivals.unset(world.store, keys)
            if not unset or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        present = [i for i in range(len(keys)) if i not in set(unset)]
        counts = [int(v) for v in world.store.multi_get([keys[i] for i in present])]
    except (RuntimeError, OSError):  # the store is gone: nothing to compare
        return None
    if unset:
        log.warning("collective accounting: %s had not posted their call counts on %s "
                    "within %g s; they were not compared", rank_words(
                        [group.ranks[i] for i in unset]), group.label, wait_s)
    by_count: dict[int, list[int]] = {}
    for i, count in zip(present, counts, strict=True):
        by_count.setdefault(count, []).append(group.ranks[i])
    if len(by_count) < 2:
        return None
    return CallMismatchError(group.label, by_count)


def _store_gone() -> bool:
    """Whether the job's store (at the launcher's MASTER_ADDR:MASTER_PORT) refuses
    connections: then posting to it would only make torch's client log a failed send with a
    C++ stack trace, which an expected failure must not show."""
    launch = _env.detect()
    if launch is None or not launch.master_addr or not launch.master_port:
        return False
    return _netif.refuses(launch.master_addr, launch.master_port)


def _key(world: World, group: ProcessGroup, rank: int) -> str:
    return world.spmd.key(_keys.CALLS, group=group.name, rank=rank)
