"""A mesh as its engine's own mesh object (torch's DeviceMesh), both ways, through the
engine's ``NativeMeshes`` capability (``backends/protocol.py``); an engine without it (MPI,
the simulated world) is named in a BackendError. ``not_torch`` words the error for a torch
function handed our mesh instead of ``mesh.to_torch()``.

On a (2, 4) ("dp", "tp") mesh of 8 gloo ranks, ``to_torch`` builds torch's root mesh on our
8 groups once per world and epoch, and ``mesh["tp"].to_torch()`` is that root's ``["tp"]``: on
rank 5 its group is our "tp" group's engine group, over [4, 5, 6, 7]. ``from_torch`` turns a
torch mesh back into the parts of ours, its groups adopted into the world's registry.
"""

from __future__ import annotations

from typing import Any

from ..backends.protocol import MeshView, NativeMesh, NativeMeshes
from ..errors import BackendError, NotAMemberError, NotATorchMeshError, bad_type
from ..geometry.spec import MeshSpec
from ..job.world import World
from . import args, views
from .groups import as_our_group, check_lines, make_groups, mesh_backend
from .parts import MeshParts


def to_torch(parts: MeshParts, epoch: int) -> Any:
    """The engine's mesh of a mesh of ``epoch`` (``DeviceMesh.to_torch``): refused before any
    group is made on an engine without mesh objects; a root first makes the meshes of its
    registered flattens ("dp_cp"), so torch's root knows their names too."""
    native_meshes(parts.world, adopting=False)
    if parts.spec == parts.root and parts.groups:  # flattens made since this was built
        root_names = parts.spec.names or ()
        for name, merged in parts.world.registry.flattened_names(parts.root_key()).items():
            if all(n in root_names for n in merged):  # not a flatten of a reshape's dims
                _native(views.select(parts, name), 0)
    return _native(parts, epoch)


def _native(parts: MeshParts, epoch: int) -> Any:
    """The engine's mesh of ``parts``, made once per world and epoch (the world's cache)."""
    return parts.world.registry.native_mesh(parts.native_key(epoch), lambda: _build(parts))


def _build(parts: MeshParts) -> Any:
    """The engine's mesh over a mesh's groups: a root from its rank array, any other mesh as
    dims of its root's (built first)."""
    world, spec, root = parts.world, parts.spec, parts.root
    groups = tuple(g.engine_group for g in parts.groups)
    engine = native_meshes(world, adopting=False)

    def of_its_ranks() -> Any:  # the engine's mesh of this mesh's own rank array
        return engine.to_native_mesh(MeshView(parts.device, spec.names, groups,
                                              ranks=spec.array()), None)

    if spec == root:
        return of_its_ranks()
    anchor = world.rank if parts.groups else spec.rank_at((0,) * spec.ndim)
    try:
        dims = spec.root_dims(root, anchor)
    except ValueError:  # a reshape whose dims cut root dims: torch's mesh of its own ranks
        return of_its_ranks()
    names, flatten_of = spec.names, None
    if names and len(dims) == 1:  # a flatten the root answers to, by this name?
        merged = _flattened_dims(parts, names[0])
        if merged is not None and dims[0] == tuple(i for i in merged if root.shape[i] > 1):
            flatten_of = names[0]
    view = MeshView(parts.device, names, groups, root_dims=dims, flatten_of=flatten_of)
    return engine.to_native_mesh(view, _native(_root_on_groups(parts, dims), 0))


def _flattened_dims(parts: MeshParts, name: str) -> tuple[int, ...] | None:
    """The root dims that ``name`` flattens in the world's registry, None if none."""
    merged = parts.world.registry.flattened_names(parts.root_key()).get(name)
    root_names = parts.root.names or ()
    if merged is None or any(n not in root_names for n in merged):
        return None
    return tuple(root_names.index(n) for n in merged)


def _root_on_groups(parts: MeshParts, dims: tuple[tuple[int, ...], ...]) -> MeshParts:
    """The root a mesh was sliced or flattened from, on its groups in the world's registry:
    the backend of a dim the mesh keeps is the mesh's, the default elsewhere."""
    world, root = parts.world, parts.root
    backends = [mesh_backend(world, parts.device)] * root.ndim
    for d, covered in enumerate(dims):
        if len(covered) == 1:
            backends[covered[0]] = parts.backends[d]
    return MeshParts.root_of(world, parts.device, root, tuple(backends),
                             make_groups(world, root, backends))


def from_torch(world: World, torch_mesh: Any) -> MeshParts:
    """The parts of our mesh for an engine's mesh (``DeviceMesh.from_torch``), creating no
    group; the world's cache then gives ``torch_mesh`` back for it (and for its root)."""
    found = native_meshes(world, adopting=True).mesh_from_native(torch_mesh)
    if found is None:
        raise bad_type("torch_mesh", torch_mesh, f"a {world.engine.name} DeviceMesh",
                       "pass the DeviceMesh a library built, e.g. its init_device_mesh()")
    root = found.root or found
    parts = _adopt(world, root, "DeviceMesh.from_torch()")
    world.registry.native_mesh(parts.native_key(0), lambda: root.obj)  # to_torch() gives it back
    if found.root is None:
        return parts
    assert found.names is not None  # a slice of a torch root is named by the root's dims
    parts = views.select(parts, found.names)
    world.registry.native_mesh(parts.native_key(0), lambda: found.obj)
    return parts


def _adopt(world: World, found: NativeMesh, what: str) -> MeshParts:
    """Our root mesh over an engine mesh's rank array and groups (adopted, none created)."""
    if found.ranks is None:
        raise NotAMemberError(f"{what}: rank {world.rank} is not in torch_mesh, so its ranks "
                              "are unknown here. Fix: adopt its root mesh on this rank.")
    device = args.device_type(found.device_type)
    shape, ranks = args.explicit_mesh(found.ranks, world.size)
    spec = MeshSpec.from_ranks(shape, ranks, args.dim_names(found.names, len(shape)))
    ours = tuple(as_our_group(world, g, i) for i, g in enumerate(found.groups))
    if ours:  # an engine that sorts a group's ranks (torch's new_group) breaks mesh order
        check_lines(world, spec, ours, "torch_mesh.get_group({d})",
                    "its groups must list ranks in mesh order; build the mesh with "
                    "tensorplay (DeviceMesh(device_type, ranks).to_torch()) to keep it")
    backends = tuple(g.backend for g in ours) or (mesh_backend(world, device),) * spec.ndim
    return MeshParts.root_of(world, device, spec, backends, ours)


def native_meshes(world: World, adopting: bool) -> NativeMeshes:
    """The world's engine, which has mesh objects of its own (torch's DeviceMesh); else the
    BackendError of ``to_torch()`` (``from_torch()`` when ``adopting``) naming the engine:
    "to_torch(): an mpi world has no torch process groups ..."."""
    engine = world.engine
    if isinstance(engine, NativeMeshes):
        return engine
    name, simulated = engine.name, engine.capabilities.simulated
    which = f"a simulated ({name!r}) world" if simulated else f"{_article(name)} {name} world"
    if adopting:
        raise BackendError(
            f"DeviceMesh.from_torch(): {which} cannot adopt torch_mesh: its groups belong to "
            + ("a real torch world. Fix: call init_process_group('gloo') (or nccl) and adopt "
               "torch meshes built in that world." if simulated else
               "torch.distributed. Fix: adopt torch meshes in a gloo or nccl world."))
    raise BackendError(
        f"to_torch(): {which} has no torch process groups to build torch's DeviceMesh on. "
        "Fix: run on gloo or nccl "
        + (f"(e.g. tensorplay-run --nproc-per-node 8) to use DTensor, tensor parallelism or "
           f"FSDP2; a {name} world plans and checks meshes only." if simulated else
           "(tensorplay-run or torchrun, init_process_group('gloo')) to use DTensor, tensor "
           "parallelism or FSDP2."))


def _article(name: str) -> str:
    """'an' before an engine name read letter by letter that sounds a vowel first ("an mpi
    world"), else 'a'."""
    return "an" if name[:1] in "aefhilmnorsx" else "a"


def not_torch(what: str, did: str, name: str) -> NotATorchMeshError:
    """The error for a torch function that was handed our mesh and ``did`` something only
    torch's DeviceMesh can answer ("mesh._layout: ... a torch function read torch's internal
    '_layout' from it. Fix: pass mesh.to_torch() ...")."""
    return NotATorchMeshError(
        f"{what}: this is tensorplay's DeviceMesh, not torch's; a torch function {did}. Fix: "
        "pass mesh.to_torch() to torch functions (torch's DeviceMesh on the same groups), or "
        "call the versions that take our mesh: tensorplay.distributed.fsdp.fully_shard, "
        "tensorplay.distributed.tensor (distribute_tensor, DTensor.from_local) and "
        "tensorplay.distributed.tensor.parallel (parallelize_module).", name=name)
