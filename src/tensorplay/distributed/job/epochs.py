"""What a world learns as its ranks come and go, in one object: ``Epochs``.

A static job never changes it after init: every rank takes part, this host's pids are those
met at ``init_process_group``, nothing was admitted or severed, no layer keeps anything. An
elastic mesh (the layer over the core, ``elastic/``) changes it through the methods below and
through ``World.open_epoch``/``World.sever_epoch``; the failure wording and the death watch
(``job/failures.py``) read it.

Worked example, rank 0 of an (2, 4) elastic "dp" job whose rank 5 died and came back as
process 4242 under launcher instance "1.2": after the shrink ``present`` is [0, 1, 2, 3]
(one slice left), after the grow [0, ..., 7]; ``admitted_from`` is {5: "1.2"}, so a loss of
node 1's first launcher ("1.1") no longer names rank 5; ``host_pids[5]`` is 4242 where rank
5 runs on rank 0's host; ``recovery_fix`` advises ``mesh.recover(err)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Epochs:
    """Who takes part, where they run, what was admitted and severed, and what a layer over
    the core keeps in this world (see the module docstring). Only ``World`` and these
    methods write it."""

    def __init__(self, host_pids: dict[int, int] | None) -> None:
        self.present: list[int] | None = None  # ranks still in the job after an epoch change
        self.severed = -1  # the newest epoch whose groups World.sever_epoch broke
        # rank -> pid of this host's ranks, met at init: naming a dead peer must not need
        # the store, which dies with rank 0 (often just after its error)
        self.host_pids = host_pids
        # rank -> launcher instance ("1.2") of a process admitted in its place: a loss of
        # node 1's first launcher ("1.1") no longer names that rank (host/wire.py)
        self.admitted_from: dict[int, str] = {}
        self.recovery_fix: str | None = None  # a layer's advice after a lost rank
        self._kept: dict[str, Any] = {}
        self._at_destroy: list[Callable[[], None]] = []

    def layer(self, name: str, make: Callable[[], T]) -> T:
        """The state a layer over the core keeps in this world under ``name``, made by
        ``make()`` on first use (the elastic layer's session, one per world)."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]

    def at_destroy(self, call: Callable[[], None]) -> None:
        """Run ``call()`` at destroy_process_group(), before the call counts are compared
        (a store error in it is ignored: the job is ending)."""
        self._at_destroy.append(call)

    def calls_at_destroy(self) -> tuple[Callable[[], None], ...]:
        """What ``at_destroy`` was given, in order."""
        return tuple(self._at_destroy)

    def expect_losses(self, fix: str) -> None:
        """A layer recovers from lost ranks here: errors naming a loss advise ``fix``, and a
        collective that lost a peer is not blamed on a stray call."""
        self.recovery_fix = fix

    def admit(self, rank: int, pid: int, on_this_host: bool, instance: str) -> None:
        """``rank`` now runs as process ``pid`` started by launcher ``instance`` ("1.2"; ""
        outside a multi-node tensorplay-run): on this host the death watch looks at it, and
        a loss of another launcher instance no longer names it."""
        if instance:
            self.admitted_from[rank] = instance
        if on_this_host and self.host_pids is not None:
            self.host_pids[rank] = pid
