"""A mesh as torch's DeviceMesh and back (``mesh/native.py``): refused, naming the engine,
where the engine has no mesh objects (before any group is made); on a real 1-rank gloo world,
the cache that gives one torch object per mesh, a root that knows its flattens, and adoption
of a torch mesh and its slices. The 8-rank cases are in ``backends/test_torch_mesh.py``."""

from __future__ import annotations

import numpy as np
import pytest

from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.errors import BackendError
from tensorplay.distributed.geometry.spec import MeshSpec
from tensorplay.distributed.mesh import native
from tensorplay.distributed.mesh.parts import MeshParts
from tests.fakes import ThreadRanks


def test_a_simulated_world_refuses_to_torch_before_any_group_is_made(fake_world):
    fake_world(5, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    view = mesh.reshape((4, 2), ("a", "b"))
    world = mesh.parts.world
    made = world.registry.created
    for call in (mesh.to_torch, view.to_torch, mesh["tp"].to_torch):
        with pytest.raises(BackendError, match=r"^to_torch\(\): a simulated \('fake'\) world "
                           r"has no torch process groups to build torch's DeviceMesh on\. "
                           r"Fix: run on gloo or nccl \(e\.g\. tensorplay-run"):
            call()
    assert world.registry.created == made and not view.get_group("b").made
    with pytest.raises(BackendError, match=r"^DeviceMesh.from_torch\(\): a simulated "
                       r"\('fake'\) world cannot adopt torch_mesh: its groups belong to a real "
                       r"torch world\. Fix: call init_process_group\('gloo'\)"):
        DeviceMesh.from_torch(object())


def test_an_engine_without_mesh_objects_is_named_with_its_article():
    """A real (not simulated) engine that lacks NativeMeshes, as MPI's: the tests' thread
    engine, 'threads'."""
    world = ThreadRanks(2).world(0)
    spec = MeshSpec.row_major((2,), ("dp",))
    parts = MeshParts.root_of(world, "cpu", spec, ("gloo",), ())
    with pytest.raises(BackendError, match=r"^to_torch\(\): a threads world has no torch "
                       r"process groups .* Fix: run on gloo or nccl \(tensorplay-run or "
                       r"torchrun, init_process_group\('gloo'\)\)"):
        native.to_torch(parts, 0)
    with pytest.raises(BackendError, match=r"^DeviceMesh.from_torch\(\): a threads world "
                       r"cannot adopt torch_mesh: its groups belong to torch.distributed"):
        native.from_torch(world, object())
    assert [native._article(n) for n in ("mpi", "threads", "nccl", "gloo")] == [
        "an", "a", "an", "a"]


# torch (2.13 here) warns that slicing its root by a flattened name will go: tm["pp_dp"] below
@pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh:UserWarning")
def test_one_torch_mesh_per_mesh_and_a_root_that_knows_its_flattens(gloo1):
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    flat = mesh["pp", "dp"].flatten()  # made before the root's torch mesh: it learns "pp_dp"
    tm = mesh.to_torch()
    assert tm.mesh_dim_names == ("pp", "dp", "tp") and tm.get_coordinate() == (0, 0, 0)
    assert mesh.to_torch() is tm and init_device_mesh(
        "cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp")).to_torch() is tm
    assert tm["pp_dp"].mesh.tolist() == [0] and flat.to_torch() == tm["pp_dp"]
    assert mesh["tp"].to_torch() == tm["tp"]
    assert tm["tp"].get_group() is mesh.get_group("tp").engine_group
    # a view in a new shape: torch's mesh of the view's own ranks
    assert np.asarray(mesh.reshape((1,), ("all",)).to_torch().mesh).tolist() == [0]


def test_from_torch_adopts_a_root_and_its_slices_creating_no_group(gloo1):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tm = mesh.to_torch()
    world = mesh.parts.world
    made = world.registry.created
    adopted = DeviceMesh.from_torch(tm)
    assert adopted == mesh and adopted.to_torch() is tm
    sliced = DeviceMesh.from_torch(tm["tp"])
    assert sliced == adopted["tp"] and sliced.parts.root == mesh.spec
    assert sliced.get_group() is mesh.get_group("tp") and world.registry.created == made
