"""DeviceMesh in a simulated world: every rank of small worlds, checked against numpy and against
PyTorch's own DeviceMesh on its fake backend; a world of 1,048,576 ranks; group-creation counts.

Our "fake" world lives in this process only and never touches torch.distributed, so each case
builds PyTorch's answers first (in its fake world), destroys that world, then builds ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import numpy as np
import pytest
import torch.distributed as torch_dist

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.job import lifecycle as tp_world
from tensorplay.distributed.mesh.parts import MeshParts

NAMES = ("a", "b", "c")
SHAPES = {
    8: [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4)],
    12: [(12,), (3, 4), (2, 6), (2, 3, 2), (3, 2, 2)],
    16: [(16,), (4, 4), (2, 8), (2, 2, 4), (4, 2, 2)],
}
CASES = [(n, shape) for n, shapes in SHAPES.items() for shape in shapes]


@contextlib.contextmanager
def fake_world(rank, size):
    """Our simulated world as ``rank`` of ``size``; destroyed on the way out."""
    dist.init_process_group("fake", rank=rank, world_size=size)
    try:
        assert not torch_dist.is_initialized(), "our fake world started torch.distributed"
        yield tp_world.current_world("test")
    finally:
        dist.destroy_process_group()


# -- the brute-force reference ------------------------------------------------------------


def ref_coordinate(array, rank):
    found = np.argwhere(array == rank)
    return None if len(found) == 0 else [int(c) for c in found[0]]


def ref_select(array, dims, rank):
    """Sub-array of ``dims`` (ascending) through ``rank``."""
    coord = ref_coordinate(array, rank)
    return array[tuple(slice(None) if d in dims else c for d, c in enumerate(coord))]


def ref_line(array, rank, dim):
    return ref_select(array, (dim,), rank).tolist()


def factorizations(n):
    return [(f, n // f) for f in range(1, n + 1) if n % f == 0]


def ordered_subsets(ndim, min_size=1):
    return [dims for k in range(min_size, ndim + 1)
            for dims in itertools.combinations(range(ndim), k)]


# -- one helper per law --------------------------------------------------------------------


def check_array(mesh, array, names):
    """mesh, shape, sizes and names are the reference's."""
    assert mesh.mesh.tolist() == array.tolist()
    assert mesh.shape == array.shape and mesh.ndim == array.ndim
    assert mesh.size() == array.size
    assert [mesh.size(d) for d in range(mesh.ndim)] == list(array.shape)
    assert mesh.mesh_dim_names == names


def check_coordinates(mesh, array, rank):
    """get_coordinate() finds this rank; get_rank(coordinate) reads the array."""
    assert mesh.get_coordinate() == ref_coordinate(array, rank)
    assert mesh.get_rank() == rank
    for coord in np.ndindex(*array.shape):
        assert mesh.get_rank(list(coord)) == array[coord]


def check_groups(mesh, array, rank):
    """Along each dim: local rank == coordinate, group == the array's line, in mesh order."""
    coord = ref_coordinate(array, rank)
    groups = mesh.get_all_groups()
    assert len(groups) == array.ndim
    for dim in range(array.ndim):
        group = mesh.get_group(dim)
        line = ref_line(array, rank, dim)
        assert group is groups[dim]
        assert group.ranks == line and dist.get_process_group_ranks(group) == line
        assert group.size() == len(line) and group.rank() == coord[dim]
        assert mesh.get_local_rank(dim) == coord[dim]
        if mesh.mesh_dim_names:
            name = mesh.mesh_dim_names[dim]
            assert mesh.get_local_rank(name) == coord[dim] and mesh.get_group(name) is group
    if array.ndim == 1:
        assert mesh.get_local_rank() == coord[0] and mesh.get_group() is groups[0]


def check_mesh(mesh, array, rank, names):
    check_array(mesh, array, names)
    check_coordinates(mesh, array, rank)
    check_groups(mesh, array, rank)


def check_slices(mesh, array, rank):
    """mesh[names] for every ordered subset of names (non-adjacent too) is the sub-array
    through this rank, and reuses the parent's groups."""
    for dims in ordered_subsets(array.ndim):
        names = tuple(mesh.mesh_dim_names[d] for d in dims)
        sub = mesh[names[0] if len(names) == 1 else names]
        check_mesh(sub, ref_select(array, dims, rank), rank, names)
        for i, d in enumerate(dims):
            assert sub.get_group(i) is mesh.get_group(d)


def check_flattens(mesh, array, rank):
    """flatten() of the mesh and of every slice of 2+ dims is the sub-array, raveled."""
    flat = mesh.flatten()
    merged = None if mesh.mesh_dim_names is None else ("_".join(mesh.mesh_dim_names),)
    check_mesh(flat, array.reshape(-1), rank, merged)
    if mesh.mesh_dim_names is None:
        return
    for dims in ordered_subsets(array.ndim, min_size=2):
        names = tuple(mesh.mesh_dim_names[d] for d in dims)
        expected = ref_select(array, dims, rank).reshape(-1)
        name = "_".join(names)
        check_mesh(mesh[names].flatten(), expected, rank, (name,))
        check_mesh(mesh[name], expected, rank, (name,))  # the root slices by the new name


def check_unflattens(mesh, array, rank):
    """unflatten(d, sizes) reshapes axis d; its groups are the new array's lines."""
    for dim, size in enumerate(array.shape):
        for sizes in factorizations(size):
            names = None
            if mesh.mesh_dim_names is not None:
                new = (f"{mesh.mesh_dim_names[dim]}0", f"{mesh.mesh_dim_names[dim]}1")
                names = mesh.mesh_dim_names[:dim] + new + mesh.mesh_dim_names[dim + 1 :]
            split = mesh.unflatten(dim, sizes, None if names is None else new)
            expected = array.reshape(array.shape[:dim] + sizes + array.shape[dim + 1 :])
            check_mesh(split, expected, rank, names)


# -- (a) every rank of small worlds against numpy ------------------------------------------


@pytest.mark.parametrize("size,shape", CASES, ids=str)
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
def test_every_rank_agrees_with_numpy(size, shape, named):
    array = np.arange(size).reshape(shape)
    names = NAMES[: len(shape)] if named else None
    for rank in range(size):
        with fake_world(rank, size):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            check_mesh(mesh, array, rank, names)
            if named:
                check_slices(mesh, array, rank)
            check_flattens(mesh, array, rank)
            check_unflattens(mesh, array, rank)


def test_worked_example_2x4():
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert mesh.get_coordinate() == [1, 1]
        assert mesh.get_group("tp").ranks == [4, 5, 6, 7]
        assert mesh.get_group("dp").ranks == [1, 5]
        assert mesh["tp"].get_coordinate() == [1]


def test_permuted_mesh_every_rank():
    # On [[3, 1], [2, 0]] local ranks follow the mesh, not sorted rank numbers.
    array = np.array([[3, 1], [2, 0]])
    for rank in range(4):
        with fake_world(rank, 4):
            mesh = DeviceMesh("cpu", array.tolist(), mesh_dim_names=("x", "y"))
            check_mesh(mesh, array, rank, ("x", "y"))
            check_slices(mesh, array, rank)
            check_flattens(mesh, array, rank)
            check_unflattens(mesh, array, rank)


def test_subset_mesh_every_rank():
    array = np.array([[4, 6], [5, 7]])
    for rank in range(8):
        with fake_world(rank, 8):
            mesh = DeviceMesh("cpu", array.tolist(), mesh_dim_names=("x", "y"))
            if rank not in array:
                assert mesh.get_coordinate() is None
                continue
            check_mesh(mesh, array, rank, ("x", "y"))
            check_slices(mesh, array, rank)
            check_flattens(mesh, array, rank)
            check_unflattens(mesh, array, rank)


def test_unflatten_after_flatten_reshapes_freely():
    # (2, 6) flattened is 0..11; splitting it as (3, 4) is a plain reshape.
    for rank in (0, 7, 11):
        with fake_world(rank, 12):
            flat = init_device_mesh("cpu", (2, 6), mesh_dim_names=("a", "b")).flatten()
            split = flat.unflatten(0, (3, 4), ("x", "y"))
            check_mesh(split, np.arange(12).reshape(3, 4), rank, ("x", "y"))


# -- (b) against PyTorch's DeviceMesh on its fake backend -----------------------------------


def torch_answers(rank, size, shape, names):
    """Everything we compare, asked of PyTorch's DeviceMesh in its fake world."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch_dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        assert not dist.is_initialized()
        mesh = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
        return answers(mesh, torch_dist.get_process_group_ranks, "_flatten", "_unflatten")
    finally:
        torch_dist.destroy_process_group()


def our_answers(rank, size, shape, names):
    with fake_world(rank, size):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return answers(mesh, dist.get_process_group_ranks, "flatten", "unflatten")


def answers(mesh, group_ranks, flatten, unflatten):
    """The same questions asked of either DeviceMesh, as plain data."""

    def describe(m):
        return {
            "mesh": m.mesh.tolist(),
            "coordinate": list(m.get_coordinate()),
            "local": [m.get_local_rank(d) for d in range(m.ndim)],
            "groups": [group_ranks(m.get_group(d)) for d in range(m.ndim)],
            "names": tuple(m.mesh_dim_names),
        }

    names = mesh.mesh_dim_names
    out = {"root": describe(mesh)}
    for dims in ordered_subsets(mesh.ndim):
        picked = tuple(names[d] for d in dims)
        out[picked] = describe(mesh[picked])
        if len(dims) > 1:
            out[("flat", picked)] = describe(getattr(mesh[picked], flatten)("_".join(picked)))
    for dim, size in enumerate(mesh.shape):
        for sizes in factorizations(size):
            if 1 in sizes:
                continue
            new = (f"{names[dim]}0", f"{names[dim]}1")
            out[("split", dim, sizes)] = describe(getattr(mesh, unflatten)(dim, sizes, new))
    return out


ORACLE_CASES = [(n, shape) for n in (8, 16) for shape in SHAPES[n]]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("size,shape", ORACLE_CASES, ids=str)
def test_every_rank_agrees_with_pytorch(size, shape):
    names = NAMES[: len(shape)]
    for rank in range(size):
        theirs = torch_answers(rank, size, shape, names)
        ours = our_answers(rank, size, shape, names)
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key] == theirs[key], f"rank {rank}, {key}"


# -- (c) a world of 1,048,576 ranks --------------------------------------------------------

BIG = 1 << 20


@pytest.mark.parametrize("rank", [0, 1, BIG // 2 + 12345, BIG - 9, BIG - 1])
def test_a_million_ranks_2d(rank):
    a, b = divmod(rank, 8)
    with fake_world(rank, BIG) as world:
        mesh = init_device_mesh("cpu", (-1, 8), mesh_dim_names=("dp", "tp"))
        assert world.registry.created == 2
        assert mesh.shape == (BIG // 8, 8) and mesh.get_coordinate() == [a, b]
        assert mesh.get_rank([a, b]) == rank and mesh.get_rank([BIG // 8 - 1, 7]) == BIG - 1
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        assert tp.ranks == list(range(rank - b, rank - b + 8)) and tp.rank() == b
        assert dp.size() == BIG // 8 and dp.rank() == a
        for i in (0, 1, a, BIG // 8 - 1):
            assert dp.global_rank(i) == 8 * i + b
        assert dp.group_rank(rank) == a and dp.group_rank(rank ^ 1) is None
        column = mesh["dp"]
        assert column.get_coordinate() == [a] and column.get_group() is dp
        assert np.array_equal(column.mesh.numpy(), np.arange(b, BIG, 8))
        flat = mesh.flatten()
        assert flat.get_coordinate() == [rank] and flat.get_group().size() == BIG
        assert flat.get_group() is world.default_group
        assert world.registry.created == 2


@pytest.mark.parametrize("rank", [0, BIG // 2 + 12345, BIG - 1])
def test_a_million_ranks_3d(rank):
    a, rest = divmod(rank, 64)
    b, c = divmod(rest, 8)
    with fake_world(rank, BIG) as world:
        mesh = init_device_mesh("cpu", (-1, 8, 8), mesh_dim_names=("dp", "cp", "tp"))
        assert world.registry.created == 3
        assert mesh.shape == (BIG // 64, 8, 8) and mesh.get_coordinate() == [a, b, c]
        assert [mesh.get_local_rank(n) for n in ("dp", "cp", "tp")] == [a, b, c]
        sizes = [mesh.get_group(d).size() for d in range(3)]
        assert sizes == [BIG // 64, 8, 8]
        assert mesh.get_group("cp").ranks == [64 * a + 8 * i + c for i in range(8)]
        assert mesh.get_group("dp").global_rank(BIG // 64 - 1) == BIG - 64 + 8 * b + c
        sliced = mesh["dp", "tp"]  # non-adjacent dims
        assert sliced.shape == (BIG // 64, 8) and sliced.get_coordinate() == [a, c]
        assert sliced.get_rank([1, 3]) == 64 + 8 * b + 3
        flat = sliced.flatten()
        assert world.registry.created == 3  # a flatten's group is made at its first use
        group = flat.get_group()
        assert group.engine_group is None  # made (the fake's is None)
        assert world.registry.created == 4
        assert flat.mesh_dim_names == ("dp_tp",) and flat.get_coordinate() == [8 * a + c]
        assert group.size() == BIG // 8 and group.rank() == 8 * a + c
        for i in (0, 7, 8, 8 * a + c, BIG // 8 - 1):
            assert group.global_rank(i) == 64 * (i // 8) + 8 * b + i % 8
        assert mesh["dp_tp"].get_group() is group
        assert world.registry.created == 4


# -- (d) a frozen value ---------------------------------------------------------------------


def test_a_mesh_is_a_frozen_value_whose_key_holds_its_backends():
    with fake_world(5, 8) as world:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with pytest.raises(AttributeError, match="DeviceMesh is immutable"):
            mesh._parts = mesh.parts
        with pytest.raises(AttributeError, match="DeviceMesh is immutable"):
            mesh.extra = 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            mesh.parts.groups = ()  # type: ignore[misc]
        spec = mesh.spec
        # as on an nccl world, where backend_override={"dp": "gloo"} gives ("gloo", "nccl")
        nccl = DeviceMesh.of(MeshParts.root_of(world, "cuda", spec, ("nccl", "nccl"), ()))
        mixed = DeviceMesh.of(MeshParts.root_of(world, "cuda", spec, ("gloo", "nccl"), ()))
        assert nccl != mixed and len({nccl, mixed}) == 2
        assert DeviceMesh.of(MeshParts.root_of(world, "cuda", spec, ("gloo", "nccl"), ())) \
            == mixed
        assert init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")) == mesh


# -- the neighbour query: mesh.shift(dim, disp, periodic), as MPI's Cart_shift -------------------
def _shift_reference(array: np.ndarray, rank: int, dim: int, disp: int, periodic: bool):
    """(source, dest) by brute force over the materialised rank array."""
    coord = [int(c) for c in np.argwhere(array == rank)[0]]

    def at(step: int):
        i = coord[dim] + step
        if periodic:
            i %= array.shape[dim]
        elif not 0 <= i < array.shape[dim]:
            return None
        return int(array[tuple(coord[:dim] + [i] + coord[dim + 1:])])

    return at(-disp), at(disp)


SHIFT_MESHES = [(n, shape, None) for n, shape in CASES] + [
    (8, (2, 4), [[3, 1, 7, 5], [2, 0, 6, 4]]),  # a permuted mesh keeps a rank table
    (12, (2, 3), [[11, 0, 5], [2, 9, 4]]),  # a subset of the world
]


@pytest.mark.parametrize(("n", "shape", "explicit"), SHIFT_MESHES,
                         ids=[f"{n}-{s}-{'explicit' if e else 'row'}" for n, s, e in SHIFT_MESHES])
def test_shift_matches_a_brute_force_reference_on_every_rank(n, shape, explicit):
    for rank in range(n):
        with fake_world(rank, n):
            if explicit is None:
                mesh = init_device_mesh("cpu", shape)
            else:
                mesh = DeviceMesh("cpu", explicit)
            array = np.asarray(mesh.spec.array())
            if mesh.get_coordinate() is None:
                with pytest.raises(dist.NotAMemberError):
                    mesh.shift(0)
                continue
            for dim, periodic in itertools.product(range(len(shape)), (False, True)):
                size = shape[dim]  # steps within, at and past the ends, both ways
                for disp in sorted({-size - 1, -size, -2, -1, 0, 1, 2, size - 1, size, size + 1}):
                    got = mesh.shift(dim, disp, periodic)
                    assert got == _shift_reference(array, rank, dim, disp, periodic), (
                        rank, dim, disp, periodic)
                    back = mesh.shift(dim, -disp, periodic)
                    assert back == got[::-1]  # a shift back swaps source and dest


def test_shift_laws_on_a_million_ranks():
    """Periodic shifts compose, and source and dest invert each other, on chosen ranks of a
    (1024, 32, 32) mesh, without materialising it."""
    shape = (1024, 32, 32)
    for rank in (0, 5, 31, 32 * 32 - 1, 123_457, (1 << 20) - 1):
        with fake_world(rank, 1 << 20):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b", "c"))
            coord = mesh.get_coordinate()
            for dim, name in enumerate(("a", "b", "c")):
                step = 32 * 32 if dim == 0 else (32 if dim == 1 else 1)
                dest = mesh.shift(name, 3, periodic=True)[1]
                assert dest == rank + ((coord[dim] + 3) % shape[dim] - coord[dim]) * step
                twice = mesh.shift(name, 6, periodic=True)[1]  # two shifts of 3 are one of 6
                assert twice == rank + ((coord[dim] + 6) % shape[dim] - coord[dim]) * step
                source, dest = mesh.shift(name, 3)
                assert (dest is None) == (coord[dim] + 3 >= shape[dim])
                assert (source is None) == (coord[dim] - 3 < 0)


def test_shift_names_its_bad_arguments():
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert mesh.shift("tp") == (4, 6)
        assert mesh.shift("tp", 3) == (None, None)
        assert mesh.shift("tp", 3, periodic=True) == (6, 4)
        assert mesh.shift("dp") == (1, None)
        with pytest.raises(dist.ArgumentError, match=r"^disp=1\.0: must be an int"):
            mesh.shift("tp", 1.0)
        with pytest.raises(dist.ArgumentError, match=r"^periodic=1: must be True or False"):
            mesh.shift("tp", 1, 1)
        with pytest.raises(dist.UnknownDimError):
            mesh.shift("pp")
        with pytest.raises(dist.ArgumentError, match=r"^mesh_dim=None: is required"):
            mesh.shift()
