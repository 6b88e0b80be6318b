"""DeviceMesh.reshape (mesh views), dim roles and mesh.abstract, in a simulated world.

The oracle is numpy: a view's group along each dim through rank r is the line through r of
``rank_array.reshape(view_shape)``, where rank_array is the mesh's ranks (np.arange for
init_device_mesh, the given array for an explicit mesh). Group identity is the registry's:
``view.get_group(d) is mesh.get_group(d')`` whenever their ordered ranks coincide.
"""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorplay.distributed as dist
from tensorplay.distributed import device_mesh as device_mesh_module
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.errors import ArgumentError, ArgumentTypeError, UnknownDimError
from tensorplay.distributed.geometry.roles import ROLES, AbstractMesh
from tensorplay.distributed.geometry.spec import MeshSpec
from tensorplay.distributed.mesh import views as _views
from tests.laws import examples

LAWS = examples(0.6)
NAMES = ("a", "b", "c", "d", "e")
TITAN = (2, 2, 4, 2, 4)
TITAN_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# -- the numpy reference ------------------------------------------------------------------------


def ref_line(array, rank, dim):
    """The ranks through ``rank`` along ``dim`` of ``array``, in order."""
    coord = [int(c) for c in np.argwhere(array == rank)[0]]
    return array[tuple(slice(None) if d == dim else c for d, c in enumerate(coord))].tolist()


def factor_shapes(n, max_dims=3):
    """Every shape of 1..max_dims dims (sizes >= 1) whose product is ``n``."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out = [(n,)]
    for k in range(2, max_dims + 1):
        for sizes in itertools.product(divisors, repeat=k - 1):
            rest = n // math.prod(sizes) if n % math.prod(sizes) == 0 else 0
            if rest and math.prod(sizes) * rest == n:
                out.append((*sizes, rest))
    return sorted(set(out))


def names_for(shape, prefix="v"):
    return tuple(f"{prefix}{i}" for i in range(len(shape)))


def check_view(view, array, view_shape, rank):
    """Every group of ``view`` through ``rank`` is numpy's line of the reshaped array."""
    reshaped = array.reshape(view_shape)
    assert view.shape == tuple(view_shape)
    assert np.array_equal(np.asarray(view.mesh), reshaped)
    for d in range(len(view_shape)):
        assert view.get_group(d).ranks == ref_line(reshaped, rank, d), (view_shape, rank, d)
    coord = [int(c) for c in np.argwhere(reshaped == rank)[0]]
    assert view.get_coordinate() == coord


def check_identity(view, meshes):
    """A view group whose ordered ranks are those of a group of ``meshes`` is that object."""
    for d in range(view.ndim):
        mine = view.get_group(d)
        for mesh in meshes:
            for e in range(mesh.ndim):
                theirs = mesh.get_group(e)
                if theirs.ranks == mine.ranks and theirs.backend == mine.backend:
                    assert mine is theirs, (view, d, mesh, e)


# -- laws against numpy ------------------------------------------------------------------------


ROOTS = [(8, (2, 4)), (8, (2, 2, 2)), (12, (2, 3, 2)), (16, (2, 2, 4)), (16, (4, 4)),
         (24, (2, 3, 4))]


@pytest.mark.parametrize("world_size,root_shape", ROOTS)
def test_every_view_of_a_root_is_numpys_reshape(fake_world, world_size, root_shape):
    for rank in sorted({0, 1, world_size // 2 + 1, world_size - 1}):
        fake_world(rank, world_size)
        mesh = init_device_mesh("cpu", root_shape, mesh_dim_names=NAMES[:len(root_shape)])
        flats = [mesh[NAMES[i], NAMES[i + 1]].flatten() for i in range(mesh.ndim - 1)]
        array = np.arange(world_size).reshape(root_shape)
        for view_shape in factor_shapes(world_size):
            view = mesh.reshape(view_shape, names_for(view_shape))
            check_view(view, array, view_shape, rank)
            check_identity(view, [mesh, *flats])


@pytest.mark.parametrize("world_size,root_shape", ROOTS[:4])
def test_a_view_of_a_slice_reshapes_the_slices_ranks(fake_world, world_size, root_shape):
    for rank in (0, world_size - 1):
        fake_world(rank, world_size)
        mesh = init_device_mesh("cpu", root_shape, mesh_dim_names=NAMES[:len(root_shape)])
        sliced = mesh[NAMES[0], NAMES[len(root_shape) - 1]]
        array = np.asarray(sliced.mesh)
        for view_shape in factor_shapes(sliced.size()):
            view = sliced.reshape(view_shape, names_for(view_shape))
            check_view(view, array, view_shape, rank)
            check_identity(view, [mesh, sliced])


@pytest.mark.parametrize("seed", range(4))
def test_a_view_of_a_permuted_mesh_keeps_its_rank_order(fake_world, seed):
    """An explicit mesh in no row-major order (a rank table): views still give numpy's
    ranks, and groups the two share are the same objects."""
    order = np.random.default_rng(seed).permutation(12).reshape(3, 4)
    for rank in (0, 5, 11):
        fake_world(rank, 12)
        mesh = DeviceMesh("cpu", order.tolist(), mesh_dim_names=("x", "y"))
        for view_shape in factor_shapes(12):
            view = mesh.reshape(view_shape, names_for(view_shape))
            check_view(view, order, view_shape, rank)
            check_identity(view, [mesh])


def test_a_view_of_a_strided_subset(fake_world):
    """A mesh of every other rank: the view is numpy's reshape of those ranks."""
    ranks = np.arange(0, 32, 2).reshape(4, 4)
    for rank in (0, 6, 30, 1):
        fake_world(rank, 32)
        mesh = DeviceMesh("cpu", ranks.tolist(), mesh_dim_names=("x", "y"))
        view = mesh.reshape((2, 8), ("p", "q"), shared=())
        assert np.array_equal(np.asarray(view.mesh), ranks.reshape(2, 8))
        if rank % 2:
            assert view.get_coordinate() is None
        else:
            check_view(view, ranks, (2, 8), rank)


# -- MeshSpec.same_lines: the geometric check against every rank --------------------------------


spec_shapes = st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=4)


@LAWS
@given(spec_shapes, st.data())
def test_same_lines_agrees_with_comparing_every_ranks_line(shape, data):
    n = math.prod(shape)
    view_shape = data.draw(st.sampled_from(factor_shapes(n, 4)))
    permuted = data.draw(st.booleans())
    if permuted:
        ranks = data.draw(st.permutations(list(range(n))))
        root = MeshSpec.from_ranks(shape, ranks)
    else:
        root = MeshSpec.row_major(shape)
    view = root.reshape(view_shape, None)
    assert np.array_equal(view.array(), root.array().reshape(view_shape))
    for a, b in itertools.product(range(root.ndim), range(view.ndim)):
        expected = all(root.line(r, a) == view.line(r, b) for r in root.ranks())
        assert root.same_lines(a, view, b) == expected, (shape, view_shape, a, b)


def test_a_row_major_reshape_costs_no_table():
    root = MeshSpec.row_major((64, 64, 16, 16))  # a million ranks
    view = root.reshape((64, 64 * 16, 16), None)
    assert view.table is None
    assert root.same_lines(0, view, 0) and root.same_lines(3, view, 2)
    assert not root.same_lines(1, view, 1)


# -- the torchtitan example --------------------------------------------------------------------


def titan(rank, fake_world, roles=True):
    fake_world(rank, 128)
    return init_device_mesh("cpu", TITAN, mesh_dim_names=TITAN_NAMES, mesh_dim_roles={
        "pp": "pipeline", "dp_replicate": "replicate", "dp_shard": "shard", "cp": "context",
        "tp": "tensor"} if roles else None)


@pytest.mark.parametrize("rank", [0, 5, 37, 77, 127])
def test_torchtitan_dense_and_expert_views(fake_world, rank):
    dense = titan(rank, fake_world)
    cp_tp = dense["cp", "tp"].flatten()
    made = dist.world.current_world("test").registry.created
    expert = dense.reshape((2, 2, -1, 8), ("pp", "dp_replicate", "efsdp", "ep"),
                           shared=("pp", "dp_replicate"),
                           mesh_dim_roles={"efsdp": "shard", "ep": "expert"})
    array = np.arange(128).reshape(TITAN)
    check_view(dense, array, TITAN, rank)
    check_view(expert, array, (2, 2, 4, 8), rank)
    assert expert.get_group("pp") is dense.get_group("pp")
    assert expert.get_group("dp_replicate") is dense.get_group("dp_replicate")
    assert expert.get_group("ep") is cp_tp.get_group()  # cp x tp flattened == ep
    assert expert.get_group("efsdp") is dense.get_group("dp_shard")  # same ordered ranks
    assert dist.world.current_world("test").registry.created == made  # no new group at all
    assert expert.mesh_dim_roles == {"pp": "pipeline", "dp_replicate": "replicate",
                                     "efsdp": "shard", "ep": "expert"}
    # the view belongs to the root: slices and flatten work on it
    assert expert["efsdp", "ep"].flatten().get_group().ranks == \
        ref_line(array.reshape(2, 2, 32), rank, 2)
    assert expert["ep"].get_group() is cp_tp.get_group()
    assert expert.parts.root == dense.spec


def test_an_expert_dim_that_cuts_a_dense_dim_gets_new_groups(fake_world):
    """ep = 8 over dp_shard=8, tp=4 takes half of dp_shard: a new group, numpy's ranks."""
    fake_world(13, 64)
    dense = init_device_mesh("cpu", (2, 8, 4), mesh_dim_names=("pp", "dp_shard", "tp"))
    made = dist.world.current_world("test").registry.created
    expert = dense.reshape((2, 4, 8), ("pp", "efsdp", "ep"), shared=("pp",))
    check_view(expert, np.arange(64).reshape(2, 8, 4), (2, 4, 8), 13)
    assert expert.get_group("pp") is dense.get_group("pp")
    world = dist.world.current_world("test")
    assert world.registry.created == made  # efsdp and ep are new layouts: made at first use
    for name in ("efsdp", "ep"):
        dist.all_reduce(np.zeros(2), group=expert.get_group(name))
    assert world.registry.created == made + 2


def test_a_flatten_of_view_dims_slices_the_view_and_is_not_offered_elsewhere(fake_world):
    """examples/train_moe.py's views: "efsdp" x "ep" flattened is dense's "dp_shard" group; the
    name slices the view, and a mesh without those dims neither takes nor suggests it."""
    fake_world(0, 8)
    dense = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    expert = dense.reshape((2, 2, 2), ("dp_replicate", "efsdp", "ep"), shared=("dp_replicate",))
    made = dist.world.current_world("test").registry.created
    efsdp_ep = expert["efsdp", "ep"].flatten("efsdp_ep")
    assert efsdp_ep.get_group() is dense.get_group("dp_shard")
    assert dist.world.current_world("test").registry.created == made  # found, not made
    assert expert["dp_replicate", "efsdp_ep"].get_group("efsdp_ep") is efsdp_ep.get_group()
    with pytest.raises(UnknownDimError) as err:
        dense["efsdp_ep"]
    assert str(err.value) == ("mesh[...]='efsdp_ep': is not a dim name of this mesh. Fix: use "
                              "one of ('dp_replicate', 'dp_shard').")
    with pytest.raises(UnknownDimError, match=r"Fix: use one of \('efsdp',\)"):
        expert["efsdp"]["efsdp_ep"]  # a slice that lacks "ep"


def test_the_view_goes_through_the_cross_rank_check(fake_world, monkeypatch):
    seen = []
    monkeypatch.setattr(_views, "agree", lambda world, what, request: seen.append((what,
                                                                                  request)))
    monkeypatch.setattr(device_mesh_module, "agree",
                        lambda world, what, request: seen.append((what, request)))
    dense = titan(5, fake_world)
    dense.reshape((2, 2, -1, 8), ("pp", "dp_replicate", "efsdp", "ep"),
                  shared=("pp", "dp_replicate"), mesh_dim_roles={"ep": "expert"})
    (init, made), (what, asked) = seen
    assert init == "init_device_mesh()" and made["mesh_dim_roles"][-1] == "tensor"
    assert what == "reshape()"
    assert asked["shape"] == (2, 2, 4, 8) and asked["shared"] == ("pp", "dp_replicate")
    assert asked["mesh_dim_roles"] == ["pipeline", "replicate", None, "expert"]


# -- typed errors that name the argument --------------------------------------------------------


@pytest.mark.parametrize("shape,words", [
    ((3, -1), "the sizes 3 do not divide the mesh's 128 ranks (pp=2, dp_replicate=2"),
    ((2, 2, 3, 8), "the sizes 2 x 2 x 3 x 8 = 96 hold 96 ranks, not the mesh's 128"),
    ((2, 2, -1, 5), "2 x 2 x 5 = 20 do not divide"),
    ((-1, -1), "more than one -1"),
    ((0, 128), "must be positive"),
])
def test_a_size_that_does_not_fit_names_the_dims(fake_world, shape, words):
    dense = titan(0, fake_world)
    with pytest.raises(ArgumentError, match="shape=") as err:
        dense.reshape(shape, names_for(shape))
    assert words in str(err.value) and "Fix:" in str(err.value)


def test_bad_shapes_and_names_are_typed(fake_world):
    dense = titan(0, fake_world)
    with pytest.raises(ArgumentTypeError, match="shape"):
        dense.reshape("128", ("x",))
    with pytest.raises(ArgumentError, match="mesh_dim_names=None: is required"):
        dense.reshape((2, 64))
    with pytest.raises(ArgumentError, match="has 1 names for 2 dims"):
        dense.reshape((2, 64), ("x",))


def test_a_shared_dim_whose_groups_differ_names_a_rank(fake_world):
    dense = titan(5, fake_world)
    with pytest.raises(ArgumentError) as err:
        dense.reshape((4, 32), ("pp", "rest"), shared=("pp",))
    assert "dim 'pp': rank 5's group is [5, 37, 69, 101] in the view but [5, 69] in the " \
        "mesh" in str(err.value)
    assert "Fix:" in str(err.value)


def test_shared_names_must_be_dims_of_both(fake_world):
    dense = titan(0, fake_world)
    with pytest.raises(UnknownDimError, match="shared=.*'tp', which is not a dim of the view"):
        dense.reshape((2, 64), ("pp", "rest"), shared=("tp",))
    with pytest.raises(UnknownDimError, match="not a dim of this mesh"):
        dense.reshape((2, 64), ("pp", "ep"), shared=("ep",))
    with pytest.raises(ArgumentTypeError, match="shared"):
        dense.reshape((2, 64), ("pp", "rest"), shared="pp")
    with pytest.raises(ArgumentError, match="repeats"):
        dense.reshape((2, 64), ("pp", "rest"), shared=("pp", "pp"))


def test_bad_roles_are_typed_and_named(fake_world):
    fake_world(0, 8)
    with pytest.raises(ArgumentError, match="unknown role 'tensr'.*Fix: use one of"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"),
                         mesh_dim_roles={"tp": "tensr"})
    with pytest.raises(UnknownDimError, match="names 'ep', which is not a dim"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"),
                         mesh_dim_roles={"ep": "expert"})
    with pytest.raises(ArgumentTypeError, match="mesh_dim_roles"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), mesh_dim_roles=["tp"])
    with pytest.raises(ArgumentError, match="needs dim names"):
        init_device_mesh("cpu", (2, 4), mesh_dim_roles={"tp": "tensor"})
    with pytest.raises(ArgumentError, match="elastic=True: picks the one 'replicate' dim, "
                       "but no dim has that role. Fix: give exactly one dim"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), elastic=True,
                         mesh_dim_roles={"tp": "tensor"})
    with pytest.raises(ArgumentError, match=r"the roles name 2 \('dp', 'tp'\)"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), elastic=True,
                         mesh_dim_roles={"dp": "replicate", "tp": "replicate"})
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ArgumentError, match="unknown role"):
        mesh.reshape((8,), ("all",), mesh_dim_roles={"all": "everything"})


# -- roles: carried, shown, abstract ----------------------------------------------------------


def test_roles_travel_with_slices_flatten_and_reshape(fake_world):
    dense = titan(5, fake_world)
    assert set(ROLES) >= set(dense.mesh_dim_roles.values())
    assert dense["dp_shard", "tp"].mesh_dim_roles == {"dp_shard": "shard", "tp": "tensor"}
    assert dense["dp_replicate", "dp_shard"].flatten("dp").mesh_dim_roles == {}  # mixed
    fake_world(5, 16)
    mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("r", "s", "tp"),
                            mesh_dim_roles={"r": "shard", "s": "shard", "tp": "tensor"})
    assert mesh["r", "s"].flatten("rs").mesh_dim_roles == {"rs": "shard"}  # common role
    assert mesh["r", "s"].flatten("rs") == mesh["rs"]
    assert mesh["rs", "tp"].mesh_dim_roles == {"rs": "shard", "tp": "tensor"}
    view = mesh.reshape((4, 4), ("rs", "tp"))  # tp kept as-is keeps its role; rs is new
    assert view.mesh_dim_roles == {"tp": "tensor"}
    view = mesh.reshape((4, 4), ("rs", "tp"), mesh_dim_roles={"rs": "replicate"})
    assert view.mesh_dim_roles == {"rs": "replicate", "tp": "tensor"}
    renamed = mesh.reshape((4, 4), ("rs", "cols"))  # same groups, a new name: no role
    assert renamed.mesh_dim_roles == {}
    assert pickle.loads(pickle.dumps(view)).mesh_dim_roles == view.mesh_dim_roles


def test_describe_shows_roles(fake_world):
    dense = titan(5, fake_world)
    text = dense.describe()
    assert "role" in text.split("dims\n")[1].splitlines()[0]
    row = next(line for line in text.splitlines() if line.strip().startswith("2    dp_shard"))
    assert "shard" in row.split("dp_shard", 1)[1]
    plain = titan(5, fake_world, roles=False).describe()
    assert " role " not in plain


def test_abstract_is_equal_across_ranks_and_worlds_and_hashable(fake_world):
    found = []
    for rank in (0, 77):
        dense = titan(rank, fake_world)
        found.append(dense.abstract)
        expert = dense.reshape((2, 2, -1, 8), ("pp", "dp_replicate", "efsdp", "ep"),
                               mesh_dim_roles={"ep": "expert"})
        found.append(expert.abstract)
    assert found[0] == found[2] and found[1] == found[3]
    assert hash(found[0]) == hash(found[2]) and len({*found}) == 2
    assert found[1] == AbstractMesh(("pp", "dp_replicate", "efsdp", "ep"), (2, 2, 4, 8),
                                    ("pipeline", "replicate", None, "expert"))
    assert found[1].role("ep") == "expert" and found[1].ndim == 4
    with pytest.raises(AttributeError):
        found[0].shape = (1,)  # frozen
    fake_world(0, 8)  # another world, the same shape: equal abstract without roles
    a = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")).abstract
    fake_world(3, 8)
    assert a == init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")).abstract
    assert a != init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"),
                                 mesh_dim_roles={"tp": "tensor"}).abstract


def test_a_million_rank_view_costs_o_ndim(fake_world):
    fake_world(123_457, 1 << 20)
    dense = init_device_mesh("cpu", (8, 4, 64, 16, 32),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    expert = dense.reshape((8, 4, -1, 64), ("pp", "dp_replicate", "efsdp", "ep"),
                           shared=("pp", "dp_replicate"))
    assert expert.spec.table is None
    coord = expert.get_coordinate()
    assert expert.get_rank(coord) == 123_457
    assert expert.get_group("ep").ranks[:2] == [123_456 - 123_456 % 64,
                                                123_456 - 123_456 % 64 + 1]


# -- real gloo ranks: views move the right bytes, and become torch meshes ------------------------


def views_job(rank: int):
    import torch
    import torch.distributed as torch_dist

    def summed(group) -> int:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        return int(x.item())

    dense = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    cp_tp = dense["cp", "tp"].flatten()
    expert = dense.reshape((2, 4), ("dp", "ep"), shared=("dp",))
    cut = init_device_mesh("cpu", (2, 4), mesh_dim_names=("x", "y")).reshape((4, 2), ("a", "b"))
    torch_expert, torch_cut = expert.to_torch(), cut.to_torch()
    return {
        "ep": expert.get_group("ep").ranks, "ep_sum": summed(expert.get_group("ep")),
        "ep_is_cp_tp": expert.get_group("ep") is cp_tp.get_group(),
        "torch_ep": torch_dist.get_process_group_ranks(torch_expert.get_group("ep")),
        "same_root": torch_expert._get_root_mesh() is dense.to_torch(),
        "torch_cut": [torch_dist.get_process_group_ranks(torch_cut.get_group(n)) for n in "ab"],
        "cut": [cut.get_group(n).ranks for n in "ab"],
    }


@pytest.mark.slow
def test_views_on_gloo_move_data_and_convert_to_torch(world8):
    array = np.arange(8)
    for rank, out in enumerate(world8.run(views_job)):
        ep = ref_line(array.reshape(2, 4), rank, 1)
        assert out["ep"] == out["torch_ep"] == ep and out["ep_sum"] == sum(ep)
        assert out["ep_is_cp_tp"] and out["same_root"]
        assert out["torch_cut"] == out["cut"] == [ref_line(array.reshape(4, 2), rank, d)
                                                  for d in (0, 1)]


# -- the five torchtitan views, from outside: numpy's groups, one object per layout -------------


SMALL = {"data": ((2, 4, 2, 2), ("pp", "batch", "cp", "tp")),
         "fsdp": ((2, 2, 2, 2, 2), TITAN_NAMES),
         "dense": ((2, 2, 4, 2), ("pp", "dp_replicate", "fsdp", "tp")),
         "expert": ((2, 2, 2, 4), ("pp", "dp_replicate", "efsdp", "ep"))}


@pytest.mark.parametrize("rank", range(0, 32, 3))
def test_every_group_of_five_views_is_numpys_and_coinciding_layouts_are_one_object(
        fake_world, rank):
    """torchtitan's five views of a 32-rank world (pp=dp_replicate=dp_shard=cp=tp=2) through
    the public API only: each group is the line of numpy's reshape of arange(32), the same
    ordered ranks are the same object across every view (before and after the groups are
    made), and the loss view (batch x cp flattened) is numpy's too."""
    fake_world(rank, 32)
    root = init_device_mesh("cpu", (32,), mesh_dim_names=("world",))
    views = {name: root.reshape(shape, names) for name, (shape, names) in SMALL.items()}
    loss = views["data"]["batch", "cp"].flatten("loss")
    array = np.arange(32)
    seen: dict[tuple, object] = {}
    for name, (shape, _) in SMALL.items():
        check_view(views[name], array, shape, rank)
        for d in range(len(shape)):
            group = views[name].get_group(d)
            assert seen.setdefault(tuple(group.ranks), group) is group, (name, d)
    pp, _, _, tp = (int(c) for c in np.argwhere(array.reshape(SMALL["data"][0]) == rank)[0])
    assert loss.get_group().ranks == array.reshape(SMALL["data"][0])[pp, :, :, tp] \
        .reshape(-1).tolist()
    assert seen.setdefault(tuple(loss.get_group().ranks), loss.get_group()) is loss.get_group()
    for group in list(seen.values()):  # made at first use: still the registry's object
        dist.all_reduce(np.zeros(1), group=group)
    again = {name: root.reshape(shape, names) for name, (shape, names) in SMALL.items()}
    for name, (shape, _) in SMALL.items():
        for d in range(len(shape)):
            assert again[name].get_group(d) is seen[tuple(again[name].get_group(d).ranks)]
    assert dist.world.current_world("test").registry.created == len(seen)  # each layout made once
