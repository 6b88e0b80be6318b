"""A mesh's process groups: made (now or at first use) through the world's registry, or
adopted from groups made elsewhere; and the layout of an ``init_device_mesh`` mesh.

What the layers over a mesh call to give one its groups (``device_mesh.py``,
``elastic/mesh.py``, ``mesh/views.py``, ``mesh/native.py``): ``mesh_backend``,
``eagerness``, ``laid_out``, ``make_groups``; ``adopted`` wraps existing groups
(``DeviceMesh.from_group``), ``as_our_group`` and ``check_lines`` check them.

On a (2, 4) mesh named ("dp", "tp"), rank 5 is at (1, 1): ``make_groups`` gives it the "dp"
group [1, 5] and the "tp" group [4, 5, 6, 7], in dim order, each the registry's object for
those ordered ranks and backend (made once per world and epoch, whoever asks).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..errors import bad_argument, bad_type
from ..geometry.spec import MeshSpec
from ..host import knobs
from ..job.failures import named_failures
from ..job.world import GroupName, World
from ..process_group import ProcessGroup
from . import args
from .parts import MeshParts

log = logging.getLogger("tensorplay.distributed")


def mesh_backend(world: World, device: str) -> str:
    """A mesh's default backend: the world's, or what its engine runs ``device`` on (gloo
    for a 'cpu' mesh on an nccl world)."""
    return world.engine.backend_for_device(device, world.backend)


def eagerness(given: object) -> tuple[bool, bool]:
    """``init_device_mesh(..., eager_groups=given)`` -> (make the mesh's own groups now, make
    the groups of the meshes made from it when they are made): True -> (True, True), False ->
    (False, False), None -> ``TENSORPLAY_EAGER_GROUPS`` (1, 0), else (True, False): a mesh's
    own groups at init, as torch's init_device_mesh; its views' at first use."""
    if given is None:
        given = knobs.eager_groups_from_env()
    if given is None:
        return True, False
    if not isinstance(given, bool):
        raise bad_type("eager_groups", given, "bool or None",
                       "pass eager_groups=True to make every group when its mesh is made")
    return given, given


def make_groups(world: World, spec: MeshSpec, backends: Sequence[str], make: bool = True,
                within: timedelta | None = None) -> tuple[ProcessGroup, ...]:
    """This rank's group along each dim, in dim order; () when the mesh does not hold it.
    ``make``: engine groups not made yet are made now, in dim order (each ``within`` that
    long, if given: ``World.group``); else each at its first use (a collective,
    ``engine_group``), by its members.

    A group's errors name it by its dim: "the 'dp' group [1, 5]"; a group this call creates
    is described to the engine as torch describes its own meshes' groups: "mesh_dp" ("mesh_dp_cp"
    for a flatten, "mesh_dim_1" for an unnamed dim).
    """
    if spec.coordinate_of(world.rank) is None:
        return ()
    groups = []
    of = "(" + ", ".join(spec.names) + ")" if spec.names else f"a {spec.shape} mesh"
    for d in range(spec.ndim):
        name = spec.names[d] if spec.names else str(d)
        desc = f"mesh_{spec.names[d]}" if spec.names else f"mesh_dim_{d}"
        line = spec.line(world.rank, d)
        use = f"{name!r} of {of}" if spec.names else f"dim {d} of {of}"
        # repr(line) costs O(1) (a long group shows as its ends and size): this runs per dim
        with named_failures(world, f"creating the group of mesh dim {name!r} ({line!r})"):
            groups.append(world.group(line, backends[d], GroupName(repr(name), desc, use),
                                      make=make, within=within))
    return tuple(groups)


def laid_out(world: World, device: str, shape: tuple[int, ...], names: tuple[str, ...] | None,
             host_aware: bool) -> MeshSpec:
    """The spec of an ``init_device_mesh`` mesh (row-major, or host-aware), once the engine
    picked this process's device; rank 0 logs advice when a dim's groups cross hosts."""
    world.engine.use_device(device)
    spec = MeshSpec.row_major(shape, names)
    if host_aware:  # every rank reads the full host list (O(world size) each)
        from ..geometry import topology

        order = topology.host_aware_order(shape, world.control.hosts())
        if order is not None:
            spec = MeshSpec.from_ranks(shape, order, names)
    elif world.rank == 0 and (hosts := world.control.known_hosts()) is not None:  # rank 0 holds it
        from ..geometry import topology

        if spec.size <= topology.CROSSING_LIMIT:
            hint = topology.advice(spec, hosts)
            if hint is not None:
                log.warning("init_device_mesh%s: %s", shape, hint)
    return spec


def adopted(world: World, group: Any, device: str, mesh: Any,
            names: Sequence[str] | None) -> MeshParts:
    """``DeviceMesh.from_group``: a root mesh over existing groups (one per dim, ours or the
    engine's), creating none. One group of ranks [4, 5, 6, 7] gives the 1-d mesh of them."""
    groups = list(group) if isinstance(group, list | tuple) else [group]
    if not groups:
        raise bad_argument("group", group, "is empty", "pass one group per dim")
    ours = [as_our_group(world, g, i) for i, g in enumerate(groups)]
    if mesh is None:
        if len(ours) != 1:
            raise bad_argument("mesh", None, "is required with several groups",
                               "pass the rank array the groups come from")
        mesh = ours[0].ranks
    shape, ranks = args.explicit_mesh(mesh, world.size)
    if len(shape) != len(ours):
        raise bad_argument("group", group, f"gives {len(ours)} groups for a "
                           f"{len(shape)}-d mesh", "pass one group per dim")
    spec = MeshSpec.from_ranks(shape, ranks, args.dim_names(names, len(shape)))
    held = spec.coordinate_of(world.rank) is not None
    if held:
        check_lines(world, spec, ours)
    return MeshParts.root_of(world, device, spec, tuple(g.backend for g in ours),
                             tuple(ours) if held else ())


def as_our_group(world: World, group: Any, index: int) -> ProcessGroup:
    """``group`` itself when it is ours, else our group for the engine group (adopted into
    the world's registry); ``group[index]`` is named when it is neither."""
    if isinstance(group, ProcessGroup):
        return group
    found = world.adopt(group)
    if found is None:
        raise bad_argument(f"group[{index}]", group, "is not a process group",
                           f"pass tensorplay or {world.engine.name} process groups")
    return found


def check_lines(world: World, spec: MeshSpec, groups: Sequence[ProcessGroup],
                arg: str = "group[{d}]",
                fix: str = "pass the groups in dim order, each matching the mesh") -> None:
    """Each group must be the mesh's line through this rank along its dim, in mesh order: on
    the (2, 4) mesh [[0, 1, 2, 3], [4, 5, 6, 7]], rank 5's dim 1 group is [4, 5, 6, 7]."""
    for d, g in enumerate(groups):
        if spec.line(world.rank, d) != g.rank_seq:
            raise bad_argument(
                arg.format(d=d), g.ranks, f"is not the mesh line through rank {world.rank} "
                f"along dim {d} ({spec.line(world.rank, d).tolist()})", fix)
