"""What a mesh is made of (``mesh/parts.py``): the parts a layer reads, a mesh made again of
them, the keys the registry and the engine's cache file it under, and the checks every query
begins with, in a simulated world."""

from __future__ import annotations

import dataclasses

import pytest

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.mesh.parts import MeshParts


def test_the_parts_of_the_worked_example(fake_world):
    """Rank 5 of 8, (2, 4) ("dp", "tp"): as the module docstring says."""
    fake_world(5, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    parts = mesh.parts
    assert parts.world is dist.world.current_world("test") and parts.device == "cpu"
    assert parts.spec == parts.root == mesh.spec and parts.backends == ("fake", "fake")
    assert [g.ranks for g in parts.groups] == [[1, 5], [4, 5, 6, 7]]
    assert parts.roles == (None, None) and parts.eager is False
    assert mesh["tp"].parts.root == mesh.spec and mesh["tp"].parts.spec.shape == (4,)
    assert DeviceMesh.of(parts) == mesh and DeviceMesh.of(parts).parts is parts
    assert parts.coordinate("test") == (1, 1)
    assert parts.root_key() == ("cpu", mesh.spec)
    assert parts.native_key(3) == ("cpu", mesh.spec, mesh.spec, ("fake", "fake"), 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.eager = True  # type: ignore[misc]


def test_root_of_is_a_root_without_roles_or_eager_views(fake_world):
    fake_world(0, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                            mesh_dim_roles={"dp": "replicate"}, eager_groups=True)
    parts = MeshParts.root_of(mesh.parts.world, "cpu", mesh.spec, ("fake", "fake"),
                              mesh.parts.groups)
    assert (parts.root, parts.roles, parts.eager) == (mesh.spec, (None, None), False)
    assert DeviceMesh.of(parts) != mesh  # the roles are part of the value
    assert DeviceMesh.of(parts).abstract.roles == (None, None)


def test_the_checks_name_the_call(fake_world):
    fake_world(7, 8)
    subset = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert subset.parts.groups == ()  # rank 7 holds none of its groups
    with pytest.raises(dist.NotAMemberError, match=r"^get_group\(\): rank 7 is not in this "
                       r"mesh\. Fix: call it only on ranks for which get_coordinate\(\) is "
                       r"not None\."):
        subset.get_group("tp")
    dist.destroy_process_group()
    with pytest.raises(dist.NotInitializedError, match=r"^flatten\(\): this mesh belongs to a "
                       r"destroyed world\. Fix: build a new mesh after init_process_group\(\)"):
        subset.flatten()
