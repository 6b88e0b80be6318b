"""Cross-rank agreement: before a mesh creates a group, every rank checks it was asked the same.

Each rank reduces a 32-byte digest of its request with MIN and MAX over the world (two tiny
all_reduces, no pickles); equal extremes mean equal requests. On a difference the ranks gather
their requests as JSON text and every rank raises the same MeshMismatchError naming which ranks
passed which value. Each rank also marks its arrival in the store, so a wait that expires can
say which ranks never came.
"""

from __future__ import annotations

import hashlib
import json

from .errors import DistributedTimeoutError, MeshMismatchError, RankFailedError
from .process_group import World


def agree(world: World, what: str, request: dict[str, object]) -> None:
    """Return when every rank of ``world`` passed an equal ``request`` to ``what``.

    Raises MeshMismatchError (same text on every rank) when they differ, and
    DistributedTimeoutError or RankFailedError naming absent ranks when some never arrive.
    """
    if world.engine.NAME == "fake" or world.size == 1:
        return
    import torch

    from . import collectives

    world.agreements += 1
    step = f"{what} (cross-rank check #{world.agreements})"
    arrival = f"tensorplay/arrive/{world.agreements}/"
    world.store.set(f"{arrival}{world.rank}", what)
    text = json.dumps(request, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    words = [int.from_bytes(digest[i : i + 7], "big") for i in range(0, 28, 7)]
    low = torch.tensor(words + [len(text)], dtype=torch.int64)
    high = low.clone()
    try:
        collectives.all_reduce(low, collectives.ReduceOp.MIN)
        collectives.all_reduce(high, collectives.ReduceOp.MAX)
    except (DistributedTimeoutError, RankFailedError) as err:
        missing = [r for r in range(world.size) if not world.store.check([f"{arrival}{r}"])]
        raise DistributedTimeoutError(
            step, world.timeout.total_seconds(), missing, f"({type(err).__name__}: {err})"
        ) from err
    if torch.equal(low, high):
        return
    _raise_mismatch(world, what, text, int(high[-1]))


def _raise_mismatch(world: World, what: str, text: str, longest: int) -> None:
    """Gather every rank's request and raise one MeshMismatchError listing who passed what."""
    import torch

    from . import collectives

    mine = torch.zeros(longest, dtype=torch.uint8)
    raw = text.encode()
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    everyone = torch.zeros(world.size * longest, dtype=torch.uint8)
    collectives.all_gather_into_tensor(everyone, mine)
    requests = [
        json.loads(bytes(everyone[r * longest : (r + 1) * longest].tolist()).rstrip(b"\0"))
        for r in range(world.size)
    ]
    fields = sorted({key for request in requests for key in request})
    differing = [f for f in fields if len({json.dumps(r.get(f)) for r in requests}) > 1]
    field = differing[0] if differing else "the request"
    by_value: dict[str, list[int]] = {}
    for rank, request in enumerate(requests):
        by_value.setdefault(json.dumps(request.get(field)), []).append(rank)
    raise MeshMismatchError(f"{field} in {what}", by_value)
