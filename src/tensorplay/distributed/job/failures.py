"""Turn engine and store failures into our errors, naming who died, who is missing, or why.

The engine says what its exception means (``Engine.classify``: a timeout, a lost peer); this
module words the error the user sees, the same for every engine:

- ``named_failures(world, step)``: a block whose engine failures become
  DistributedTimeoutError or RankFailedError naming the dead or missing ranks (creating a
  mesh's groups, exchanging host names);
- ``collective_error(world, err, what, group)``: the error for a collective that failed;
- ``store_call(world, step, call)``: one store operation, whose failure (``StoreFailed``,
  judged by the engine) means the store's server (rank 0 for env:// and tcp://) has gone;
- ``diagnose(...)``: the error once a wait failed, from what is known (deaths seen on this
  host, ranks that never arrived, the failed marks of ranks that only raised: ``watch``).

What a waiting rank watches meanwhile (this host's ranks, the launcher's verdict) is
``job/watch.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..backends.protocol import StoreFailed, StoreGone, StoreTimedOut
from ..control import accounting
from ..errors import (
    FIX_FAILED,
    BackendError,
    DistributedError,
    DistributedTimeoutError,
    RankFailedError,
    rank_words,
)
from ..host import knobs, launchers, wire
from .watch import Dead, dead_on_this_host, fix_failed, mark_failed, not_failed

if TYPE_CHECKING:
    from ..process_group import ProcessGroup
    from .context import JobContext

DEATH_GRACE_S = 1.0  # a peer's socket closes a moment before its process is reaped
FIX_LATE = (
    "Fix: make this rank reach the call sooner (is it doing extra work or stuck before it?), "
    "or raise the limit with init_process_group(timeout=...) or TENSORPLAY_TIMEOUT; then "
    "restart the whole job."
)


def engine_said(err: BaseException) -> str:
    """The first line of the engine's message under ``err``, without its source location."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    lines = str(root).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(root).__name__
    return first[:240]


@contextmanager
def named_failures(world: JobContext, step: str) -> Iterator[None]:
    """Inside the block, turn engine and store failures into our errors naming the lost ranks.

    For work that follows a check, such as creating a mesh's groups:
    ``with named_failures(world, "creating the group of mesh dim 'tp'"): ...``.
    A timeout becomes DistributedTimeoutError; a broken connection, or a timeout while a peer
    on this host is dead, becomes RankFailedError naming it.
    """
    try:
        yield
    except (DistributedTimeoutError, RankFailedError) as err:
        if getattr(err, "told", False):  # the launcher's verdict says it all
            raise
        raise diagnose(world, step, err, isinstance(err, DistributedTimeoutError)) from err
    except DistributedError:
        raise
    except StoreFailed as err:  # the host exchange's store calls
        gone = store_unreachable(world, step, err) if isinstance(err, StoreGone) else None
        raise diagnose(world, step, err, isinstance(err, StoreTimedOut),
                       store_gone=gone) from err
    except Exception as err:  # noqa: BLE001 - the engine's errors worded; any other re-raised
        kind = world.engine.classify(err)
        if kind is None:
            raise
        raise diagnose(world, step, err, kind == "timeout") from err


def collective_error(world: JobContext, err: BaseException, what: str,
                     group: ProcessGroup) -> Exception:
    """The error for collective ``what`` on ``group`` that failed with the engine's ``err``."""
    kind = world.engine.classify(err)
    said = engine_said(err)
    where = f"{what} on {group.label}"
    # peers that finished left this call waiting? A call count that differs says so (not
    # where a layer recovers from losses: there a loss is expected)
    if kind in ("peer_lost", "timeout") and world.epochs.recovery_fix is None:
        stray = accounting.check_after_failure(world, group)
        if stray is not None:
            return stray
    if kind == "timeout":
        return DistributedTimeoutError(where, world.timeout.total_seconds(), None,
                                       f"Engine said: {said}")
    if kind == "peer_lost":  # name the dead if they ran on this host
        return diagnose(world, where, err, timed_out=False)
    return BackendError(f"{where} failed: {str(err)[:500]}")


def store_call(world: JobContext, step: str, call: Callable[[], Any]) -> Any:
    """Run one store operation (a post, a check: no wait); its failure (``StoreFailed``)
    means the store's server is gone, worded by ``store_unreachable``."""
    try:
        return call()
    except StoreFailed as err:
        raise store_unreachable(world, step, err) from err


def store_unreachable(world: JobContext, step: str, err: StoreFailed) -> RankFailedError:
    """The error of ``step``, whose store call failed: the store's server is gone (rank 0
    for env:// and tcp://, naming it; the launcher of node 0 under tensorplay-run and
    torchrun)."""
    if launchers.agent_store_attempt() is not None:  # a launcher serves it, not a rank
        return RankFailedError(
            f"{step} failed: the job's store cannot be reached, so the launcher serving it "
            f"(tensorplay-run or torchrun on node 0) has gone or its machine cannot be "
            f"reached. Engine said: {engine_said(err)}. {FIX_FAILED}")
    return RankFailedError(
        f"{step} failed: the job's store cannot be reached, so the rank serving it "
        f"(rank 0 for env:// and tcp://) has probably exited or crashed. "
        f"Engine said: {engine_said(err)}. {FIX_FAILED}",
        ranks=[0])


def diagnose(
    world: JobContext,
    step: str,
    err: BaseException | None,
    timed_out: bool,
    *,
    dead: list[Dead] | None = None,
    missing: list[int] | None = None,
    store_gone: RankFailedError | None = None,
) -> DistributedError:
    """The error to raise when ``step`` failed: who died, who never arrived, or who is slow.

    ``dead`` comes from a death notice; else this host's ranks are looked at. ``missing``
    lists the ranks that never arrived, None when nobody counted arrivals (outside a check).
    """
    said = f" Engine said: {engine_said(err)}." if err is not None else ""
    gone: list[tuple[int, int]] = []
    if dead is None:
        here = knobs.hostname()
        gone = dead_on_this_host(world, wait_s=0.0 if timed_out else DEATH_GRACE_S)
        dead = [(r, p, here) for r, p in not_failed(world, gone)]
    if dead or gone:  # a loss seen: this rank may end next, and is not a loss itself
        mark_failed(world)
    return _worded(world, step, said, dead, missing, store_gone, timed_out)


def _worded(world: JobContext, step: str, said: str, dead: list[Dead], missing: list[int] | None,
            store_gone: RankFailedError | None, timed_out: bool) -> DistributedError:
    """diagnose's error, from what it found."""
    never = f"{rank_words(missing)} never arrived at it" if missing else ""
    if dead:
        host = dead[0][2]
        where = "this host" if host == knobs.hostname() else f"host {host}"
        gone = ", ".join(f"rank {r} (pid {pid})" for r, pid, _ in dead)
        parts = [f"{step} failed: {gone} died (no longer running on {where})"]
        if never:
            parts.append(never)
        return RankFailedError("; ".join(parts) + f".{said} {fix_failed(world)}",
                               ranks=[r for r, _, _ in dead])
    if store_gone is not None:
        return store_gone
    if timed_out:
        if missing is None:
            who = "the other members did not answer"
        elif not missing:
            who = "every rank arrived, but the check did not complete (a rank is stuck or slow)"
        else:
            who = None
        return DistributedTimeoutError(step, world.timeout.total_seconds(), missing,
                                       said.strip(), who=who)
    parts = [f"{step} failed: the connection to a peer rank broke"]
    loss = wire.naming(world.members(), world.epochs.admitted_from)  # a node lost (elastic)
    if never:
        parts.append(never)
    elif loss is not None:
        parts.append(loss["text"])
    elif world.engine.capabilities.has_store:  # else the engine said who it lost
        parts.append("no rank on this host died, so a rank on another host probably did")
    return RankFailedError("; ".join(parts) + f".{said} {fix_failed(world)}",
                           ranks=missing or (loss["ranks"] if loss is not None else None))
