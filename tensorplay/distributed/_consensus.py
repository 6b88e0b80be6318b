"""Cross-rank agreement: before a mesh creates a group, every rank checks it was asked the same.

Each rank reduces a digest of its request, and its negation, with one MAX over the world (one
tiny all_reduce, no pickles): max(x) == -max(-x) means every rank passed the same request.
On a difference the ranks gather their requests as JSON text and every rank raises the same
MeshMismatchError naming which ranks passed which value.

When a check cannot finish, the error says why and who. Each rank marks its arrival at check
#n in the store (``tensorplay/arrive/<n>/<rank>``) and, once per world, appends ``rank:pid`` to
its host's list (``tensorplay/host/<hostname>``). So:

- a wait that expires names the ranks that never arrived (DistributedTimeoutError) and leaves
  a ``tensorplay/gave_up/<n>`` note, so a rank that arrives later fails at once instead of
  waiting out its own timeout;
- a broken connection names the ranks on this host whose process is gone and the ranks that
  never arrived (RankFailedError); the host's rank:pid list is read once after the first
  check, so naming the dead needs no store (rank 0, which serves it, may have exited);
- a store that cannot be reached names rank 0, which serves it for env:// and tcp://.

Only the store's keys and short text values and int64/uint8 tensors travel; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from . import _env
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

ARRIVE = "tensorplay/arrive/{n}/{rank}"
GAVE_UP = "tensorplay/gave_up/{n}"
HOST = "tensorplay/host/{host}"
DEATH_GRACE_S = 1.0  # a peer's socket closes a moment before its process is reaped
FIX_FAILED = (
    "Fix: find the first rank that failed in the launcher's output (a crash, an out-of-memory "
    "kill, a signal) and fix that; then restart the whole job (a world with a dead rank "
    "cannot be repaired)."
)


def agree(world: World, what: str, request: dict[str, object]) -> None:
    """Return when every rank of ``world`` passed an equal ``request`` to ``what``.

    Raises MeshMismatchError (same text on every rank) when they differ,
    DistributedTimeoutError naming the ranks that never arrived when the wait expires, and
    RankFailedError naming dead ranks when a peer's connection or the store breaks.
    """
    if world.engine.NAME == "fake" or world.size == 1:
        return
    import torch

    from . import collectives

    world.agreements += 1
    n = world.agreements
    step = f"{what} (cross-rank check #{n})"
    _store(world, step, lambda: world.store.set(ARRIVE.format(n=n, rank=world.rank), what))
    gave_up = GAVE_UP.format(n=n)
    if _store(world, step, lambda: world.store.check([gave_up])):
        note = _store(world, step, lambda: world.store.get(gave_up)).decode(errors="replace")
        raise DistributedTimeoutError(
            step, world.timeout.total_seconds(), None,
            who=f"rank {world.rank} arrived after the others had given up waiting ({note})",
            fix="Fix: make this rank reach the call sooner (is it doing extra work or stuck "
                "before it?), or raise the limit with init_process_group(timeout=...) or "
                "TENSORPLAY_TIMEOUT; then restart the whole job.",
        )
    text = json.dumps(request, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    words = [int.from_bytes(digest[i : i + 7], "big") for i in range(0, 28, 7)]
    mine = words + [len(text)]
    # one MAX over (x, -x) gives both extremes: max(x) and -min(x)
    extremes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    with _named_failures(world, step, n):
        collectives.all_reduce(extremes, collectives.ReduceOp.MAX)
    high, low = extremes[: len(mine)], -extremes[len(mine) :]
    if world.host_pids is None:  # every rank has registered by now
        world.host_pids = _store(world, step, lambda: _read_host_pids(world))
    if torch.equal(low, high):
        return
    with _named_failures(world, step, n):
        requests = _gather_requests(world, text, int(high[-1]))
    _raise_mismatch(what, requests)


@contextmanager
def named_failures(world: World, step: str) -> Iterator[None]:
    """Inside the block, turn engine and store failures into our errors naming the lost ranks.

    For work that follows a check, such as creating a mesh's groups:
    ``with named_failures(world, "init_device_mesh(): creating the group of dim 'tp'"): ...``.
    A timeout becomes DistributedTimeoutError; a broken connection, or a timeout while a peer
    on this host is dead, becomes RankFailedError naming it.
    """
    with _named_failures(world, step, None):
        yield


@contextmanager
def _named_failures(world: World, step: str, n: int | None) -> Iterator[None]:
    if world.engine.NAME == "fake":
        yield
        return
    try:
        yield
    except (DistributedTimeoutError, RankFailedError) as err:
        raise _diagnose(world, step, n, err, isinstance(err, DistributedTimeoutError)) from err
    except DistributedError:
        raise
    except RuntimeError as err:  # the engine's own failures (c10d store, gloo)
        lowered = str(err).lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        raise _diagnose(world, step, n, err, timed_out) from err


def _diagnose(
    world: World, step: str, n: int | None, err: BaseException, timed_out: bool
) -> DistributedError:
    """The error to raise when ``step`` failed: who never arrived, who died, or who is slow."""
    said = _engine_words(err)
    timeout_s = world.timeout.total_seconds()
    store_gone: RankFailedError | None = None
    try:
        dead = _dead_on_this_host(world, step, wait_s=0.0 if timed_out else DEATH_GRACE_S)
        missing = _missing(world, step, n) if n is not None else []
    except RankFailedError as err_store:
        store_gone, missing = err_store, []
        dead = _dead_on_this_host(world, step, wait_s=0.0, store=False)
    if timed_out and n is not None and store_gone is None:
        _mark_gave_up(world, n, missing)
    never = f"{rank_words(missing)} never arrived at it" if missing else ""
    if dead:
        gone = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
        parts = [f"{step} failed: {gone} died (no longer running on this host)"]
        if never:
            parts.append(never)
        return RankFailedError(
            "; ".join(parts) + f". Engine said: {said}. {FIX_FAILED}", ranks=[r for r, _ in dead]
        )
    if store_gone is not None:
        return store_gone
    if timed_out:
        who = None if n is not None else "the other members did not answer"
        if n is not None and not missing:
            who = "every rank arrived, but the check did not complete (a rank is stuck or slow)"
        return DistributedTimeoutError(step, timeout_s, missing if who is None else None,
                                       f"Engine said: {said}.", who=who)
    parts = [f"{step} failed: the connection to a peer rank broke"]
    if never:
        parts.append(never)
    else:
        parts.append("no rank on this host died, so a rank on another host probably did")
    return RankFailedError(
        "; ".join(parts) + f". Engine said: {said}. {FIX_FAILED}", ranks=missing or None
    )


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


def register(world: World) -> None:
    """Add 'rank:pid' to this host's list in the store, so that peers here can see us die.

    init_process_group() calls it once, right after joining, so that even a rank that dies
    before any check is named.
    """
    if world.engine.NAME == "fake" or world.size == 1:
        return
    world.store.append(HOST.format(host=_env.hostname()), f"{world.rank}:{os.getpid()};")


def _missing(world: World, step: str, n: int) -> list[int]:
    """Ranks that have not marked their arrival at check #n."""
    keys = [ARRIVE.format(n=n, rank=r) for r in range(world.size)]
    return _store(world, step,
                  lambda: [r for r, key in enumerate(keys) if not world.store.check([key])])


def _mark_gave_up(world: World, n: int, missing: list[int]) -> None:
    """Leave a note so that a rank arriving at check #n later fails at once."""
    note = (f"rank {world.rank} stopped waiting after {world.timeout.total_seconds():g} s; "
            f"missing then: {format_ranks(missing)}")
    with suppress(RuntimeError, OSError):  # the store is gone too: the late rank will see
        world.store.set(GAVE_UP.format(n=n), note)


def _read_host_pids(world: World) -> dict[int, int]:
    """rank -> pid of the ranks registered on this host, read from the store."""
    key = HOST.format(host=_env.hostname())
    raw = world.store.get(key) if world.store.check([key]) else b""
    pids: dict[int, int] = {}
    for item in raw.decode().split(";"):
        if item:
            rank, pid = item.split(":")
            pids[int(rank)] = int(pid)
    return pids


def _dead_on_this_host(
    world: World, step: str, wait_s: float, store: bool = True
) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks registered on this host whose process has gone.

    A peer's sockets close just before its process becomes a zombie, so when ``wait_s`` > 0
    this looks again for up to that long before answering that none died.
    """
    deadline = time.monotonic() + wait_s
    pids = world.host_pids
    if pids is None:  # a failure in the world's first check: read the list now, once
        pids = _store(world, step, lambda: _read_host_pids(world)) if store else {}
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


def _gather_requests(world: World, text: str, longest: int) -> list[dict[str, Any]]:
    """Every rank's request, in rank order, gathered as padded UTF-8 JSON bytes."""
    import torch

    from . import collectives

    mine = torch.zeros(longest, dtype=torch.uint8)
    raw = text.encode()
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    everyone = torch.zeros(world.size * longest, dtype=torch.uint8)
    collectives.all_gather_into_tensor(everyone, mine)
    return [
        json.loads(bytes(everyone[r * longest : (r + 1) * longest].tolist()).rstrip(b"\0"))
        for r in range(world.size)
    ]


def _shown(value: Any) -> str:
    """A JSON value written as Python would: lists as tuples, strings quoted."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return repr(tuples(value))


def _raise_mismatch(what: str, requests: list[dict[str, Any]]) -> None:
    """Raise one MeshMismatchError listing who passed what for the first differing field."""
    fields = sorted({key for request in requests for key in request})
    differing = [f for f in fields
                 if len({json.dumps(r.get(f), sort_keys=True) for r in requests}) > 1]
    field = differing[0] if differing else "the request"
    by_value: dict[str, list[int]] = {}
    for rank, request in enumerate(requests):
        by_value.setdefault(_shown(request.get(field)), []).append(rank)
    also = f" (also differing: {', '.join(differing[1:])})" if len(differing) > 1 else ""
    raise MeshMismatchError(f"{field} in {what}{also}", by_value)
