"""Which ranks are lost: one answer for every survivor, decided once in the job's store.

The agreement step of elastic recovery. After a failure each survivor calls ``agree_lost`` with
what it saw (the ranks its error named). Membership never changes from one rank's view: every
survivor gets the same set of lost ranks, or the same refusal, because the store decides once
(``compare_set`` on one key: the first verdict posted stands and every caller reads it).

At round ``key`` each survivor posts ``here/<rank>`` with its suspects, then watches the others
arrive. It decides once every member not suspected by anyone has posted (suspects get
``SUSPECT_GRACE_S`` to show they are alive), or once ``wait_s`` has passed with a majority
posted. The ranks that never posted are lost. Without a majority of ``members`` by
``timeout_s`` the verdict is a refusal (no split brain: two halves cannot both go on, as only
one can hold a majority). A rank that posts after the verdict finds itself among the lost.

Worked example: members 0..7, rank 5 SIGKILLed. Ranks 1 and 4 (its peers) suspect {5}; the
other five survivors suspect nothing. Once ranks 0-4, 6, 7 have posted (5 is suspected, so
nobody waits past SUSPECT_GRACE_S for it) the first to look decides lost = [5]; every
survivor returns [5]. Cost: one post and about one check per member per poll (n = 8: tens of
store calls over ~1 s); a store that can be reached is all it needs (tensorplay-run serves it
on node 0, so it outlives any rank).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import ShrinkError, StaleEpochError, format_ranks

POLL_S = 0.05
SUSPECT_GRACE_S = 1.0  # a suspected rank that is alive has this long to say so


def agree_lost(store: Any, key: str, rank: int, members: Sequence[int],
               suspects: Iterable[int], *, wait_s: float = 5.0,
               timeout_s: float = 60.0) -> list[int]:
    """The lost ranks of ``members``, the same on every survivor (see the module docstring).

    Raises ShrinkError when the survivors are no majority of ``members`` by ``timeout_s``, and
    StaleEpochError when this rank arrived after the others had declared it lost.
    """
    members = list(members)
    start = time.monotonic()
    store.set(f"{key}/here/{rank}", json.dumps(sorted(set(suspects))))
    posted: dict[int, list[int]] = {}
    verdict_key = f"{key}/verdict"
    while not store.check([verdict_key]):
        for m in members:
            if m not in posted and store.check([f"{key}/here/{m}"]):
                posted[m] = json.loads(store.get(f"{key}/here/{m}"))
        suspected = {s for seen in posted.values() for s in seen}
        waited = time.monotonic() - start
        majority = 2 * len(posted) > len(members)
        everyone = len(posted) == len(members)
        unsuspected_in = set(members) - suspected <= set(posted)
        if (everyone or (unsuspected_in and waited >= SUSPECT_GRACE_S)
                or (majority and waited >= wait_s) or waited >= timeout_s):
            lost = sorted(set(members) - set(posted))
            mine = {"lost": lost} if majority else {"refused": sorted(posted)}
            store.compare_set(verdict_key, "", json.dumps(mine))
            break
        time.sleep(POLL_S)
    verdict = json.loads(store.get(verdict_key))
    if "refused" in verdict:
        raise ShrinkError(
            f"only ranks {format_ranks(verdict['refused'])} of {len(members)} members came to "
            f"the recovery within {timeout_s:g} s: no majority, so no part of the job may go "
            f"on alone. Fix: restart the job from its last checkpoint")
    if rank in verdict["lost"]:
        raise StaleEpochError(
            f"rank {rank} reached the recovery after the others had agreed it was lost "
            f"(lost: {format_ranks(verdict['lost'])}); it must leave the job. Fix: make it "
            f"reach the recovery sooner, or raise the wait")
    return verdict["lost"]
