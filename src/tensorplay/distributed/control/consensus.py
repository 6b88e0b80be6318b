"""Cross-rank agreement: before a mesh creates a group, every rank checks it was asked the same.

One path for every engine, over the world's control plane (``control/plane.py``): each rank's
request is written as JSON (sorted keys) and its 128-bit digest is tallied (``Control.tally``); when
every rank passed the same digest, the check is over. On a store that costs a few round trips
and no collective (rank 0 reads every digest; the others read one outcome); on MPI one
all-gather of digests on the control communicator. On a difference, the first rank of each of
the first SHOWN_VALUES groups says what its group passed (``Control.texts``), and every rank
raises the same MeshMismatchError naming which ranks passed which value.

When a check cannot finish, the control plane's error says why and who: a rank that died
(named on every host), the ranks that never arrived (DistributedTimeoutError), the launcher's
verdict (a node lost), or the store's server gone.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..errors import MeshMismatchError

if TYPE_CHECKING:
    from ..job.context import JobContext

SHOWN_VALUES = 8  # distinct requests a mismatch error spells out; the rest are counted


def agree(world: JobContext, what: str, request: dict[str, object]) -> None:
    """Return when every rank of ``world`` passed an equal ``request`` to ``what``.

    Raises MeshMismatchError (same text on every rank) when they differ,
    DistributedTimeoutError naming the ranks that never arrived when the wait expires, and
    RankFailedError naming dead ranks when a peer dies or the store breaks.
    """
    text = json.dumps(request, sort_keys=True, default=str)
    groups = world.control.tally(what, _digest(text))
    if len(groups) == 1:
        return
    shown = groups[:SHOWN_VALUES]
    firsts = [ranks[0] for ranks in shown]
    texts = world.control.texts(f"{what} (requests that differ)", text, firsts)
    raise _mismatch(what, [json.loads(t) for t in texts], [list(g) for g in groups])


def _digest(text: str) -> str:
    """A request's fingerprint: 128 bits of its SHA-256, as hex."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _shown(value: Any) -> str:
    """A JSON value written as Python would: lists as tuples, strings quoted."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return repr(tuples(value))


def _mismatch(what: str, requests: list[dict], ranks_of: list[list[int]]) -> MeshMismatchError:
    """The error naming who passed what for the first differing field: ``requests`` are the
    requests of the first SHOWN_VALUES groups of ``ranks_of`` (ranks per distinct request)."""
    shown, hidden = ranks_of[:SHOWN_VALUES], ranks_of[SHOWN_VALUES:]
    fields = sorted({key for request in requests for key in request})
    differing = [f for f in fields
                 if len({json.dumps(r.get(f), sort_keys=True) for r in requests}) > 1]
    field = differing[0] if differing else "the request"
    by_value: dict[str, list[int]] = {}
    for request, ranks in zip(requests, shown, strict=True):
        by_value.setdefault(_shown(request.get(field)), []).extend(ranks)
    if hidden:
        by_value[f"<{len(hidden)} more distinct requests>"] = [r for g in hidden for r in g]
    also = f" (also differing: {', '.join(differing[1:])})" if len(differing) > 1 else ""
    return MeshMismatchError(f"{field} in {what}{also}", by_value)
