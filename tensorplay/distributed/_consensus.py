"""Cross-rank agreement: before a mesh creates a group, every rank checks it was asked the same.

The check runs through the job's store alone, so it costs a few store round trips and no
collective (and works the same on gloo and nccl worlds). At check #n each rank posts a digest
of its request (``tensorplay/arrive/<n>/<rank>``) and waits for the outcome
(``tensorplay/outcome/<n>``); rank 0 reads every digest with one multi_get, which returns once
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
"""

from __future__ import annotations

import _thread
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from . import _arrivals, _env
from .errors import (
    DistributedError,
    DistributedTimeoutError,
    MeshMismatchError,
    RankFailedError,
    format_ranks,
    rank_words,
)

if TYPE_CHECKING:
    from .process_group import World

ARRIVE = "tensorplay/arrive/{n}/{rank}"  # the rank's request digest (or "dead ...")
OUTCOME = "tensorplay/outcome/{n}"  # ok | differ ... | gave_up ... | dead ...
REQUEST = "tensorplay/request/{n}/{rank}"  # a request's JSON text, posted only on a difference
SHOWN_VALUES = 8  # distinct requests a mismatch error spells out; the rest are counted
WATCH_S = 0.2  # how often a waiting rank looks for dead ranks on its host
DEATH_GRACE_S = 1.0  # a peer's socket closes a moment before its process is reaped
FIX_FAILED = (
    "Fix: find the first rank that failed in the launcher's output (a crash, an out-of-memory "
    "kill, a signal) and fix that; then restart the whole job (a world with a dead rank "
    "cannot be repaired)."
)
FIX_LATE = (
    "Fix: make this rank reach the call sooner (is it doing extra work or stuck before it?), "
    "or raise the limit with init_process_group(timeout=...) or TENSORPLAY_TIMEOUT; then "
    "restart the whole job."
)


def agree(world: World, what: str, request: dict[str, object]) -> None:
    """Return when every rank of ``world`` passed an equal ``request`` to ``what``.

    Raises MeshMismatchError (same text on every rank) when they differ,
    DistributedTimeoutError naming the ranks that never arrived when the wait expires, and
    RankFailedError naming dead ranks when a peer dies or the store breaks.
    """
    if world.engine.NAME == "fake" or world.size == 1:
        return
    world.agreements += 1
    n = world.agreements
    step = f"{what} (cross-rank check #{n})"
    arrived_at = time.time()
    text = json.dumps(request, sort_keys=True, default=str)
    store = world.store
    _store(world, step, lambda: store.set(ARRIVE.format(n=n, rank=world.rank), _digest(text)))
    with _death_watch(world, n):
        if world.rank == 0:
            outcome = _judge(world, step, n)
        else:
            outcome = _await(world, step, n, [OUTCOME.format(n=n)])[0]
    kind, _, rest = outcome.partition(" ")
    if kind == "ok":
        return
    if kind == "differ":
        _raise_mismatch(world, what, step, n, text, rest)
    if kind == "dead":
        raise _diagnose(world, step, n, None, timed_out=False, dead=_parse_dead(rest))
    when, _, note = rest.partition(" ")  # gave_up <time> <note>
    if arrived_at > float(when):
        raise DistributedTimeoutError(
            step, world.timeout.total_seconds(), None,
            who=f"rank {world.rank} arrived after the others had given up waiting ({note})",
            fix=FIX_LATE,
        )
    raise _diagnose(world, step, n, None, timed_out=True)  # another waiter gave up first


def _digest(text: str) -> str:
    """A request's fingerprint: 128 bits of its SHA-256, as hex."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _judge(world: World, step: str, n: int) -> str:
    """Rank 0: read every digest of check #n, post the outcome and return what was posted.

    A gave-up or death notice posted before ours wins, and is returned instead.
    """
    key = OUTCOME.format(n=n)
    if _store(world, step, lambda: world.store.check([key])):  # this rank is late
        return _store(world, step, lambda: world.store.get(key).decode())
    digests = _await(world, step, n, [ARRIVE.format(n=n, rank=r) for r in range(world.size)])
    if all(d == digests[0] for d in digests):
        verdict = "ok"
    else:
        by_digest: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            by_digest.setdefault(d, []).append(rank)
        verdict = "differ " + " ".join(_runs(ranks) for ranks in by_digest.values())
    return _store(world, step, lambda: world.store.compare_set(key, "", verdict).decode())


def _await(world: World, step: str, n: int, keys: list[str]) -> list[str]:
    """The values of ``keys`` once every one is posted; waits up to the world's timeout."""
    try:
        return [v.decode() for v in world.store.multi_get(keys)]
    except (RuntimeError, OSError) as err:
        raise _diagnose(world, step, n, err, _is_timeout(err)) from err


@contextmanager
def _death_watch(world: World, n: int) -> Iterator[None]:
    """Inside the block, watch this host's other ranks; when one dies, post a death notice as
    check #n's outcome and its digest (if it never posted one), which wakes every waiter.

    The notice goes through a clone of the store (its own connection), since this rank's
    connection is busy waiting.
    """
    others = {r: p for r, p in (world.host_pids or {}).items() if r != world.rank}
    if not others:
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCH_S):
            dead = sorted((r, p) for r, p in others.items() if not _running(p))
            if dead:
                notice = "dead " + _dead_text(dead, _env.hostname())
                # the store died too (the wait will say so), or a torch without Store.clone
                with suppress(RuntimeError, OSError, AttributeError):
                    store = world.store.clone()
                    store.compare_set(OUTCOME.format(n=n), "", notice)
                    for rank, _ in dead:
                        store.compare_set(ARRIVE.format(n=n, rank=rank), "", notice)
                return

    # _thread, not threading.Thread: Thread.start() blocks until the new thread has run, which
    # on a busy machine costs more than the whole check
    _thread.start_new_thread(watch, ())
    try:
        yield
    finally:
        stop.set()


def _dead_text(dead: list[tuple[int, int]], host: str) -> str:
    return " ".join(f"{rank}:{pid}@{host}" for rank, pid in dead)


def _parse_dead(text: str) -> list[tuple[int, int, str]]:
    """(rank, pid, host) of each entry of a death notice."""
    out = []
    for item in text.split(" "):
        rank, _, rest = item.partition(":")
        pid, _, host = rest.partition("@")
        out.append((int(rank), int(pid), host))
    return out


def _is_timeout(err: BaseException) -> bool:
    lowered = str(err).lower()
    return "timed out" in lowered or "timeout" in lowered


@contextmanager
def named_failures(world: World, step: str) -> Iterator[None]:
    """Inside the block, turn engine and store failures into our errors naming the lost ranks.

    For work that follows a check, such as creating a mesh's groups:
    ``with named_failures(world, "init_device_mesh(): creating the group of dim 'tp'"): ...``.
    A timeout becomes DistributedTimeoutError; a broken connection, or a timeout while a peer
    on this host is dead, becomes RankFailedError naming it.
    """
    if world.engine.NAME == "fake":
        yield
        return
    try:
        yield
    except (DistributedTimeoutError, RankFailedError) as err:
        raise _diagnose(world, step, None, err, isinstance(err, DistributedTimeoutError)) from err
    except DistributedError:
        raise
    except RuntimeError as err:  # the engine's own failures (c10d store, gloo)
        raise _diagnose(world, step, None, err, _is_timeout(err)) from err


def _diagnose(
    world: World,
    step: str,
    n: int | None,
    err: BaseException | None,
    timed_out: bool,
    dead: list[tuple[int, int, str]] | None = None,
) -> DistributedError:
    """The error to raise when ``step`` failed: who died, who never arrived, or who is slow.

    ``dead`` comes from a death notice; else this host's ranks are looked at. ``n`` is the
    check's number, None outside a check.
    """
    said = f" Engine said: {_engine_words(err)}." if err is not None else ""
    timeout_s = world.timeout.total_seconds()
    if dead is None:
        here = _env.hostname()
        dead = [(r, p, here) for r, p in
                _dead_on_this_host(world, wait_s=0.0 if timed_out else DEATH_GRACE_S)]
    store_gone: RankFailedError | None = None
    try:
        missing = _missing(world, step, n) if n is not None else []
    except RankFailedError as gone:
        store_gone, missing = gone, []
    if timed_out and n is not None and store_gone is None:
        _mark_gave_up(world, n, missing)
    never = f"{rank_words(missing)} never arrived at it" if missing else ""
    if dead:
        host = dead[0][2]
        where = "this host" if host == _env.hostname() else f"host {host}"
        gone = ", ".join(f"rank {r} (pid {pid})" for r, pid, _ in dead)
        parts = [f"{step} failed: {gone} died (no longer running on {where})"]
        if never:
            parts.append(never)
        return RankFailedError("; ".join(parts) + f".{said} {FIX_FAILED}",
                               ranks=[r for r, _, _ in dead])
    if store_gone is not None:
        return store_gone
    if timed_out:
        who = None if n is not None else "the other members did not answer"
        if n is not None and not missing:
            who = "every rank arrived, but the check did not complete (a rank is stuck or slow)"
        return DistributedTimeoutError(step, timeout_s, missing if who is None else None,
                                       said.strip(), who=who)
    parts = [f"{step} failed: the connection to a peer rank broke"]
    if never:
        parts.append(never)
    else:
        parts.append("no rank on this host died, so a rank on another host probably did")
    return RankFailedError("; ".join(parts) + f".{said} {FIX_FAILED}", ranks=missing or None)


def _engine_words(err: BaseException) -> str:
    """The first line of the engine's message under ``err``, without its source location."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    lines = str(root).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(root).__name__
    return first[:240]


def _store(world: World, step: str, call: Callable[[], Any]) -> Any:
    """Run one store operation; a failure means the store (rank 0 for env://, tcp://) is gone."""
    try:
        return call()
    except (RuntimeError, OSError) as err:
        raise RankFailedError(
            f"{step} failed: the job's store cannot be reached, so the rank serving it "
            f"(rank 0 for env:// and tcp://) has probably exited or crashed. "
            f"Engine said: {_engine_words(err)}. {FIX_FAILED}",
            ranks=[0],
        ) from err


def _missing(world: World, step: str, n: int) -> list[int]:
    """Ranks that have not posted their digest at check #n."""
    keys = [ARRIVE.format(n=n, rank=r) for r in range(world.size)]
    return _store(world, step, lambda: _arrivals.unset(world.store, keys))


def _mark_gave_up(world: World, n: int, missing: list[int]) -> None:
    """Post 'gave up' as check #n's outcome, so that a rank arriving later fails at once."""
    note = (f"gave_up {time.time():.6f} rank {world.rank} stopped waiting after "
            f"{world.timeout.total_seconds():g} s; missing then: {format_ranks(missing)}")
    with suppress(RuntimeError, OSError):  # the store is gone too: the late rank will see
        world.store.compare_set(OUTCOME.format(n=n), "", note)


def _dead_on_this_host(world: World, wait_s: float) -> list[tuple[int, int]]:
    """(rank, pid) of the other ranks of this host whose process has gone.

    A peer's sockets close just before its process becomes a zombie, so when ``wait_s`` > 0
    this looks again for up to that long before answering that none died.
    """
    deadline = time.monotonic() + wait_s
    pids = world.host_pids or {}
    while True:
        dead = sorted((r, p) for r, p in pids.items() if r != world.rank and not _running(p))
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


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
    shown, hidden = ranks_of[:SHOWN_VALUES], ranks_of[SHOWN_VALUES:]
    keys = [REQUEST.format(n=n, rank=ranks[0]) for ranks in shown]
    if any(ranks[0] == world.rank for ranks in shown):
        _store(world, step, lambda: world.store.set(REQUEST.format(n=n, rank=world.rank), text))
    requests = [json.loads(raw) for raw in _await(world, step, n, keys)]
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
    raise MeshMismatchError(f"{field} in {what}{also}", by_value)
