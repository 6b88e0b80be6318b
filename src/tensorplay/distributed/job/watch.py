"""What a rank watches while it waits: this host's other ranks, the launcher's verdict, the
Board's failed marks.

A rank blocked in a wait cannot look around; a thread beside it does, or the wait runs on a
helper thread while this one looks:

- ``death_watch(world, notify, notify_lost)``: the other ranks of this host (pids gathered at
  init), every WATCH_S; on the first deaths ``notify(dead)`` once, from the watcher thread;
  under tensorplay-run also the launcher's verdict file (``read_verdict``), then
  ``notify_lost(text, ranks)`` once;
- ``unless_told(step, world, backend, call)``: a call blocked in gloo's C++ (a barrier, a
  group's rendezvous) run on a helper thread, given up as soon as the launcher writes a
  verdict, a bound passes or ``stopped()`` says why;
- ``dead_on_this_host(world, wait_s)``: which of this host's other ranks have gone;
- the failed marks on the control plane's Board: a rank that raised RankFailedError says so
  (``mark_failed``) before it may end, so that a host-mate finding it gone does not name it
  as a second death (``not_failed``);
- ``reported(where, rank, body)``: the body of a thread of ours that must not end unheard
  (the death watch, the barrier arrival marks, the elastic watcher): an error nothing
  expected is said once, the same way for every such thread (``report_thread_error``).

The wording of the errors these lead to is ``job/failures.py``.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.protocol import StoreFailed
from ..control import keys
from ..control.plane import Board
from ..errors import FIX_FAILED, DistributedTimeoutError, RankFailedError
from ..host import knobs, procfs, wire

if TYPE_CHECKING:
    from .context import JobContext

log = logging.getLogger("tensorplay.distributed")
WATCH_S = 0.2  # how often a waiting rank looks for dead ranks on its host
T = TypeVar("T")
Dead = tuple[int, int, str]  # (rank, pid, host) of a rank whose process has gone
# tensorplay-run writes here why the job stops, when another node is lost or failed:
# {"text": "node 1 (hostB, ranks 4-7) went silent: ...", "ranks": [4, 5, 6, 7]}


def report_thread_error(where: str, err: BaseException, rank: int) -> str:
    """Say once that ``where``, a thread of ours, stopped on ``err``, which nothing of ours
    expected; returns the line said.

    The same for every such thread: one line naming the rank, the thread and the error, with
    its traceback, at ERROR on the ``tensorplay.distributed`` logger ("rank 3: the elastic
    watcher stopped on an unexpected error: ZeroDivisionError: division by zero"). Where the
    program set up no logging, logging's last resort prints it to stderr; where it did (to a
    file, say), the line is printed to stderr as well, so that a rank's stderr, which
    tensorplay-run shows, always says it.
    """
    said = f"rank {rank}: {where} stopped on an unexpected error: {type(err).__name__}: {err}"
    log.error("%s", said, exc_info=(type(err), err, err.__traceback__))
    if log.hasHandlers():
        print(f"tensorplay.distributed: {said} (its traceback is in the log)", file=sys.stderr,
              flush=True)
    return said


def reported(where: str, rank: int, body: Callable[[], None],
             died: Callable[[BaseException], None] | None = None) -> Callable[[], None]:
    """``body`` as the target of a thread of ours that must not end unheard: an error it
    raises is said (``report_thread_error``), then handed to ``died`` where the thread's job
    matters to the main thread (the elastic watcher's: ``Session``). The one place such a
    thread catches every error; what a thread expects (the store gone: ``StoreFailed``) it
    catches itself, by name."""
    def run() -> None:
        try:
            body()
        except Exception as err:  # noqa: BLE001 - said, the same way for every such thread
            report_thread_error(where, err, rank)
            if died is not None:
                died(err)
    return run


def fix_failed(world: JobContext) -> str:
    """The advice after a lost rank: restart the job, or what the layer that recovers from
    losses says (``Epochs.expect_losses``: recover an elastic mesh). Here, where the errors of
    ``unless_told`` end with it; ``failures`` words the others with it too."""
    return world.epochs.recovery_fix or FIX_FAILED


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
    here = knobs.hostname()

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
    _thread.start_new_thread(reported("the death watch", world.rank, watch), ())
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


def not_failed(world: JobContext, gone: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of the ranks gone from this host, those that did not end after raising RankFailedError
    themselves (``mark_failed``): on a (2, 4) mesh where rank 5 died, rank 4 raises naming 5
    and ends; rank 0, whose dp peer is 4, fails after that and finds 4 and 5 gone, but only 5
    died. Keeps every rank it cannot ask about (a control plane that is no Board, or the store
    gone)."""
    control = world.control
    if not gone or not isinstance(control, Board):
        return gone
    try:
        with control.briefly():
            marks = control.peek([world.spmd.key(keys.FAILED, rank=r) for r, _ in gone])
    except StoreFailed:  # the store died with the rank serving it
        return gone
    return [pair for pair, mark in zip(gone, marks, strict=True) if mark is None]


def mark_failed(world: JobContext) -> None:
    """Say on the control plane's board that this rank raised RankFailedError, before it may
    end (read by ``not_failed`` on the ranks of its host)."""
    control = world.control
    if not isinstance(control, Board):
        return
    with suppress(StoreFailed), control.briefly():  # the store is gone: nobody reads it
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
