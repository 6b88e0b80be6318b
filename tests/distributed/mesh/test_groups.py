"""A mesh's groups (``mesh/groups.py``): how many each operation makes, when (at once or at
first use: ``eager_groups``), the registry's one object per layout, the default backend, the
layout of ``init_device_mesh``, and meshes over groups made elsewhere (``from_group``), in a
simulated world."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.errors import ArgumentError, ArgumentTypeError
from tensorplay.distributed.geometry.topology import Hosts
from tensorplay.distributed.mesh import groups
from tests.distributed.mesh.test_value import (
    CASES,
    NAMES,
    fake_world,
    ordered_subsets,
    ref_line,
    ref_select,
)
from tests.distributed.mesh.test_views import TITAN, TITAN_NAMES, titan

# -- how many groups each operation creates -------------------------------------------


def distinct_new_lines(array, rank, size):
    """Lines through ``rank`` that are not the world (the world group already exists)."""
    lines = {tuple(ref_line(array, rank, d)) for d in range(array.ndim)}
    return len(lines - {tuple(range(size))})


@pytest.mark.parametrize("size,shape", CASES, ids=str)
def test_group_creation_counts(size, shape):
    array = np.arange(size).reshape(shape)
    names = NAMES[: len(shape)]
    for rank in range(size):
        with fake_world(rank, size) as world:  # every group made as its mesh is
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names, eager_groups=True)
            made = world.registry.created
            assert made == distinct_new_lines(array, rank, size)
            if 1 not in shape and len(shape) > 1:
                assert made == len(shape)  # one per dim, not one per line
            again = init_device_mesh("cpu", shape, mesh_dim_names=names)
            assert again == mesh and world.registry.created == made
            for dims in ordered_subsets(len(shape)):
                mesh[tuple(names[d] for d in dims)]
            assert world.registry.created == made  # slicing creates none
            known = {tuple(range(size))} | {tuple(ref_line(array, rank, d))
                                            for d in range(len(shape))}
            for dims in ordered_subsets(len(shape), min_size=2):
                picked = tuple(names[d] for d in dims)
                merged = tuple(ref_select(array, dims, rank).reshape(-1).tolist())
                before = world.registry.created
                mesh[picked].flatten()
                assert world.registry.created == before + (merged not in known)  # one, if new
                known.add(merged)
                after = world.registry.created
                mesh[picked].flatten()
                assert world.registry.created == after  # the same flatten again: none
            assert mesh.flatten().get_group() is world.default_group


def test_flatten_creates_exactly_one_group_at_its_first_use():
    with fake_world(6, 16) as world:
        mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("a", "b", "c"))
        assert world.registry.created == 3
        flat = mesh["a", "c"].flatten()
        assert world.registry.created == 3
        assert flat.get_group().ranks == [4, 5, 6, 7, 12, 13, 14, 15]
        dist.all_reduce(np.zeros(1), group=flat.get_group())
        assert world.registry.created == 4
        assert mesh["a", "c"].flatten().get_group() is flat.get_group()
        dist.all_reduce(np.zeros(1), group=mesh["a_c"].get_group())
        assert world.registry.created == 4


def test_unflatten_creates_only_the_new_dims():
    with fake_world(5, 16) as world:
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp", "tp"))
        assert world.registry.created == 2
        split = mesh.unflatten("tp", (2, 4), ("tp0", "tp1"))
        assert world.registry.created == 2  # at first use
        assert [split.get_group(n).engine_group for n in ("tp0", "tp1")] == [None, None]
        assert world.registry.created == 4
        assert split.get_group("dp") is mesh.get_group("dp")
        assert split.get_group("tp1").ranks == [4, 5, 6, 7]


# -- groups made at first use, or at once -------------------------------------------------------


def made(mesh):
    return [mesh.get_group(d).made for d in range(mesh.ndim)]


def test_a_views_groups_are_made_at_first_use_and_stay_one_object(fake_world):
    dense = titan(5, fake_world)
    world = dist.world.current_world("test")
    assert made(dense) == [True] * 5 and world.registry.created == 5  # init_device_mesh: at once
    cut = dense.reshape((4, 32), ("a", "b"))
    sliced, flat = cut["b"], cut.flatten()
    assert made(cut) == [False, False] and world.registry.created == 5
    assert flat.get_group() is world.default_group  # the world's, made with it
    group = cut.get_group("b")
    assert sliced.get_group() is group and cut.reshape((4, 32), ("a", "b")).get_group("b") \
        is group
    dist.all_reduce(np.zeros(2), group=group)
    assert made(cut) == [False, True] and world.registry.created == 6
    assert dense.reshape((4, 32), ("a", "b")).get_group("b") is group  # found, made
    with pytest.raises(ArgumentError, match=r"send\(\): the 'a' group \[5, 37, 69, 101\] has "
                       r"no communicator yet.*Fix: make it first on every member"):
        dist.send(np.zeros(1), 37, group=cut.get_group("a"))
    assert world.registry.created == 6


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_eager_groups_makes_every_group_when_its_mesh_is_made(fake_world, monkeypatch, how):
    fake_world(5, 128)
    if how == "environment":
        monkeypatch.setenv("TENSORPLAY_EAGER_GROUPS", "1")
    dense = init_device_mesh("cpu", TITAN, mesh_dim_names=TITAN_NAMES,
                             **({"eager_groups": True} if how == "keyword" else {}))
    cut = dense.reshape((4, 32), ("a", "b"))
    assert made(cut) == [True, True] and made(cut["a", "b"].flatten()) == [True]
    assert made(dense.unflatten("tp", (2, 2), ("t0", "t1"))) == [True] * 6


def test_eager_groups_false_makes_none_until_first_use(fake_world, monkeypatch):
    fake_world(5, 128)
    monkeypatch.setenv("TENSORPLAY_EAGER_GROUPS", "0")
    dense = init_device_mesh("cpu", TITAN, mesh_dim_names=TITAN_NAMES)
    assert made(dense) == [False] * 5
    assert dist.world.current_world("test").registry.created == 0
    monkeypatch.setenv("TENSORPLAY_EAGER_GROUPS", "yes")
    with pytest.raises(dist.LaunchEnvError, match="TENSORPLAY_EAGER_GROUPS='yes': expected "
                       "1 or 0"):
        init_device_mesh("cpu", TITAN, mesh_dim_names=TITAN_NAMES)
    with pytest.raises(ArgumentTypeError, match="eager_groups='yes'"):
        init_device_mesh("cpu", TITAN, mesh_dim_names=TITAN_NAMES, eager_groups="yes")


def test_describe_lists_the_communicators_their_sharers_and_the_dims_without_one(fake_world):
    dense = titan(5, fake_world)
    dense["cp", "tp"].flatten()
    expert = dense.reshape((2, 2, -1, 8), ("pp", "dp_replicate", "efsdp", "ep"))
    text = expert.describe()
    section = text[text.index("communicators of rank 5"):]
    assert section.splitlines()[0] == "communicators of rank 5 (6 made in this world)"
    assert ("[5, 69]                                 fake     'pp' of (pp, dp_replicate, "
            "dp_shard, cp, tp); 'pp' of (pp, dp_replicate, efsdp, ep)") in section
    assert section.endswith("not made yet (made at first use): 'ep' [0, 1, 2, 3, 4, 5, 6, 7]")
    dist.all_reduce(np.zeros(1), group=expert.get_group("ep"))
    section = expert.describe()[text.index("communicators of rank 5"):]
    assert "'cp_tp' of (cp_tp); 'ep' of (pp, dp_replicate, efsdp, ep)" in section
    assert section.endswith("every dim of this mesh has its communicator")
    assert "communicators of" not in expert.describe(rank=6)  # another rank's: geometry only


# -- the helpers the layers call -------------------------------------------------------------


@pytest.mark.parametrize("given,env,expected", [
    (None, None, (True, False)), (True, None, (True, True)), (False, None, (False, False)),
    (None, "1", (True, True)), (None, "0", (False, False)), (True, "0", (True, True))])
def test_eagerness_reads_the_argument_then_the_environment(monkeypatch, given, env,
                                                             expected):
    if env is not None:
        monkeypatch.setenv("TENSORPLAY_EAGER_GROUPS", env)
    assert groups.eagerness(given) == expected


def test_a_groups_errors_and_uses_name_its_mesh_dim():
    with fake_world(5, 8) as world:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_all_groups()
        assert (dp.ranks, tp.ranks) == ([1, 5], [4, 5, 6, 7])
        assert (dp.label, tp.label) == ("the 'dp' group [1, 5]", "the 'tp' group [4-7]")
        assert world.registry.uses(tp) == ["'tp' of (dp, tp)"]
        unnamed = groups.make_groups(world, DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]]).spec,
                                     ("fake", "fake"))
        assert unnamed == (dp, tp)  # the registry's objects, whoever asks
        assert world.registry.uses(tp) == ["'tp' of (dp, tp)", "dim 1 of a (2, 4) mesh"]


def test_the_default_backend_is_the_engines_for_the_device():
    with fake_world(0, 4) as world:
        assert groups.mesh_backend(world, "cpu") == "fake"
        assert init_device_mesh("cpu", (4,)).get_group().backend == "fake"


def test_rank_0_is_told_when_a_dims_groups_cross_hosts(caplog, monkeypatch):
    """8 ranks dealt round-robin to 2 hosts: both (2, 4) "tp" rows span both hosts ([0, 1,
    2, 3] is on hosts 0, 1, 0, 1); host_aware=True lays ranks out host by host instead."""
    with fake_world(0, 8) as world:
        dealt = Hosts.round_robin(8, 2)
        monkeypatch.setattr(world.control, "known_hosts", lambda: dealt)
        monkeypatch.setattr(world.control, "hosts", lambda: dealt)
        caplog.set_level(logging.WARNING, logger="tensorplay.distributed")
        spec = groups.laid_out(world, "cpu", (2, 4), ("dp", "tp"), host_aware=False)
        assert spec.array().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert [r.getMessage() for r in caplog.records][0].startswith(
            "init_device_mesh(2, 4): mesh dim 'tp': 2 of 2 groups cross hosts; a host-aware "
            "rank order keeps them inside one host")
        aware = groups.laid_out(world, "cpu", (2, 4), ("dp", "tp"), host_aware=True)
        assert aware.array().tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]


# -- meshes over groups made elsewhere: DeviceMesh.from_group -------------------------------


def test_from_group_wraps_groups_and_makes_none():
    with fake_world(5, 8) as world:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        made_before = world.registry.created
        wrapped = DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
        assert wrapped.mesh.tolist() == [4, 5, 6, 7] and wrapped.get_coordinate() == [1]
        assert wrapped.get_group() is mesh.get_group("tp")
        both = DeviceMesh.from_group(mesh.get_all_groups(), "cpu", [[0, 1, 2, 3], [4, 5, 6, 7]],
                                     mesh_dim_names=("dp", "tp"))
        assert both == mesh and world.registry.created == made_before


def test_from_group_names_what_does_not_fit():
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_all_groups()
        with pytest.raises(ArgumentError, match=r"^group=\[\]: is empty"):
            DeviceMesh.from_group([], "cpu")
        with pytest.raises(ArgumentError, match="mesh=None: is required with several groups"):
            DeviceMesh.from_group([dp, tp], "cpu")
        with pytest.raises(ArgumentError, match=r"^group\[0\]=\[4, 5, 6, 7\]: is not the "
                           r"mesh line through rank 5 along dim 0 \(\[1, 5\]\)"):
            DeviceMesh.from_group([tp, dp], "cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
        with pytest.raises(ArgumentError, match=r"^group\[1\]='tp': is not a process group"):
            DeviceMesh.from_group([dp, "tp"], "cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
        with pytest.raises(ArgumentTypeError, match="^device_type=None: expected str"):
            DeviceMesh.from_group(tp, None)
