"""Cross-rank agreement: before a mesh creates a group, every rank checks it was asked the same.

On an engine with a store, the check runs through the store alone, so it costs a few store
round trips and no collective (and works the same on gloo and nccl worlds). At check #n each
rank posts a digest of its request (``_keys.CHECK_ARRIVE``) and waits for the outcome
(``_keys.CHECK_OUTCOME``); rank 0 reads every digest with one multi_get, which returns once
all are posted, and posts the outcome. Only short text travels, nothing is pickled. On a
difference the ranks holding each distinct request post its JSON text, and every rank raises
the same MeshMismatchError naming which ranks passed which value.

When a check cannot finish, the error says why and who:

- while a rank waits, a thread watches the other ranks of its host (their pids are gathered at
  init_process_group). When one dies before posting its digest, the thread posts a death
  notice as the outcome, which wakes every waiting rank on every host, and posts the digest
  in the dead rank's place, which releases rank 0: each raises RankFailedError naming it;
- a wait that expires names the ranks that never arrived (DistributedTimeoutError) and posts a
  "gave up" outcome, so a rank that arrives later fails at once instead of waiting out its
  own timeout;
- a store that cannot be reached names rank 0, which serves it for env:// and tcp://, or the
  ranks of this host that died.

An engine without a store (MPI) compares the same digests with one all-gather over the world
(``Engine.allgather_text``); on a difference a second all-gather carries the JSON text of the
first rank of each distinct request, and every rank raises the same MeshMismatchError as the
store path words it. Its waits are the engine's, bounded by the same timeout.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from . import _arrivals, _keys
from ._failures import FIX_FAILED, FIX_LATE, Dead, death_watch, diagnose, named_failures, store_call
from .errors import (
    DistributedTimeoutError,
    MeshMismatchError,
    RankFailedError,
    format_ranks,
)

if TYPE_CHECKING:
    from .world import World

SHOWN_VALUES = 8  # distinct requests a mismatch error spells out; the rest are counted


def agree(world: World, what: str, request: dict[str, object]) -> None:
    """Return when every rank of ``world`` passed an equal ``request`` to ``what``.

    Raises MeshMismatchError (same text on every rank) when they differ,
    DistributedTimeoutError naming the ranks that never arrived when the wait expires, and
    RankFailedError naming dead ranks when a peer dies or the store breaks.
    """
    if world.simulated or world.size == 1:  # a simulated (or 1-rank) world agrees
        return
    n = world.spmd.next("check")
    step = f"{what} (cross-rank check #{n})"
    arrived_at = time.time()
    text = json.dumps(request, sort_keys=True, default=str)
    if world.store is None:
        _agree_by_gather(world, what, step, text)
        return
    store, spmd = world.store, world.spmd
    store_call(world, step, lambda: store.set(
        spmd.key(_keys.CHECK_ARRIVE, n=n, rank=world.rank), _digest(text)))
    with death_watch(world, lambda dead: _post_death(world, n, dead),
                     lambda text, ranks: _post_lost(world, n, text, ranks)):
        if world.rank == world.members()[0]:
            outcome = _judge(world, step, n)
        else:
            outcome = _await(world, step, n, [spmd.key(_keys.CHECK_OUTCOME, n=n)])[0]
    kind, _, rest = outcome.partition(" ")
    if kind == "ok":
        return
    if kind == "differ":
        _raise_mismatch(world, what, step, n, text, rest)
    if kind == "dead":
        raise _diagnosed(world, step, n, None, timed_out=False, dead=_parse_dead(rest))
    if kind == "lost":  # the launchers stop the job: a node lost, or a failure elsewhere
        runs, _, said = rest.partition(" ")
        raise RankFailedError(f"{step} failed: {said}. {FIX_FAILED}",
                              ranks=_unruns(runs) if runs != "-" else None)
    when, _, note = rest.partition(" ")  # gave_up <time> <note>
    if arrived_at > float(when):
        raise DistributedTimeoutError(
            step, world.timeout.total_seconds(), None,
            who=f"rank {world.rank} arrived after the others had given up waiting ({note})",
            fix=FIX_LATE,
        )
    raise _diagnosed(world, step, n, None, timed_out=True)  # another waiter gave up first


def _agree_by_gather(world: World, what: str, step: str, text: str) -> None:
    """The check on an engine without a store: the digests all-gathered, then on a
    difference the texts of the ranks whose requests are shown."""
    with named_failures(world, step):
        digests = world.engine.allgather_text(_digest(text), step)
    by_digest: dict[str, list[int]] = {}
    for rank, d in enumerate(digests):
        by_digest.setdefault(d, []).append(rank)
    if len(by_digest) == 1:
        return
    ranks_of = list(by_digest.values())
    shown = ranks_of[:SHOWN_VALUES]
    posts = any(ranks[0] == world.rank for ranks in shown)
    with named_failures(world, step):
        texts = world.engine.allgather_text(text if posts else "", step)
    raise _mismatch(what, [json.loads(texts[ranks[0]]) for ranks in shown], ranks_of)


def _digest(text: str) -> str:
    """A request's fingerprint: 128 bits of its SHA-256, as hex."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _judge(world: World, step: str, n: int) -> str:
    """The first member (rank 0, but for an elastic mesh that lost it): read every member's
    digest of check #n, post the outcome and return what was posted.

    A gave-up or death notice posted before ours wins, and is returned instead.
    """
    store, spmd = world.store, world.spmd
    key = spmd.key(_keys.CHECK_OUTCOME, n=n)
    if store_call(world, step, lambda: store.check([key])):  # this rank is late
        return store_call(world, step, lambda: store.get(key).decode())
    members = world.members()
    digests = _await(world, step, n, [spmd.key(_keys.CHECK_ARRIVE, n=n, rank=r)
                                      for r in members])
    if all(d == digests[0] for d in digests):
        verdict = "ok"
    else:
        by_digest: dict[str, list[int]] = {}
        for rank, d in zip(members, digests, strict=True):
            by_digest.setdefault(d, []).append(rank)
        verdict = "differ " + " ".join(_runs(ranks) for ranks in by_digest.values())
    return store_call(world, step, lambda: store.compare_set(key, "", verdict).decode())


def _await(world: World, step: str, n: int, keys: list[str]) -> list[str]:
    """The values of ``keys`` once every one is posted; waits up to the world's timeout."""
    try:
        return [v.decode() for v in world.store.multi_get(keys)]
    except (RuntimeError, OSError) as err:
        raise _diagnosed(world, step, n, err, world.engine.classify(err) == "timeout") from err


def _post_death(world: World, n: int, dead: list[Dead]) -> None:
    """Post a death notice as check #n's outcome and as the digest of each dead rank that
    never posted one, which wakes every waiter on every host and releases rank 0.

    Runs on the watcher thread, so it goes through a clone of the store (its own connection).
    """
    notice = "dead " + " ".join(f"{rank}:{pid}@{host}" for rank, pid, host in dead)
    spmd = world.spmd
    # the store died too (the wait will say so), or a torch without Store.clone
    with suppress(RuntimeError, OSError, AttributeError):
        store = world.store.clone()
        store.compare_set(spmd.key(_keys.CHECK_OUTCOME, n=n), "", notice)
        for rank, _, _ in dead:
            store.compare_set(spmd.key(_keys.CHECK_ARRIVE, n=n, rank=rank), "", notice)


def _post_lost(world: World, n: int, text: str, ranks: list[int]) -> None:
    """Post the launcher's verdict (``text``, naming the lost ``ranks``) as check #n's
    outcome, and as the digest of each lost rank, which wakes every waiter that can still
    reach the store and releases rank 0. Runs on the watcher thread (a store clone)."""
    notice = f"lost {_runs(sorted(ranks)) if ranks else '-'} {text}"
    spmd = world.spmd
    with suppress(RuntimeError, OSError, AttributeError):
        store = world.store.clone()
        store.compare_set(spmd.key(_keys.CHECK_OUTCOME, n=n), "", notice)
        for rank in ranks:
            store.compare_set(spmd.key(_keys.CHECK_ARRIVE, n=n, rank=rank), "", notice)


def _parse_dead(text: str) -> list[Dead]:
    """(rank, pid, host) of each entry of a death notice."""
    out = []
    for item in text.split(" "):
        rank, _, rest = item.partition(":")
        pid, _, host = rest.partition("@")
        out.append((int(rank), int(pid), host))
    return out


def _diagnosed(
    world: World, step: str, n: int, err: BaseException | None, timed_out: bool,
    dead: list[Dead] | None = None,
) -> Exception:
    """The error of check #n that failed: who died, who never arrived, or who is slow. A
    rank that gives up posts so as the outcome, so that a rank arriving later fails at once."""
    store_gone: RankFailedError | None = None
    try:
        members = world.members()
        keys = [world.spmd.key(_keys.CHECK_ARRIVE, n=n, rank=r) for r in members]
        missing = [members[i] for i in
                   store_call(world, step, lambda: _arrivals.unset(world.store, keys))]
    except RankFailedError as gone:
        store_gone, missing = gone, []
    if timed_out and store_gone is None:
        _mark_gave_up(world, n, missing)
    return diagnose(world, step, err, timed_out, dead=dead, missing=missing,
                    store_gone=store_gone)


def _mark_gave_up(world: World, n: int, missing: list[int]) -> None:
    """Post 'gave up' as check #n's outcome, so that a rank arriving later fails at once."""
    note = (f"gave_up {time.time():.6f} rank {world.rank} stopped waiting after "
            f"{world.timeout.total_seconds():g} s; missing then: {format_ranks(missing)}")
    with suppress(RuntimeError, OSError):  # the store is gone too: the late rank will see
        world.store.compare_set(world.spmd.key(_keys.CHECK_OUTCOME, n=n), "", note)


def _runs(ranks: list[int]) -> str:
    """Sorted ranks as runs: [0, 1, 2, 5] -> '0-2,5' (parsed back by _unruns)."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def _unruns(text: str) -> list[int]:
    ranks: list[int] = []
    for run in text.split(","):
        first, _, last = run.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def _shown(value: Any) -> str:
    """A JSON value written as Python would: lists as tuples, strings quoted."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return repr(tuples(value))


def _raise_mismatch(world: World, what: str, step: str, n: int, text: str, groups: str) -> None:
    """Raise one MeshMismatchError listing who passed what for the first differing field.

    ``groups`` holds the ranks of each distinct request (runs, space-separated, in order of
    their first rank). The first rank of each of the first SHOWN_VALUES groups posts its
    request's text; every rank reads those texts, so every rank words the same error.
    """
    ranks_of = [_unruns(g) for g in groups.split(" ")]
    shown = ranks_of[:SHOWN_VALUES]
    keys = [world.spmd.key(_keys.CHECK_REQUEST, n=n, rank=ranks[0]) for ranks in shown]
    if any(ranks[0] == world.rank for ranks in shown):
        mine = world.spmd.key(_keys.CHECK_REQUEST, n=n, rank=world.rank)
        store_call(world, step, lambda: world.store.set(mine, text))
    raise _mismatch(what, [json.loads(raw) for raw in _await(world, step, n, keys)], ranks_of)


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
