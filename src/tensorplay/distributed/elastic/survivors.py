"""Which ranks are lost: one answer for every survivor, decided once in the job's store.

The agreement step of elastic recovery. After a failure each survivor calls ``agree_lost`` with
what it saw (the ranks its error named). Membership never changes from one rank's view: every
survivor gets the same set of lost ranks, or the same refusal, because the store decides once
(``compare_set`` on one key: the first verdict posted stands and every caller reads it).

At round ``key`` each survivor posts ``here/<rank>``: its suspects and the members it has seen
die (their process gone from its host), then watches the others arrive. It decides as soon as
every member has posted or was seen dead; else once every member not suspected by anyone has
posted (suspects not seen dead get ``SUSPECT_GRACE_S`` to show they are alive), or once
``wait_s`` has passed with a majority posted. The ranks that never posted are lost. Without a
majority of the members not seen dead, the verdict is a refusal (no split brain: two halves
cannot both go on, as only one can hold a majority; a dead rank cannot go on anywhere). A rank
that posts after the verdict finds itself among the lost.

Worked example: members 0..7 on one host, rank 5 SIGKILLed. Every survivor sees pid of rank 5
gone; once ranks 0-4, 6, 7 have posted the first to look decides lost = [5], with no wait;
every survivor returns [5]. Were rank 5 on another host (not seen dead), its peers' errors
name it and the others decide SUSPECT_GRACE_S after they began. Cost: one post and about one
check per member per poll (n = 8: tens of store calls); a store that can be reached is all it
needs (tensorplay-run serves it on node 0, so it outlives any rank).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..control import keys
from ..errors import ShrinkError, StaleEpochError, format_ranks

if TYPE_CHECKING:
    from ..control.plane import Board

POLL_S = 0.05
SUSPECT_GRACE_S = 3.0  # a suspected rank (not seen dead) that is alive has this long to say so


def agree_lost(board: Board, epoch: int, rank: int, members: Sequence[int],
               suspects: Iterable[int], *, wait_s: float = 5.0,
               timeout_s: float = 60.0,
               dead: Callable[[], Iterable[int]] = lambda: (),
               alive: Callable[[], Iterable[int]] = lambda: ()) -> list[int]:
    """The lost ranks of ``members``, the same on every survivor (see the module docstring).

    ``dead()`` names the members this rank knows are gone (their process has ended on this
    host); asked at every poll, and posted with this rank's suspects, so no survivor waits
    for a rank any survivor saw die. ``alive()`` names those whose process still runs on this
    host, asked once by the rank that decides: a lost rank among them was late, not dead, and
    the verdict says so ("lost though alive on rank 5's host: 1, 3"), as does the error of
    that rank when it comes. Raises ShrinkError when the survivors are no majority of
    ``members`` by ``timeout_s``, and StaleEpochError when this rank arrived after the others
    had declared it lost.
    """
    members = list(members)
    start = time.monotonic()
    mine = {"suspects": sorted(set(suspects)), "dead": sorted(set(dead()))}
    board.post(keys.RECOVER_HERE.format(epoch=epoch, rank=rank), json.dumps(mine))
    posted: dict[int, dict[str, list[int]]] = {}
    verdict_key = keys.RECOVER_VERDICT.format(epoch=epoch)
    while board.peek([verdict_key])[0] is None:
        unheard = [m for m in members if m not in posted]
        heard = board.peek([keys.RECOVER_HERE.format(epoch=epoch, rank=m) for m in unheard])
        posted.update({m: json.loads(t) for m, t in zip(unheard, heard, strict=True)
                       if t is not None})
        gone = set(dead()).union(*(p["dead"] for p in posted.values()))
        suspected = set().union(*(p["suspects"] for p in posted.values())) - gone
        waited = time.monotonic() - start
        majority = 2 * len(posted) > len(set(members) - gone)  # of those not seen dead: the
        # dead cannot go on elsewhere, but an absent rank not seen dead might (split brain)
        accounted = set(members) <= set(posted) | gone
        unsuspected_in = set(members) - suspected - gone <= set(posted)
        if (accounted or (unsuspected_in and waited >= SUSPECT_GRACE_S)
                or (majority and waited >= wait_s) or waited >= timeout_s):
            lost = sorted(set(members) - set(posted))
            decided: dict[str, list[int] | str] = (
                {"lost": lost} if majority else {"refused": sorted(posted)})
            rule = ("every member posted or was seen dead" if accounted else
                    "the suspects had their grace" if unsuspected_in else "the wait ran out")
            seen = format_ranks(sorted(gone)) if gone else "none"
            named = format_ranks(sorted(suspected)) if suspected else "none"
            running = set(lost) & set(alive()) - gone
            late = (f"; lost though alive on rank {rank}'s host: "
                    f"{format_ranks(sorted(running))}") if running else ""
            decided["why"] = (f"decided by rank {rank} after {waited:.1f} s, {rule}; seen "
                              f"dead: {seen}; suspected: {named}{late}")
            board.decide(verdict_key, json.dumps(decided))
            break
        time.sleep(POLL_S)
    verdict = json.loads(board.wait([verdict_key])[0])
    if "refused" in verdict:
        raise ShrinkError(
            f"only ranks {format_ranks(verdict['refused'])} of {len(members)} members came to "
            f"the recovery ({verdict['why']}): no majority of the members not seen dead, so "
            f"no part of the job may go on alone. Fix: restart the job from its last checkpoint")
    if rank in verdict["lost"]:
        raise StaleEpochError(
            f"rank {rank} was declared lost while alive: it reached the recovery after the "
            f"others had agreed it was lost (lost: {format_ranks(verdict['lost'])}; "
            f"{verdict.get('why', '')}); it must leave the job. Fix: make it "
            f"reach the recovery sooner, or raise the wait")
    return verdict["lost"]
