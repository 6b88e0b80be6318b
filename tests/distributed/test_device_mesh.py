"""DeviceMesh on 8 real gloo ranks: queries, groups that move the right bytes, slicing, reshaping.

Each ``*_job`` runs on every rank and returns plain data; the test asserts it against a numpy
brute force of the same mesh.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.job import lifecycle as world_module


def _line(array: np.ndarray, rank: int, dim: int) -> list[int]:
    """Brute force: the ranks through ``rank`` along ``dim`` of ``array``."""
    coord = [int(c[0]) for c in np.nonzero(array == rank)]
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
    return array[index].tolist()


def _sum_over(group) -> int:
    """Sum of the global ranks of the group's members, computed by a real all_reduce."""
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=group)
    return int(x.item())


def describe_job(rank: int, shape, names, explicit=None):
    created = world_module._WORLD.registry.created
    if explicit is None:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    else:
        kind, values = explicit
        rank_array = {"list": values, "numpy": np.array(values), "torch": torch.tensor(values)}
        mesh = DeviceMesh("cpu", rank_array[kind], mesh_dim_names=names)
    made = world_module._WORLD.registry.created - created
    coord = mesh.get_coordinate()
    info = {"mesh": mesh.mesh.tolist(), "coord": coord, "shape": mesh.shape, "ndim": mesh.ndim,
            "made": made, "rank": mesh.get_rank(), "size": mesh.size()}
    if coord is not None:
        info["local"] = [mesh.get_local_rank(d) for d in range(mesh.ndim)]
        info["groups"] = [g.ranks for g in mesh.get_all_groups()]
        info["group_ranks"] = [g.rank() for g in mesh.get_all_groups()]
        info["sums"] = [_sum_over(mesh.get_group(d)) for d in range(mesh.ndim)]
        info["torch_ranks"] = [
            torch.distributed.get_process_group_ranks(g.engine_group)
            for g in mesh.get_all_groups()
        ]
        info["at"] = mesh.get_rank(tuple(coord))
    return info


def _check(results, array: np.ndarray):
    for rank, info in enumerate(results):
        assert info["mesh"] == array.tolist()
        assert info["rank"] == rank
        if rank not in array:
            assert info["coord"] is None and info["made"] == 0
            continue
        coord = [int(c[0]) for c in np.nonzero(array == rank)]
        assert info["coord"] == coord
        assert info["local"] == coord == info["group_ranks"]
        assert info["at"] == rank
        assert info["made"] <= array.ndim
        for d in range(array.ndim):
            line = _line(array, rank, d)
            assert info["groups"][d] == line
            assert info["torch_ranks"][d] == line
            assert info["sums"][d] == sum(line)


@pytest.mark.slow
def test_1d_2d_3d_row_major_meshes(world8):
    for shape, names in [((8,), ("dp",)), ((2, 4), ("dp", "tp")), ((2, 2, 2), ("pp", "dp", "tp")),
                         ((4, 2), None)]:
        _check(world8.run(describe_job, shape, names), np.arange(8).reshape(shape))


@pytest.mark.slow
def test_inferred_size_with_minus_one(world8):
    results = world8.run(describe_job, (-1, 2), ("dp", "tp"))
    assert results[0]["shape"] == (4, 2)
    _check(results, np.arange(8).reshape(4, 2))


@pytest.mark.slow
def test_permuted_mesh_local_rank_follows_the_mesh(world8):
    explicit = [[3, 1], [2, 0]]
    results = world8.run(describe_job, None, ("x", "y"), ("list", explicit))
    _check(results, np.array(explicit))
    # rank 0 sits at (1, 1): its rank inside each group is 1, although it is the smallest rank
    assert results[0]["group_ranks"] == [1, 1]


@pytest.mark.slow
def test_explicit_and_subset_meshes(world8):
    # torch tensors are built inside the ranks: a tensor sent through a queue is shared memory
    for kind, explicit in (("list", [[7, 6, 5, 4], [3, 2, 1, 0]]), ("numpy", [[4, 6], [5, 7]]),
                           ("torch", [1, 3, 5]), ("list", [[[0, 2], [4, 6]], [[1, 3], [5, 7]]])):
        array = np.asarray(explicit)
        names = tuple(f"d{i}" for i in range(array.ndim))
        _check(world8.run(describe_job, None, names, (kind, explicit)), array)


def slicing_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    before = world_module._WORLD.registry.created
    out = {}
    for names in ("tp", "dp", ("pp", "tp"), ("pp", "dp", "tp"), ("dp", "tp")):
        sub = mesh[names]
        out[repr(names)] = {
            "mesh": sub.mesh.tolist(), "names": sub.mesh_dim_names,
            "groups": [g.ranks for g in sub.get_all_groups()],
            "same": [g is mesh.get_group(n) for g, n in zip(
                sub.get_all_groups(), sub.mesh_dim_names, strict=True)],
            "sums": [_sum_over(g) for g in sub.get_all_groups()],
        }
    out["made_by_slicing"] = world_module._WORLD.registry.created - before
    return out


@pytest.mark.slow
def test_slicing_reuses_groups_and_picks_the_line_through_this_rank(world8):
    array = np.arange(8).reshape(2, 2, 2)
    for rank, out in enumerate(world8.run(slicing_job)):
        assert out["made_by_slicing"] == 0
        p, d, t = (int(c[0]) for c in np.nonzero(array == rank))
        assert out["'tp'"]["mesh"] == array[p, d, :].tolist()
        assert out["'dp'"]["mesh"] == array[p, :, t].tolist()
        assert out["('pp', 'tp')"]["mesh"] == array[:, d, :].tolist()
        assert out["('pp', 'tp')"]["names"] == ("pp", "tp")
        assert out["('pp', 'dp', 'tp')"]["mesh"] == array.tolist()
        for entry in out.values():
            if isinstance(entry, dict):
                assert all(entry["same"])
                assert entry["sums"] == [sum(g) for g in entry["groups"]]


def _registered() -> set[tuple]:
    """(ranks key, backend) of every group registered in this rank's world."""
    return {(g.rank_seq.key(), g.backend) for g in world_module._WORLD.registry.groups()}


def reshape_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    before = world_module._WORLD.registry.created
    flat = mesh["dp", "tp"].flatten()
    lazy_flatten = world_module._WORLD.registry.created - before  # made at first use
    flat_sum = _sum_over(flat.get_group())
    made_flatten = world_module._WORLD.registry.created - before
    again = mesh["dp_tp"]
    whole = init_device_mesh("cpu", (8,), mesh_dim_names=("all",))
    before, registered = world_module._WORLD.registry.created, _registered()
    split = whole.unflatten("all", (2, 4), ("replicate", "shard"))
    lazy_unflatten = world_module._WORLD.registry.created - before
    split_sums = [_sum_over(g) for g in split.get_all_groups()]
    made_unflatten = world_module._WORLD.registry.created - before
    new_keys = _registered() - registered
    split_keys = {(g.rank_seq.key(), g.backend) for g in split.get_all_groups()}
    alias = mesh._flatten("everything")
    return {
        "flat": flat.mesh.tolist(), "flat_names": flat.mesh_dim_names,
        "flat_sum": flat_sum, "made_flatten": made_flatten,
        "lazy": [lazy_flatten, lazy_unflatten],
        "again_same_group": again.get_group() is flat.get_group(), "again": again.mesh.tolist(),
        "split": split.mesh.tolist(), "split_groups": [g.ranks for g in split.get_all_groups()],
        "split_sums": split_sums,
        "made_unflatten": made_unflatten, "new_are_split_groups": new_keys <= split_keys,
        "new_keys": len(new_keys), "alias": alias.mesh.tolist(),
    }


@pytest.mark.slow
def test_flatten_and_unflatten_groups_move_the_right_data(world8):
    array = np.arange(8).reshape(2, 2, 2)
    for rank, out in enumerate(world8.run(reshape_job)):
        c = int(np.nonzero(array == rank)[1][0])
        expected = array[:, c, :].reshape(-1).tolist()
        assert out["flat"] == out["again"] == expected
        assert out["flat_names"] == ("dp_tp",)
        assert out["flat_sum"] == sum(expected)
        assert out["lazy"] == [0, 0] and out["made_flatten"] == 1  # at the first all_reduce
        assert out["again_same_group"]
        assert out["split"] == np.arange(8).reshape(2, 4).tolist()
        row = list(range(4 * (rank // 4), 4 * (rank // 4) + 4))
        assert out["split_groups"] == [[rank % 4, rank % 4 + 4], row]
        assert out["split_sums"] == [2 * (rank % 4) + 4, sum(row)]
        # only groups of the two new dims may be made, and only those not registered already
        assert out["new_are_split_groups"]
        assert out["made_unflatten"] == out["new_keys"] <= 2
        assert out["alias"] == list(range(8))


def value_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    before = world_module._WORLD.registry.created
    twin = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    made_twice = world_module._WORLD.registry.created - before
    restored = pickle.loads(pickle.dumps(mesh))
    other = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    wrapped = DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
    both = DeviceMesh.from_group([mesh.get_group("dp"), mesh.get_group("tp").engine_group],
                                 "cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
    return {
        "equal": twin == mesh and hash(twin) == hash(mesh), "made_twice": made_twice,
        "restored_equal": restored == mesh, "restored_sum": _sum_over(restored.get_group("tp")),
        "different": other != mesh, "repr": repr(mesh),
        "wrapped": wrapped.mesh.tolist(), "wrapped_same": wrapped.get_group() is
        mesh.get_group("tp"), "both_coord": both.get_coordinate(),
        "both_sum": _sum_over(both.get_group("dp")),
    }


@pytest.mark.slow
def test_equality_hash_pickle_repr_from_group(world8):
    for rank, out in enumerate(world8.run(value_job)):
        assert out["equal"] and out["made_twice"] == 0
        assert out["restored_equal"]
        row = range(4 * (rank // 4), 4 * (rank // 4) + 4)
        assert out["restored_sum"] == sum(row)
        assert out["different"]
        assert "dp=2" in out["repr"] and "tp=4" in out["repr"]
        assert out["wrapped"] == list(row) and out["wrapped_same"]
        assert out["both_coord"] == [rank // 4, rank % 4]
        assert out["both_sum"] == 2 * (rank % 4) + 4


def backend_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"),
                            backend_override={"dp": "gloo"})
    return [g.backend for g in mesh.get_all_groups()], _sum_over(mesh.get_group("dp"))


@pytest.mark.slow
def test_backend_override(world8):
    for rank, (backends, total) in enumerate(world8.run(backend_job)):
        assert backends == ["gloo", "gloo"]
        assert total == 2 * (rank % 4) + 4


def test_queries_in_a_simulated_world_need_no_processes(fake_world):
    fake_world(5, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert mesh.get_coordinate() == [1, 1]
    assert mesh.get_group("tp").ranks == [4, 5, 6, 7]
    assert mesh.get_group("dp").ranks == [1, 5]
    assert mesh.get_rank((0, 3)) == 3 and mesh.size("tp") == 4 and mesh.size() == 8
    assert mesh["tp"].mesh.tolist() == [4, 5, 6, 7]


def hosts_job(rank: int):
    import os

    os.environ["TENSORPLAY_HOSTNAME"] = f"node{rank % 2}"  # a round-robin launcher on 2 hosts
    dist.init_process_group("gloo", timeout=30)
    world = world_module._WORLD
    at_init = {"has_all_hosts": world.control.known_hosts() is not None,
               "host_pids": world.epochs.host_pids, "pid": os.getpid()}
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    aware = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), host_aware=True)
    out = {
        "host": plain.host_of()(rank), "others": [plain.host_of()(r) for r in range(4)],
        "aware_mesh": aware.mesh.tolist(), "aware_tp": aware.get_group("tp").ranks,
        "tp_sum": _sum_over(aware.get_group("tp")), "report": aware.describe(), **at_init,
    }
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_hosts_are_gathered_and_host_aware_keeps_tp_inside_a_host():
    from tests import spawn

    for rank, out in enumerate(spawn.run(hosts_job, 4, init=False, timeout=120)):
        assert out["host"] == f"node{rank % 2}"
        assert out["others"] == ["node0", "node1", "node0", "node1"]
        assert out["aware_mesh"] == [[0, 2], [1, 3]]
        assert out["aware_tp"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert out["tp_sum"] == sum(out["aware_tp"])
        assert "0 of 2" in out["report"]  # no "tp" group crosses a host
        # at init each rank read only its own host's ranks; rank 0 alone holds every host
        assert out["has_all_hosts"] == (rank == 0)
        assert sorted(out["host_pids"]) == [r for r in range(4) if r % 2 == rank % 2]
        assert out["host_pids"][rank] == out["pid"]


def cuda_job(rank: int):
    try:
        init_device_mesh("cuda", (1,))
    except dist.ArgumentError as err:
        return str(err)
    return "built"


@pytest.mark.slow
def test_cuda_mesh_without_cuda_says_how_to_fix():
    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA")
    from tests import spawn

    (message,) = spawn.run(cuda_job, 1)
    assert "CUDA is not available" in message and "device_type='cpu'" in message


def test_reshaping_names_are_checked_before_anything_is_created(fake_world):
    fake_world(5, 8)
    world = world_module._WORLD
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    mesh["a", "b"].flatten("ab")
    unnamed = init_device_mesh("cpu", (2, 4))
    before = world.registry.created
    with np.testing.assert_raises_regex(dist.ArgumentError, "already flattens"):
        mesh["a", "c"].flatten("ab")
    with np.testing.assert_raises_regex(dist.ArgumentError, "without dim names"):
        unnamed.unflatten(1, (2, 2), ("x", "y"))
    assert world.registry.created == before  # nothing made by either refused call
    assert unnamed.unflatten(1, (2, 2)).mesh_dim_names is None
    assert init_device_mesh("cpu", (8,)).unflatten(0, (2, 4), ("r", "s")).mesh_dim_names == (
        "r", "s")


def test_building_and_querying_a_mesh_allocates_o_ndim_memory(fake_world):
    """Memory, not time: the Python heap used per rank must not grow with the world size."""
    import tracemalloc

    peaks = {}
    for size in (64, 16_384, 1 << 20):
        fake_world(size - 1, size)
        tracemalloc.start()
        mesh = init_device_mesh("cpu", (-1, 8, 8), mesh_dim_names=("dp", "cp", "tp"))
        groups = [mesh.get_group(d).size() for d in range(3)]
        mesh["dp", "tp"].get_coordinate()
        flat = mesh["dp", "cp"].flatten()
        peaks[size] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert groups == [size // 64, 8, 8] and flat.size() == size // 8
    assert max(peaks.values()) < 100 * 1024, peaks  # ~10 KiB seen; an O(N) step shows at 16K
