"""The groups of one epoch: registered once, found by their ordered ranks and backend.

A world holds one ``GroupRegistry`` per epoch and swaps it whole when the epoch changes
(``World.open_epoch``): nothing of an old epoch is found again. On a (2, 4) mesh ("dp", "tp")
of epoch 0, rank 5's registry holds the world group, the "dp" group [1, 5] and the "tp" group
[4, 5, 6, 7], keyed by (ranks, backend); a second mesh over the same world finds them there
instead of making new ones (a group of a view may wait for its first use to have its engine
group made: ``World.group``). Beside the groups it keeps which mesh dims asked for each
("'ep' of (pp, dp_replicate, efsdp, ep)", for ``describe()``) and what is derived from them in
this epoch: the flattened dim names of each root mesh and the engine's own meshes (torch's
DeviceMesh) made over them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..backends.protocol import Severable
    from ..geometry.spec import Ranks
    from ..process_group import ProcessGroup


class GroupRegistry:
    """The groups of one epoch, the flattened names of its root meshes, its engine meshes."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.created = 0  # groups this rank helped create (not counting the world's)
        self.released = False  # the world ended (``release``)
        self._groups: dict[tuple, ProcessGroup] = {}
        self._uses: dict[tuple, list[str]] = {}  # key -> the mesh dims that asked for it
        self._flattened: dict[tuple, dict[str, tuple]] = {}
        self._native: dict[Hashable, Any] = {}
        # sever (the elastic watcher's thread) and retire (the main thread) one at a time, so
        # that a group is never severed after it was closed
        self._breaking = threading.Lock()

    def find(self, ranks: Ranks, backend: str) -> ProcessGroup | None:
        """The group registered for ``ranks`` (in this order) on ``backend``, or None."""
        return self._groups.get((ranks.key(), backend))

    def add(self, group: ProcessGroup) -> ProcessGroup:
        """Register ``group`` under its ordered ranks and backend (in place of one registered
        there before) and return it."""
        self._groups[_key(group)] = group
        return group

    def note_use(self, group: ProcessGroup, use: str) -> None:
        """Remember that ``use`` (a mesh dim: "'ep' of (pp, dp_replicate, efsdp, ep)") asked
        for ``group``; each use once, in order."""
        uses = self._uses.setdefault(_key(group), [])
        if use not in uses:
            uses.append(use)

    def uses(self, group: ProcessGroup) -> list[str]:
        """The uses noted for ``group`` (for its ranks and backend) in this epoch, oldest
        first: the world group's first is "the world"."""
        return list(self._uses.get(_key(group), ()))

    def groups(self) -> list[ProcessGroup]:
        """Every group of this epoch, the world group included: a copy made in one C call,
        so another thread may read it while this one adds or releases groups (the launcher's
        beat thread in each rank does: launcher/rank_main._collectives_made)."""
        return list(self._groups.values())

    def register_flatten(self, root_key: tuple, name: str, dims: tuple) -> None:
        """Remember that ``name`` flattens ``dims`` of the root mesh with ``root_key``."""
        self._flattened.setdefault(root_key, {})[name] = dims

    def flattened_names(self, root_key: tuple) -> dict[str, tuple]:
        """Flattened dim names registered for a root mesh."""
        return self._flattened.get(root_key, {})

    def native_mesh(self, mesh: Hashable, make: Callable[[], Any]) -> Any:
        """The engine's own mesh object for ``mesh`` (a DeviceMesh value), made once."""
        found = self._native.get(mesh)
        if found is None:
            found = self._native[mesh] = make()
        return found

    def sever(self, epoch: int, engine: Severable, keep: ProcessGroup) -> None:
        """Break the connections of every group of this registry made and not retired but
        ``keep`` (the world's), if it is ``epoch``'s: from the elastic watcher's thread, a
        recovery of ``epoch`` having begun elsewhere. A group closed meanwhile by ``retire``
        (the main thread's recovery) is retired, so left alone; an engine's error (a bug: a
        ``Severable`` engine breaks a broken group without one) is raised."""
        with self._breaking:
            if self.epoch != epoch:
                return
            for group in list(self._groups.values()):  # the main thread may add one
                engine_group = group.made_engine_group()  # not made: nothing to break
                if engine_group is not None and not group.retired and group is not keep:
                    engine.sever(engine_group)

    def retire(self, why: str, engine: Severable | None, sever: bool,
               keep: ProcessGroup) -> list[Any]:
        """Retire every group (later use: StaleEpochError ending "... ``why``"); close the
        engine groups of all but ``keep`` (the world's) on a ``Severable`` engine, after
        breaking their connections when ``sever``. Returns those engine groups, whose last
        references the caller drops (``World.let_go``). An engine's error is raised: a
        ``Severable`` engine breaks and closes a group already broken without one, and a
        group that stays open would leave its peers blocked with nothing said."""
        self._native.clear()  # the engine's meshes hold our groups' engine groups
        closed = []
        with self._breaking:
            for group in self._groups.values():
                if group.retired:
                    continue
                engine_group = group.retire(why)
                if engine_group is None or group is keep:
                    continue
                closed.append(engine_group)
                if engine is None:  # an engine that cannot sever or close a group: retired only
                    continue
                if sever:
                    engine.sever(engine_group)
                engine.close_group(engine_group)
        return closed

    def release(self) -> None:
        """The world ends: every group stops working, and nothing is found again."""
        self.released = True
        for group in self._groups.values():
            group.release()
        self._groups.clear()
        self._uses.clear()
        self._native.clear()


def _key(group: ProcessGroup) -> tuple:
    """Where ``group`` is registered: its ordered ranks' key and its backend."""
    return group.rank_seq.key(), group.backend
