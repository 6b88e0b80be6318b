"""mesh.to_torch() and DeviceMesh.from_torch(): torch's DeviceMesh over our groups, and back.

The multi-process tests run on the 8 ranks of ``world8``; each ``*_job`` returns plain data
that the test checks against the mesh's rank array. The last tests run in a 1-rank gloo world
in this process: the private-API probe, the error when torch lacks one, and the bad inputs.
"""

from __future__ import annotations

import socket
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from torch.distributed import distributed_c10d as c10d

import tensorplay.distributed as dist
from tensorplay.distributed.backends import torch_mesh
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.errors import ArgumentError, ArgumentTypeError, BackendError
from tensorplay.distributed.job import lifecycle as world_module

# name -> how every rank builds the mesh (dim names no other test file uses)
MESHES = {
    "1d": lambda: init_device_mesh("cpu", (8,), mesh_dim_names=("w",)),
    "2d": lambda: init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")),
    "3d": lambda: init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")),
    "unnamed": lambda: init_device_mesh("cpu", (4, 2)),
    "permuted": lambda: DeviceMesh("cpu", [[3, 1, 7, 5], [2, 0, 6, 4]],
                                   mesh_dim_names=("a", "b")),
    "subset": lambda: DeviceMesh("cpu", [[0, 2], [4, 6]], mesh_dim_names=("x", "y")),
    "unflattened": lambda: init_device_mesh("cpu", (8,), mesh_dim_names=("u",)).unflatten(
        "u", (2, 4), ("ua", "ub")),
}


def _counts() -> tuple[int, int]:
    """(groups this rank helped create, c10d groups in this process)."""
    return world_module._WORLD.registry.created, len(c10d._world.pg_map)


def _sums(tm) -> list[int]:
    """Per dim, the sum of the global ranks of this rank's group, by a real torch all_reduce
    on the group torch's mesh holds."""
    out = []
    for d in range(tm.ndim):
        x = torch.tensor([float(tdist.get_rank())])
        tdist.all_reduce(x, group=tm.get_group(d))
        out.append(int(x.item()))
    return out


def convert_job(rank: int, name: str):
    mesh = MESHES[name]()
    if mesh.get_coordinate() is not None:  # an unflatten's groups: made at first use, here
        assert all(g.engine_group is not None for g in mesh.get_all_groups())
    before = _counts()
    tm = mesh.to_torch()
    slices = {n: mesh[n].to_torch() for n in mesh.mesh_dim_names or ()
              } if mesh.get_coordinate() is not None else {}
    made = tuple(a - b for a, b in zip(_counts(), before, strict=True))
    out = {"made": made, "same": mesh.to_torch() is tm and MESHES[name]().to_torch() is tm,
           "coord": tm.get_coordinate(), "root_mesh": tm.mesh.tolist(),
           "ours_coord": mesh.get_coordinate()}
    if mesh.get_coordinate() is None:
        return out
    out["groups_are_ours"] = [tm.get_group(d) is g.engine_group
                              for d, g in enumerate(mesh.get_all_groups())]
    out["local"] = [tm.get_local_rank(d) for d in range(tm.ndim)]
    out["sums"] = _sums(tm)
    out["slices"] = {
        n: {"equal": s == tm[n], "root": s._get_root_mesh() is tm, "mesh": s.mesh.tolist(),
            "group": s.get_group() is mesh[n].get_group().engine_group,
            "again": mesh[n].to_torch() is s}
        for n, s in slices.items()}
    return out


def _line(array: np.ndarray, rank: int, dim: int) -> list[int]:
    coord = [int(c[0]) for c in np.nonzero(array == rank)]
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
    return array[index].tolist()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "array"), [
    ("1d", np.arange(8)),
    ("2d", np.arange(8).reshape(2, 4)),
    ("3d", np.arange(8).reshape(2, 2, 2)),
    ("unnamed", np.arange(8).reshape(4, 2)),
    ("permuted", np.array([[3, 1, 7, 5], [2, 0, 6, 4]])),
    ("subset", np.array([[0, 2], [4, 6]])),
    ("unflattened", np.arange(8).reshape(2, 4)),
])
def test_to_torch_runs_on_our_groups_and_creates_none(world8, name, array):
    for rank, out in enumerate(world8.run(convert_job, name)):
        assert out["made"] == (0, 0)  # neither a group of ours nor a c10d group
        assert out["same"]  # the same object again, and for an equal mesh built again
        assert out["root_mesh"] == array.tolist()
        if rank not in array:  # what torch's own mesh is on a rank outside it
            assert out["coord"] is None and out["ours_coord"] is None
            continue
        coord = [int(c[0]) for c in np.nonzero(array == rank)]
        assert list(out["coord"]) == coord == out["ours_coord"] == out["local"]
        assert all(out["groups_are_ours"])
        assert out["sums"] == [sum(_line(array, rank, d)) for d in range(array.ndim)]
        for d, (n, s) in enumerate(out["slices"].items()):
            assert s == {"equal": True, "root": True, "mesh": _line(array, rank, d),
                         "group": True, "again": True}, (n, s)


def flatten_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    tm = mesh.to_torch()  # before the flatten: the root learns of it afterwards
    flat = mesh["pp", "dp"].flatten()
    assert flat.get_group().engine_group is not None  # made at first use: here, not below
    before = _counts()
    ft = flat.to_torch()
    with warnings.catch_warnings():  # torch: slicing a flattened dim from the root is deprecated
        warnings.simplefilter("ignore")
        from_root = mesh.to_torch()["pp_dp"]
    both = mesh["pp_dp", "tp"].to_torch()
    made = tuple(a - b for a, b in zip(_counts(), before, strict=True))
    unnamed = init_device_mesh("cpu", (4, 2)).flatten().to_torch()
    thin = init_device_mesh("cpu", (1, 2, 4), mesh_dim_names=("o", "p", "q"))
    thin_flat = thin["o", "p"].flatten().to_torch()  # runs along "p" alone: "o" has size 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        thin_from_root = thin.to_torch()["o_p"] == thin_flat
    return {"made": made, "mesh": ft.mesh.tolist(), "names": ft.mesh_dim_names,
            "group": ft.get_group() is flat.get_group().engine_group,
            "root": ft._get_root_mesh() is tm, "from_root": from_root == ft,
            "by_name": mesh["pp_dp"].to_torch() is ft, "sums": _sums(ft),
            "both": both.mesh.tolist(), "both_root": both._get_root_mesh() is tm,
            "unnamed": unnamed.mesh.tolist(), "unnamed_names": unnamed.mesh_dim_names,
            "thin": thin_flat.mesh.tolist(), "thin_from_root": thin_from_root}


@pytest.mark.slow
def test_a_flattened_dim_is_a_flatten_of_the_root_on_our_group(world8):
    array = np.arange(8).reshape(2, 2, 2)
    for rank, out in enumerate(world8.run(flatten_job)):
        line = array[:, :, rank % 2].reshape(-1).tolist()
        assert out["made"] == (0, 0)
        assert out["mesh"] == line and out["names"] == ("pp_dp",)
        assert out["group"] and out["root"] and out["from_root"] and out["by_name"]
        assert out["sums"] == [sum(line)]
        assert out["both"] == array.reshape(4, 2).tolist()
        assert out["both_root"]
        assert out["unnamed"] == list(range(8)) and out["unnamed_names"] is None
        assert out["thin"] == [rank % 4, rank % 4 + 4] and out["thin_from_root"]


def from_torch_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tm = mesh.to_torch()
    back = DeviceMesh.from_torch(tm)
    tp = DeviceMesh.from_torch(tm["tp"])
    # a mesh a library built with torch's own init_device_mesh (torch creates its groups)
    library = tdist.init_device_mesh("cpu", (4, 2), mesh_dim_names=("lib_a", "lib_b"))
    adopted = DeviceMesh.from_torch(library)
    before = _counts()
    adopted_slice = DeviceMesh.from_torch(library["lib_b"])
    made = tuple(a - b for a, b in zip(_counts(), before, strict=True))
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=adopted.get_group("lib_b"))
    subset = MESHES["subset"]()  # [[0, 2], [4, 6]]
    try:
        sub_slice = DeviceMesh.from_torch(subset.to_torch()["y"]) == subset["y"]
    except RuntimeError as err:  # torch 2.13 cannot slice a mesh on a rank outside it
        sub_slice = str(err)
    return {"sub_slice": sub_slice, "back": back == mesh, "back_torch": back.to_torch() is tm,
            "tp": tp == mesh["tp"],
            "adopted": adopted.mesh.tolist(), "adopted_names": adopted.mesh_dim_names,
            "adopted_torch": adopted.to_torch() == library, "made": made,
            "slice": adopted_slice == adopted["lib_b"], "sum": x.item(),
            "groups": [g.ranks for g in adopted.get_all_groups()]}


@pytest.mark.slow
def test_from_torch_adopts_a_torch_mesh_and_its_slices(world8):
    array = np.arange(8).reshape(4, 2)
    for rank, out in enumerate(world8.run(from_torch_job)):
        assert out["back"] and out["back_torch"] and out["tp"]
        assert out["adopted"] == array.tolist() and out["adopted_names"] == ("lib_a", "lib_b")
        assert out["adopted_torch"] and out["slice"] and out["made"] == (0, 0)
        assert out["groups"] == [_line(array, rank, 0), _line(array, rank, 1)]
        assert out["sum"] == sum(_line(array, rank, 1))
        if rank % 2 == 0:
            assert out["sub_slice"] is True
        else:
            assert out["sub_slice"].startswith("In order to get the mesh Tensor of a "
                                               "DeviceMesh it needs"), out["sub_slice"]


def permuted_torch_job(rank: int):
    # torch's new_group sorts ranks: its groups of [[3, 1], [2, 0]] are [0, 2], [1, 3], ...
    library = tdist.device_mesh.DeviceMesh("cpu", [[3, 1], [2, 0]], mesh_dim_names=("p", "q"))
    try:
        DeviceMesh.from_torch(library)
    except ArgumentError as err:
        return f"{type(err).__name__}: {err}"
    return "adopted"


@pytest.mark.slow
def test_from_torch_refuses_groups_out_of_mesh_order(world8):
    out = world8.run(permuted_torch_job)
    assert out[4:] == ["adopted"] * 4  # outside the mesh: no groups to check
    assert out[3].startswith("ArgumentError: torch_mesh.get_group(0)=[2, 3]: is not the mesh "
                             "line through rank 3 along dim 0 ([3, 2]). Fix: its groups must "
                             "list ranks in mesh order"), out[3]
    assert all("Fix" in o for o in out[:4])


# -- in this process: a 1-rank gloo world ------------------------------------------------------

def test_every_private_torch_api_we_use_is_there():
    assert torch_mesh.probe() == []


def test_the_private_apis_are_listed_in_the_adapter_docstring():
    for api in ("_layout=", "_rank_map=", "_root_mesh=", "_init_backend=False",
                "_dim_group_names", "_pg_registry", "_flatten_mapping", "_get_root_mesh",
                "_MeshLayout"):
        assert api in torch_mesh.__doc__, api


def test_a_torch_without_them_gets_a_clear_error(gloo1, monkeypatch):
    mesh = init_device_mesh("cpu", (1,))
    monkeypatch.setattr(torch_mesh, "probe", lambda: ["torch 2.4: DeviceMesh.__init__ is not X"])
    torch_mesh._problems.cache_clear()
    try:
        with pytest.raises(BackendError, match=r"^DeviceMesh.to_torch\(\): this torch cannot "
                           r"build its DeviceMesh on our groups: torch 2.4: .*Fix: "):
            mesh.to_torch()
    finally:
        monkeypatch.undo()
        torch_mesh._problems.cache_clear()
    assert mesh.to_torch().get_group() is mesh.get_group().engine_group


def test_one_rank_round_trip_and_identity(gloo1):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tm = mesh.to_torch()
    assert tm.shape == (1, 1) and tm.get_coordinate() == (0, 0)
    assert mesh["tp"].to_torch() == tm["tp"]
    adopted = DeviceMesh.from_torch(tm)
    assert adopted == mesh and adopted.to_torch() is tm
    dist.destroy_process_group()
    with pytest.raises(dist.NotInitializedError, match="to_torch"):
        mesh.to_torch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    again = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert again.to_torch() is not tm  # a new world makes its own


def test_from_torch_refuses_what_is_not_a_torch_mesh(gloo1):
    with pytest.raises(ArgumentTypeError, match=r"^torch_mesh=\[0\]: expected a torch "
                       r"DeviceMesh, got list\. Fix: "):
        DeviceMesh.from_torch([0])
