"""Collective accounting: every rank counts its calls on each group, and a difference is named.

A stray collective (one rank calls all_reduce once more than its peers) pairs with the peers'
next call: gloo and NCCL move the bytes and every later sum is silently wrong. Counting costs
one integer increment per call (``group.calls``, in ``collectives.py``). The counts are
compared over the world's control plane (``control/plane.py``) when the job ends or fails:

- ``destroy_process_group()``: each rank first hands its final counts to the control plane
  (``Control.ending``; over an engine's all-gather, whose blocked calls cannot fail, a member
  stuck in the stray call learns them at once and names it); then it posts its counts of
  every group it is in, as JSON ({group name: calls}), in one ``Control.exchange``; the first
  member of each group reads its members' counts, waiting a moment (``GRACE_S``) for them,
  and raises CallMismatchError when they differ. A member still missing then is only logged
  (one line for all such groups): it may be slow to finish, or stuck in the stray call, which
  it reports itself:
- a collective that fails (a peer left while this rank still waited in it): on a control plane
  that is a ``Board`` (a store, which any rank may read at any time), the rank posts its count
  of that group and compares it with those posted (at their end, or after the same failure),
  so the rank that made the extra call names itself.

On the (2, 4) mesh of the main job, rank 0 calling all_reduce on "tp" once more than ranks 1-3
ends with: "rank 0 made 11 collective calls on the 'tp' group [0-3]; ranks 1-3 made 10".
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..backends.protocol import StoreFailed
from ..errors import CallMismatchError, rank_words
from ..host import wire
from . import keys
from .plane import Board

if TYPE_CHECKING:
    from ..job.context import JobContext
    from ..process_group import ProcessGroup

log = logging.getLogger("tensorplay.distributed")
GRACE_S = 2.0  # how long a group's first member waits for the others' counts at the end
_LARGEST = 4096  # groups larger than this are not compared (reading N counts costs O(N))
EXCHANGE = "calls"  # the name of the counts' exchange (``keys.EXCHANGE``)


def _counts(groups: list[ProcessGroup]) -> str:
    return json.dumps({g.name: g.calls for g in groups})


def _mine(world: JobContext) -> list[ProcessGroup]:
    return [g for g in world.registry.groups() if g.is_member and g.size() > 1 and not g.retired]


def check_at_end(world: JobContext) -> None:
    """At destroy: post every count; each group's first member compares its group's counts.

    Raises CallMismatchError for the first group whose counts differ.
    """
    mine = _mine(world)
    led = [g for g in mine if g.rank() == 0 and g.size() <= _LARGEST]
    wanted = sorted({r for g in led for r in g.ranks} - set(wire.told_lost()))
    grace = min(GRACE_S, world.timeout.total_seconds())
    try:
        world.control.ending({g.name: (g.ranks, g.calls) for g in mine if g.size() <= _LARGEST})
        got = world.control.exchange(EXCHANGE, _counts(mine), wanted, grace)
        posted = {rank: json.loads(text) for rank, text in got.items()}
        late: list[str] = []
        gone = frozenset(wire.told_lost())  # the launcher said they are gone: not late
        for group in led:
            error = _compare(group, posted, late, gone)
            if error is not None:
                raise error
        if late:
            log.warning("collective accounting: %s; they were not compared", "; ".join(late))
    finally:
        world.control.leave(grace)


def check_after_failure(world: JobContext, group: ProcessGroup) -> CallMismatchError | None:
    """After a collective on ``group`` failed: post this rank's count of ``group`` and compare
    it with the members' counts posted so far (after a failure of their own on ``group``, or
    at their end); the error naming who made more or fewer calls, or None (also where the
    control plane is no Board: it cannot be read out of step).

    Only ``group``'s count is posted: a rank that fails here may have made fewer calls on its
    other groups than their members only because it stops now."""
    control = world.control
    if (not isinstance(control, Board) or group.size() > _LARGEST
            or not world.engine.store_reachable()):  # a post would only log torch's C++ stack
        return None
    key = world.spmd.key
    failed = [key(keys.CALLS_AFTER_FAILURE, group=group.name, rank=r) for r in group.ranks]
    ended = [key(keys.EXCHANGE, name=EXCHANGE, rank=r) for r in group.ranks]
    try:
        with control.briefly():
            control.post(failed[group.rank()], str(group.calls))
            after, at_end = control.peek(failed), control.peek(ended)
    except StoreFailed:  # the store is gone: nothing to compare
        return None
    posted: dict[int, dict[str, int]] = {}
    for member, count, counts in zip(group.ranks, after, at_end, strict=True):
        if count is not None:
            posted[member] = {group.name: int(count)}
        elif counts is not None:
            posted[member] = json.loads(counts)
    return _compare(group, posted, [])


def _compare(group: ProcessGroup, posted: dict[int, dict[str, int]], late: list[str],
             gone: frozenset[int] = frozenset()) -> CallMismatchError | None:
    """The error when the members' posted counts of ``group`` differ; members that posted
    none for it are added to ``late`` in words, unless ``gone`` (the launcher said so)."""
    by_count: dict[int, list[int]] = {}
    missing = []
    for member in group.ranks:
        count = posted.get(member, {}).get(group.name)
        if count is None:
            if member not in gone:
                missing.append(member)
        else:
            by_count.setdefault(count, []).append(member)
    if missing:
        late.append(f"{rank_words(missing)} had not posted their call counts on {group.label}")
    if len(by_count) < 2:
        return None
    return CallMismatchError(group.label, by_count)

