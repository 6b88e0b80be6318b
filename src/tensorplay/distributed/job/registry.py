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

from collections.abc import Callable, Hashable
from contextlib import suppress
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
        """Every group of this epoch, the world group included."""
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

    def retire(self, why: str, engine: Severable | None, sever: bool,
               keep: ProcessGroup) -> list[Any]:
        """Retire every group (later use: StaleEpochError ending "... ``why``"); close the
        engine groups of all but ``keep`` (the world's) on a ``Severable`` engine, after
        breaking their connections when ``sever``. Returns those engine groups, whose last
        references the caller drops (``World.let_go``)."""
        self._native.clear()  # the engine's meshes hold our groups' engine groups
        closed = []
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
                with suppress(Exception):  # a group already broken breaks as it can
                    engine.sever(engine_group)
            with suppress(Exception):  # and closes as it can
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
