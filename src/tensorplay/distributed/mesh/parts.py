"""What a DeviceMesh is made of: ``MeshParts``, the value's fields in one frozen record.

This is the declared interface of the layers over the mesh: ``mesh/views.py`` and
``mesh/native.py`` compute new parts from a mesh's parts, ``device_mesh.py`` and
``elastic/mesh.py`` build theirs, and ``DeviceMesh.of(parts)`` makes the mesh. None of them
reads a private field of a mesh; a mesh's own fields are written once, when it is made.

On rank 5 of an 8-rank gloo world, ``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp",
"tp"))`` is made of: ``world`` that World, ``device`` 'cpu', ``spec`` the (2, 4) MeshSpec,
``root`` the same spec (``mesh["tp"]``'s root is still this (2, 4) spec), ``backends``
('gloo', 'gloo'), ``groups`` rank 5's "dp" group [1, 5] and "tp" group [4, 5, 6, 7],
``roles`` (None, None) and ``eager`` False (the meshes made from it make their groups at
first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import NotAMemberError, NotInitializedError
from ..geometry.roles import Roles
from ..geometry.spec import MeshSpec

if TYPE_CHECKING:
    from ..job.world import World
    from ..process_group import ProcessGroup


@dataclass(frozen=True, eq=False)
class MeshParts:
    """A mesh's fields. ``groups``: this rank's group per dim, in dim order, () when the mesh
    does not hold it; ``roles``: one role (or None) per dim; ``eager``: the meshes made from
    this one make their groups at once (else at first use). Equality is the mesh's
    (``DeviceMesh.__eq__``), not this record's."""

    world: World
    device: str
    spec: MeshSpec
    root: MeshSpec
    backends: tuple[str, ...]
    groups: tuple[ProcessGroup, ...]
    roles: Roles
    eager: bool

    @classmethod
    def root_of(cls, world: World, device: str, spec: MeshSpec, backends: tuple[str, ...],
                groups: tuple[ProcessGroup, ...]) -> MeshParts:
        """A root mesh without roles whose views make their groups at first use: a mesh over
        groups made elsewhere (``from_group``, ``from_torch``), a root rebuilt for torch."""
        return cls(world, device, spec, spec, backends, groups, (None,) * spec.ndim, False)

    def root_key(self) -> tuple:
        """What the world's registry files a root's flattened names under."""
        return (self.device, self.root)

    def native_key(self, epoch: int) -> tuple:
        """What the engine's mesh depends on (not the roles): one torch mesh per geometry."""
        return (self.device, self.spec, self.root, self.backends, epoch)

    def alive(self, what: str) -> None:
        """NotInitializedError naming ``what`` once the mesh's world is destroyed."""
        if not self.world.alive:
            raise NotInitializedError(f"{what}: this mesh belongs to a destroyed world. Fix: "
                                      "build a new mesh after init_process_group().")

    def coordinate(self, what: str) -> tuple[int, ...]:
        """This rank's coordinate; NotAMemberError naming ``what`` on a rank outside the mesh
        (on the (2, 4) mesh above, rank 5 is at (1, 1))."""
        self.alive(what)
        coord = self.spec.coordinate_of(self.world.rank)
        if coord is None or not self.groups:
            raise NotAMemberError(
                f"{what}: rank {self.world.rank} is not in this mesh. Fix: call it only on "
                f"ranks for which get_coordinate() is not None."
            )
        return coord
