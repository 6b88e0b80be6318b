"""tensorplay.distributed.device_mesh: the execution context of an SPMD program.

A ``DeviceMesh`` (``mesh/value.py``) is an n-d array of global ranks with one process group per
dimension: on a (2, 4) mesh named ("dp", "tp"), rank 5 is at (1, 1); its "tp" group is
[4, 5, 6, 7] and its "dp" group is [1, 5]. ``init_device_mesh`` builds one over the whole
world; with ``elastic=`` it hands over to the elastic layer (``elastic/``), in one branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .control.consensus import agree
from .elastic import mesh as elastic_mesh
from .elastic.mesh import sync_replicas
from .errors import bad_argument
from .geometry.roles import dim_roles
from .job import progress
from .job.lifecycle import current_or_adopted_world
from .mesh import args
from .mesh.groups import eagerness, laid_out, make_groups, mesh_backend
from .mesh.parts import MeshParts
from .mesh.value import DeviceMesh

__all__ = ["DeviceMesh", "init_device_mesh", "sync_replicas"]


@progress.entry("init_device_mesh()")
def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int] | int,
    *,
    mesh_dim_names: Sequence[str] | None = None,
    backend_override: Any = None,
    host_aware: bool = False,
    elastic: int | str | bool | None = None,
    elastic_min: int = 1,
    mesh_dim_roles: Any = None,
    eager_groups: bool | None = None,
) -> DeviceMesh:
    """Build a mesh of ``mesh_shape`` over the whole world, ranks filling it row-major.

    elastic="dp" (a dim whose slices are replicas; True: the one dim whose role is "replicate"
    in mesh_dim_roles) makes the mesh survive lost ranks:
    ``mesh.recover(err)`` removes the slices that held one (never below ``elastic_min``
    slices), ``mesh.grow()`` puts them back when their ranks are there again. A rank that
    tensorplay-run restarted (--max-restarts) waits here until the members admit it, and gets
    the mesh of the epoch it joins (``mesh.fresh_ranks`` holds it: see ``sync_replicas``).

    host_aware=True lays ranks out host by host instead, so the innermost dims' groups stay
    inside one host when a launcher dealt ranks to hosts unevenly (e.g. round-robin).

    Every rank passes the same arguments (SPMD) and the call returns once every rank has
    joined: ``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))`` on 8 ranks.
    One -1 in mesh_shape is inferred from the world size.

    mesh_dim_roles={"dp_shard": "shard", "tp": "tensor"} says what dims are for (roles in
    ``roles.ROLES``); slices, flatten and reshape carry them, describe() shows them and
    ``mesh.abstract`` (names, sizes, roles) identifies the mesh without its ranks.

    eager_groups: when communicators are made. By default (None, and
    ``TENSORPLAY_EAGER_GROUPS`` unset) the mesh's own groups are made here, as torch's
    init_device_mesh makes them, and the groups of the meshes made from it (``reshape``,
    ``flatten``, ``unflatten``) at their first use: a collective, ``engine_group`` or
    ``to_torch()``, by every member at that same call. True (or ``TENSORPLAY_EAGER_GROUPS=1``)
    makes every group when its mesh is made; False (``=0``) none before its first use.

    The mesh is described by shape and strides, so building it and answering queries costs
    O(ndim), whatever the world size.
    """
    world = current_or_adopted_world("init_device_mesh()")
    device = args.device_type(device_type)
    shape = args.mesh_shape(mesh_shape, world.size)
    names = args.dim_names(mesh_dim_names, len(shape))
    backends = args.backend_override(backend_override, names, len(shape),
                                     mesh_backend(world, device))
    if not isinstance(host_aware, bool):
        raise bad_argument("host_aware", host_aware, "must be True or False",
                           "pass host_aware=True to order ranks host by host")
    roles = dim_roles(mesh_dim_roles, names, len(shape))
    own, views = eagerness(eager_groups)
    replicas = args.elastic(elastic, elastic_min, names, shape, roles)
    if replicas is not None:
        return elastic_mesh.init(world, device, shape, names, backends, host_aware, replicas,
                                 given=elastic, roles=roles, eager=(own, views))
    agree(world, "init_device_mesh()", {
        "device_type": device, "mesh_shape": shape, "mesh_dim_names": names,
        "backend_override": backends, "host_aware": host_aware, "elastic": None,
        "mesh_dim_roles": roles, "eager_groups": [own, views],
    })
    spec = laid_out(world, device, shape, names, host_aware)
    return DeviceMesh.of(MeshParts(world, device, spec, spec, backends,
                                   make_groups(world, spec, backends, own),
                                   roles if roles is not None else (None,) * spec.ndim, views))


if __name__ == "__main__":  # the planning command's old spelling, kept working
    import sys

    from .plan import DEVICE_MESH_PROG, main

    sys.exit(main(prog=DEVICE_MESH_PROG))
