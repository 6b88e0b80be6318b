"""A mesh that goes on without its lost ranks: agree, open a new epoch, shrink, make new groups.

The core of elastic recovery (issue "Keep training when ranks die"; not public API yet: the
launcher's elastic mode, growing back and the world-wide calls that still count the lost ranks
are to come). After a RankFailedError (or a timeout) every survivor calls ``shrink_mesh``:

1. ``_survivors.agree_lost``: the same lost ranks on every survivor, decided once in the store;
2. ``World.open_epoch()``: fresh store keys and group names, nothing of the failed epoch used;
3. ``_shrink.shrink``: the slices of the elastic dim holding a lost rank removed;
4. new groups for the new mesh, made by their members only (no lost rank is asked to join),
   so gloo needs no abort of the broken groups: they are simply never used again.

Worked example, 4 gloo ranks, (2, 2) named ("dp", "tp"), rank 3 SIGKILLed: ranks 0-2 agree on
[3]; the new mesh is (1, 2) holding [0, 1] with tp group [0, 1] of epoch 1; rank 2 is a spare
(its mesh's get_coordinate() is None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._mesh_spec import MeshSpec
from ._shrink import Shrunk, shrink
from ._survivors import agree_lost

if TYPE_CHECKING:
    from .device_mesh import DeviceMesh


def shrink_mesh(mesh: DeviceMesh, err: BaseException, dim: int | str, *, minimum: int = 1,
                wait_s: float = 5.0, timeout_s: float = 60.0) -> tuple[DeviceMesh, Shrunk]:
    """The mesh without the slices of ``dim`` that held a lost rank, and what was removed.

    ``err`` is what this rank caught: its ``ranks`` (RankFailedError) or ``missing``
    (DistributedTimeoutError) are this rank's suspects. Every member of ``mesh`` that survives
    must call it (SPMD). Raises ShrinkError (on every survivor) below ``minimum`` or without a
    majority.
    """
    from .device_mesh import DeviceMesh, _make_groups

    world, spec = mesh._world, mesh._spec
    d = mesh._dim(dim)
    suspects = getattr(err, "ranks", None) or getattr(err, "missing", None) or []
    members = spec.ranks().tolist()
    lost = agree_lost(world.store, f"recover/e{world.spmd.epoch}", world.rank, members,
                      suspects, wait_s=wait_s, timeout_s=timeout_s)
    world.open_epoch()
    names = spec.names
    shrunk = shrink(spec.shape, members, d, lost, minimum=minimum,
                    dim_name=names[d] if names else None)
    new_spec = MeshSpec.from_ranks(shrunk.shape, list(shrunk.ranks), names)
    new = object.__new__(DeviceMesh)
    new._set(world, mesh._device_type, new_spec, new_spec, mesh._backends,
             _make_groups(world, new_spec, mesh._backends))
    return new, shrunk
