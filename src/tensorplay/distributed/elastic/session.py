"""What an elastic job keeps in one world: the newest mesh's shape, the watcher, the finish.

One ``Session`` per world, attached through the world's ``epochs`` and nothing else:
``Epochs.layer("elastic", ...)`` holds it, ``Epochs.at_destroy`` runs its ``finish`` and
``Epochs.expect_losses`` tells the failure wording that a lost rank is recovered here, not
fatal (``_failures`` then advises ``mesh.recover(err)`` and compares no call counts).

The watcher: when a recovery of the current epoch begins anywhere, or the launcher says a
node holding members of it was lost (``_losses``; not members admitted since from a new
launcher of that node, which this rank's launcher may hear of only after they joined), it
breaks this rank's groups of that epoch (``World.sever_epoch``). A rank blocked in a
collective whose peer never comes (stalled, or blocked itself) then fails at once and comes
to the recovery, instead of waiting out its timeout and being declared lost. One peek on its
own store connection every WATCH_S (x world size / 1,000): 40 requests a second at the store
for 8 ranks, 5,000 for 100,000 ranks (every 20 s each).
"""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..control import keys
from ..host import env, wire
from ..host.wire import Recovery
from .chain import board_of, finish

if TYPE_CHECKING:
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
        world.epochs.at_destroy(self.finish)
        world.epochs.expect_losses(FIX_ELASTIC)
        self._watch()

    def entered(self, decision: dict[str, Any]) -> None:
        """This rank entered the epoch ``decision`` opens: its shape is the newest, and the
        processes it admitted on this host are the ones the death watch looks at."""
        self.shape = tuple(decision["shape"])
        for rank, who in decision.get("admitted", {}).items():
            pid, host = who.split()[:2]
            self._world.epochs.admit(int(rank), int(pid), host == env.hostname(),
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
        with suppress(RuntimeError, OSError):
            finish(board_of(world), world.spmd.epoch, self.shape, list(world.members()))

    def _watch(self) -> None:
        world = self._world
        board = board_of(world).clone()
        every = WATCH_S * max(1.0, world.size / 1000)

        def run() -> None:
            while world.alive:
                epoch = world.spmd.epoch
                with suppress(Exception):  # the store gone: the main thread will say so
                    loss = wire.naming(world.members(), world.epochs.admitted_from)
                    if loss is not None:  # a node lost: whoever is blocked with it is freed
                        board.decide(keys.ELASTIC_RECOVERING.format(epoch=epoch),
                                     f"{world.rank} {loss['text']}")
                    if board.peek([keys.ELASTIC_RECOVERING.format(epoch=epoch)])[0]:
                        world.sever_epoch(epoch)
                        while world.alive and world.spmd.epoch == epoch:
                            time.sleep(every)
                        continue
                time.sleep(every)

        threading.Thread(target=run, daemon=True, name="tensorplay elastic watch").start()


def session_of(world: World) -> Session:
    """The world's elastic session, made (and its watcher started) on first use."""
    return world.epochs.layer("elastic", lambda: Session(world))
