"""Turn engine and store failures into our errors, naming who died, who is missing, or why.

The engine says what its exception means (``Engine.classify``: a timeout, a lost peer); this
module words the error the user sees, the same for every engine:

- ``named_failures(world, step)``: a block whose engine failures become
  DistributedTimeoutError or RankFailedError naming the dead or missing ranks (creating a
  mesh's groups, exchanging host names);
- ``collective_error(world, err, what, group)``: the error for a collective that failed;
- ``store_call(world, step, call)``: one store operation, whose failure means the store's
  server (rank 0 for env:// and tcp://) has gone;
- ``diagnose(...)``: the error once a wait failed, from what is known (deaths seen on this
  host, ranks that never arrived);
- ``death_watch(world, notify)``: while a rank waits, watch the other ranks of its host
  (pids gathered at init) and report the first deaths.
"""

from __future__ import annotations

import _thread
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

from ..control import accounting, keys
from ..control.plane import Board
from ..errors import (
    FIX_FAILED,
    BackendError,
    DistributedError,
    DistributedTimeoutError,
    RankFailedError,
    rank_words,
)
from ..host import env, procfs, wire

if TYPE_CHECKING:
    from ..process_group import ProcessGroup
    from .context import JobContext

WATCH_S = 0.2  # how often a waiting rank looks for dead ranks on its host
DEATH_GRACE_S = 1.0  # a peer's socket closes a moment before its process is reaped


def fix_failed(world: JobContext) -> str:
    """The advice after a lost rank: restart the job, or what the layer that recovers from
    losses says (``Epochs.expect_losses``: recover an elastic mesh)."""
    return world.epochs.recovery_fix or FIX_FAILED


FIX_LATE = (
    "Fix: make this rank reach the call sooner (is it doing extra work or stuck before it?), "
    "or raise the limit with init_process_group(timeout=...) or TENSORPLAY_TIMEOUT; then "
    "restart the whole job."
)

T = TypeVar("T")
Dead = tuple[int, int, str]  # (rank, pid, host) of a rank whose process has gone
# tensorplay-run writes here why the job stops, when another node is lost or failed:
# {"text": "node 1 (hostB, ranks 4-7) went silent: ...", "ranks": [4, 5, 6, 7]}



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
    except Exception as err:
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
    """Run one store operation; a failure means the store's server (rank 0 for env:// and
    tcp://, the launcher of node 0 under tensorplay-run and torchrun) is gone."""
    try:
        return call()
    except (RuntimeError, OSError) as err:
        if env.agent_store_attempt() is not None:  # a launcher serves it, not a rank
            raise RankFailedError(
                f"{step} failed: the job's store cannot be reached, so the launcher serving it "
                f"(tensorplay-run or torchrun on node 0) has gone or its machine cannot be "
                f"reached. Engine said: {engine_said(err)}. {FIX_FAILED}"
            ) from err
        raise RankFailedError(
            f"{step} failed: the job's store cannot be reached, so the rank serving it "
            f"(rank 0 for env:// and tcp://) has probably exited or crashed. "
            f"Engine said: {engine_said(err)}. {FIX_FAILED}",
            ranks=[0],
        ) from err


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
        here = env.hostname()
        gone = dead_on_this_host(world, wait_s=0.0 if timed_out else DEATH_GRACE_S)
        dead = [(r, p, here) for r, p in _not_failed(world, gone)]
    if dead or gone:  # a loss seen: this rank may end next, and is not a loss itself
        _mark_failed(world)
    return _worded(world, step, said, dead, missing, store_gone, timed_out)


def _worded(world: JobContext, step: str, said: str, dead: list[Dead], missing: list[int] | None,
            store_gone: RankFailedError | None, timed_out: bool) -> DistributedError:
    """diagnose's error, from what it found."""
    never = f"{rank_words(missing)} never arrived at it" if missing else ""
    if dead:
        host = dead[0][2]
        where = "this host" if host == env.hostname() else f"host {host}"
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


@contextmanager
def death_watch(world: JobContext, notify: Callable[[list[Dead]], None],
                notify_lost: Callable[[str, list[int]], None] | None = None) -> Iterator[None]:
    """Inside the block, watch this host's other ranks; on the first deaths call
    ``notify(dead)`` once, from a watcher thread (it must not use the waiting connection).

    Under tensorplay-run, also watch for the launcher's verdict (``wire.VERDICT_FILE``): a node
    lost or a failure elsewhere calls ``notify_lost(text, ranks)`` once instead.
    """
    others = {r: p for r, p in (world.epochs.host_pids or {}).items() if r != world.rank}
    verdict_file = os.environ.get(wire.VERDICT_FILE) if notify_lost is not None else None
    if not others and not verdict_file:
        yield
        return
    stop = threading.Event()
    here = env.hostname()

    def watch() -> None:
        while not stop.wait(WATCH_S):
            dead = sorted((r, p) for r, p in others.items() if not procfs.alive(p))
            if dead:
                notify([(r, p, here) for r, p in dead])
                return
            said = read_verdict() if verdict_file and notify_lost is not None else None
            if said is not None and notify_lost is not None:
                notify_lost(said["text"], said.get("ranks") or [])
                return

    # _thread, not threading.Thread: Thread.start() blocks until the new thread has run, which
    # on a busy machine costs more than the whole check
    _thread.start_new_thread(watch, ())
    try:
        yield
    finally:
        stop.set()


def read_verdict() -> dict | None:
    """The launcher's verdict (``wire.VERDICT_FILE``), once it has written one; else None."""
    path = os.environ.get(wire.VERDICT_FILE)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # being written: not yet
        return None


def unless_told(step: str | Callable[[], str], world: JobContext, backend: str,
                call: Callable[[], T], *, within_s: float | None = None,
                stopped: Callable[[], tuple[str, list[int]] | None] | None = None) -> T:
    """``call()``, or RankFailedError with the launcher's words as soon as it writes a verdict
    (a node lost, a failure elsewhere) while the call still waits.

    A call blocked in gloo's C++ (a barrier, a group's rendezvous) cannot be woken, so under a
    multi-node tensorplay-run it runs on a helper thread while this thread watches for the
    verdict; the helper is left blocked when the verdict comes (the process is ending). Only
    for a CPU backend of an engine with a store (gloo): a CUDA call would run on a thread
    without this thread's device.

    ``within_s`` bounds the call (on one host too): a helper thread runs it, and this thread
    raises DistributedTimeoutError once ``within_s`` (and a grace for the engine's own error,
    ``_bound``) has passed, or RankFailedError as soon as ``stopped()`` says why the call is
    pointless and which ranks that names (a recovery began elsewhere; a member died). For a
    group made as an elastic mesh grows: gloo's rendezvous with a peer that gave up can
    outlast its own timeout (seen: two fresh ranks 120 s in ``ProcessGroupGloo()`` made with
    a 30 s timeout), and the members recover without them meanwhile. The abandoned helper
    stays blocked, or fails on its own.
    """
    engine = world.engine
    watched = bool(os.environ.get(wire.VERDICT_FILE)) or within_s is not None
    if (not watched or not engine.capabilities.has_store
            or engine.backend_for_device("cpu", backend) != backend):
        return call()
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = err
        finally:
            done.set()

    def what() -> str:
        return step() if callable(step) else step

    def told(said: dict) -> RankFailedError:
        err = RankFailedError(f"{what()} failed: {said['text']}. {FIX_FAILED}",
                              ranks=said.get("ranks") or None)
        err.told = True  # named_failures passes it on as it is
        return err

    _thread.start_new_thread(run, ())
    began, pause = time.monotonic(), 0.0005
    while not done.wait(pause):
        said = read_verdict()
        if said is not None:
            raise told(said)
        why = stopped() if stopped is not None else None
        if why is not None:
            raise RankFailedError(f"{what()} failed: {why[0]}. {fix_failed(world)}",
                                  ranks=why[1] or None)
        if within_s is not None and time.monotonic() - began > _bound(within_s):
            raise DistributedTimeoutError(what(), within_s, None,
                                          who="the group's members did not all connect")
        pause = min(pause * 2, WATCH_S)
    if "error" in box:
        # a peer that read the verdict first and ended breaks this call's connection: the
        # verdict, not that peer, is why it failed
        said = read_verdict()
        if said is not None:
            raise told(said) from box["error"]
        raise box["error"]
    return box["value"]


def _bound(within_s: float) -> float:
    """How long ``unless_told`` lets a call bounded by ``within_s`` run: 10% and 1 s more,
    so that the engine's own error, which says more, comes first when the engine keeps to
    the bound (30 s -> 34 s)."""
    return within_s * 1.1 + 1.0


def _not_failed(world: JobContext, gone: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of the ranks gone from this host, those that did not end after raising RankFailedError
    themselves (``_mark_failed``): on a (2, 4) mesh where rank 5 died, rank 4 raises naming 5
    and ends; rank 0, whose dp peer is 4, fails after that and finds 4 and 5 gone, but only 5
    died. Keeps every rank it cannot ask about (a control plane that is no Board, or the store
    gone)."""
    control = world.control
    if not gone or not isinstance(control, Board):
        return gone
    try:
        with control.briefly():
            marks = control.peek([world.spmd.key(keys.FAILED, rank=r) for r, _ in gone])
    except (RuntimeError, OSError, AttributeError):  # the store died with the rank serving
        return gone  # it, or a store without timeouts
    return [pair for pair, mark in zip(gone, marks, strict=True) if mark is None]


def _mark_failed(world: JobContext) -> None:
    """Say on the control plane's board that this rank raised RankFailedError, before it may
    end (read by ``_not_failed`` on the ranks of its host)."""
    control = world.control
    if not isinstance(control, Board):
        return
    with suppress(RuntimeError, OSError, AttributeError), control.briefly():
        control.post(world.spmd.key(keys.FAILED, rank=world.rank), "1")


def dead_on_this_host(world: JobContext, wait_s: float) -> list[tuple[int, int]]:
    """(rank, pid) of the other ranks of this host whose process has gone.

    A peer's sockets close just before its process becomes a zombie, so when ``wait_s`` > 0
    this looks again for up to that long before answering that none died.
    """
    deadline = time.monotonic() + wait_s
    pids = world.epochs.host_pids or {}
    while True:
        dead = sorted((r, p) for r, p in pids.items() if r != world.rank and not procfs.alive(p))
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)
