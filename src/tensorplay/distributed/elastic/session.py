"""What an elastic job keeps in one world: the newest mesh's shape, the watcher, the finish.

One ``Session`` per world, attached through the world's ``epochs`` and nothing else:
``Epochs.layer("elastic", ...)`` holds it, ``Epochs.at_destroy`` runs its ``finish`` and
``Epochs.expect_losses`` tells the failure wording that a lost rank is recovered here, not
fatal (``job/failures.py`` then advises ``mesh.recover(err)`` and compares no call counts).

The watcher: when a recovery of the current epoch begins anywhere, or the launcher says a
node holding members of it was lost (``wire.naming``; not members admitted since from a new
launcher of that node, which this rank's launcher may hear of only after they joined), it
breaks this rank's groups of that epoch (``World.sever_epoch``). A rank blocked in a
collective whose peer never comes (stalled, or blocked itself) then fails at once and comes
to the recovery, instead of waiting out its timeout and being declared lost. One peek on its
own store connection every WATCH_S (x world size / 1,000): 40 requests a second at the store
for 8 ranks, 5,000 for 100,000 ranks (every 20 s each). A store that fails it passes over
(the main thread's next call says so); any other error stops it, said at once on stderr
(``job/watch.reported``), and this rank's next ``recover()`` or ``grow()`` raises it, its
groups broken so that a call blocked meanwhile fails at once and comes there: within a
WATCH_S, not the world's timeout.
"""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..backends.protocol import StoreFailed
from ..control import keys
from ..host import knobs, wire
from ..host.wire import Recovery
from ..job.watch import reported
from . import shrinking
from .chain import board_of, finish

if TYPE_CHECKING:
    from ..control.plane import Board
    from ..job.world import World

WATCH_S = 0.2  # how often each rank looks for a recovery begun elsewhere (per 1,000 ranks)
FIX_ELASTIC = (
    "Fix: on an elastic mesh, call mesh = mesh.recover(err) on every survivor; it agrees on "
    "the lost ranks and goes on without them."
)


class Session:
    """The elastic state of one world (see the module docstring)."""

    def __init__(self, world: World):
        self._world = world
        self.shape: tuple[int, ...] | None = None  # the newest elastic mesh's shape
        self.recoveries: list[Recovery] = []  # one per epoch change this rank went through
        self._tells = False  # this rank sends the records to tensorplay-run (see record)
        self._watcher_died: tuple[BaseException, float] | None = None  # (error, when)
        world.epochs.at_destroy(self.finish)
        world.epochs.expect_losses(FIX_ELASTIC)
        if shrinking.engine_of(world) is None:  # a shrinking engine revokes; nothing to watch
            self._watch()

    def entered(self, decision: dict[str, Any]) -> None:
        """This rank entered the epoch ``decision`` opens: its shape is the newest, and the
        processes it admitted on this host are the ones the death watch looks at."""
        self.shape = tuple(decision["shape"])
        for rank, who in decision.get("admitted", {}).items():
            pid, host = who.split()[:2]
            self._world.epochs.admit(int(rank), int(pid), host == knobs.hostname(),
                                     wire.instance_of(who))

    def record(self, recovery: Recovery, first: bool) -> None:
        """Keep what an epoch change cost; the first rank of the new mesh (``first``) also
        sends it to tensorplay-run for its closing summary, and later its sync time."""
        self.recoveries.append(recovery)
        self._tells = first
        if first:
            wire.tell_launcher("recovery", record=recovery.to_json())

    def recovery_of(self, epoch: int) -> Recovery | None:
        """The record of the change that opened ``epoch`` (None at epoch 0)."""
        return next((r for r in reversed(self.recoveries) if r.epoch == epoch), None)

    def synced(self, epoch: int, seconds: float) -> None:
        """sync_replicas filled the fresh ranks of ``epoch`` in ``seconds``."""
        recovery = self.recovery_of(epoch)
        if recovery is None:
            return
        recovery.sync_s = (recovery.sync_s or 0.0) + seconds
        if self._tells:
            wire.tell_launcher("recovery", record=recovery.to_json())

    def finish(self) -> None:
        """At destroy_process_group(), on a member: ranks still waiting to join get the last
        mesh, which does not hold them, and leave."""
        world = self._world
        if self.shape is None or world.rank not in world.members():
            return
        if shrinking.engine_of(world) is not None:
            shrinking.finish(world, world.spmd.epoch)
            return
        with suppress(StoreFailed):  # the store is gone: nobody waits on it to join
            finish(board_of(world), world.spmd.epoch, self.shape, list(world.members()))

    def watching(self, call: str) -> None:
        """Raise in ``call`` (``recover()``, ``grow()``, on the main thread) once the watcher
        has stopped on an unexpected error (said on stderr as it stopped): without it a
        recovery begun elsewhere no longer breaks this rank's calls, so this rank would
        wait out the world's timeout in the next one and be declared lost. The error names
        the watcher's, which is its cause."""
        died = self._watcher_died
        if died is None:
            return
        err, when = died
        raise RuntimeError(
            f"{call}: rank {self._world.rank}'s elastic watcher stopped "
            f"{time.monotonic() - when:.1f} s ago on an unexpected error "
            f"({type(err).__name__}: {err}), so a recovery begun elsewhere can no longer free "
            "this rank's calls; it must leave the job (the others recover without it). Fix: "
            "this is a bug of tensorplay.distributed (or of code patched into it): report "
            "it with the traceback said then") from err

    def _watch(self) -> None:
        world = self._world
        board = board_of(world).clone()
        every = WATCH_S * max(1.0, world.size / 1000)
        threading.Thread(target=reported("the elastic watcher", world.rank,
                                         lambda: self._look(board, every), self._died),
                         daemon=True, name="tensorplay elastic watch").start()

    def _look(self, board: Board, every: float) -> None:
        """The watcher's loop (see the module docstring), until the world ends."""
        world = self._world
        while world.alive:
            epoch = world.spmd.epoch
            try:
                began = self._began(board, epoch)
            except StoreFailed:  # the store is gone: the main thread's next call says so
                began = False
            if began:
                world.sever_epoch(epoch)
                while world.alive and world.spmd.epoch == epoch:
                    time.sleep(every)
                continue
            time.sleep(every)

    def _began(self, board: Board, epoch: int) -> bool:
        """Whether a recovery of ``epoch`` began: anywhere (its mark), or here and now (a
        node holding members of it lost: whoever is blocked with them is freed)."""
        world = self._world
        key = keys.ELASTIC_RECOVERING.format(epoch=epoch)
        loss = wire.naming(world.members(), world.epochs.admitted_from)
        if loss is not None:
            board.decide(key, f"{world.rank} {loss['text']}")
        return bool(board.peek([key])[0])

    def _died(self, err: BaseException) -> None:
        """The watcher stopped on ``err`` (said already): the main thread learns it at its
        next ``recover()`` or ``grow()`` (``watching``), and a call of this epoch blocked now,
        or made next, fails at once (its groups broken), bringing it there."""
        self._watcher_died = (err, time.monotonic())
        self._world.sever_epoch(self._world.spmd.epoch)


def session_of(world: World) -> Session:
    """The world's elastic session, made (and its watcher started) on first use."""
    return world.epochs.layer("elastic", lambda: Session(world))
