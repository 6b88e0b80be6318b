"""Host maps, crossing groups, the host-aware rank order and its advice, checked by brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorplay.distributed.errors import ArgumentError, ArgumentTypeError
from tensorplay.distributed.geometry.spec import MeshSpec
from tensorplay.distributed.geometry.topology import (
    Hosts,
    advice,
    crossing_dims,
    host_aware_order,
    host_ids,
    hosts_from_names,
    hosts_round_robin,
    hosts_simulated,
)
from tests import timing
from tests.laws import examples


def round_robin(n_hosts: int):
    """A plain-function host map: rank r on host r % n_hosts (a round-robin launcher)."""
    return lambda rank: f"node{rank % n_hosts}"


# -- brute-force references ------------------------------------------------------------------
def groups_of(spec: MeshSpec, dim: int) -> set[tuple[int, ...]]:
    """Every group along ``dim``, found by walking every coordinate."""
    array = spec.array()
    out = set()
    for coord in itertools.product(*(range(s) for s in spec.shape)):
        index = list(coord)
        line = []
        for i in range(spec.shape[dim]):
            index[dim] = i
            line.append(int(array[tuple(index)]))
        out.add(tuple(line))
    return out


def brute_crossing(spec: MeshSpec, host_of) -> dict[int, int]:
    return {d: sum(len({host_of(r) for r in g}) > 1 for g in groups_of(spec, d))
            for d in range(spec.ndim)}


def brute_inner_dims(shape, per_host: int) -> int:
    """Largest k whose last-k product divides per_host (at most ndim)."""
    fits = [k for k in range(len(shape) + 1) if per_host % math.prod(shape[len(shape) - k:]) == 0]
    return max(fits)


# -- host maps ---------------------------------------------------------------------------------
def test_hosts_simulated_fills_hosts_in_blocks():
    hosts = hosts_simulated(16, 2)
    assert [hosts(r) for r in range(16)] == ["host0"] * 8 + ["host1"] * 8
    assert hosts.ids(np.array([[0, 9], [15, 7]])).tolist() == [[0, 1], [1, 0]]
    assert hosts.names == ("host0", "host1")


def test_hosts_round_robin_and_from_names():
    assert [hosts_round_robin(6, 3)(r) for r in range(6)] == ["host0", "host1", "host2"] * 2
    hosts = hosts_from_names(["b", "a", "b", "c"])
    assert hosts.names == ("b", "a", "c")  # numbered by smallest rank
    assert hosts.ids(np.arange(4)).tolist() == [0, 1, 0, 2]
    assert hosts(3) == "c"


@pytest.mark.parametrize("world, n, message", [
    (16, 3, "n_hosts=3: does not divide world_size=16"),
    (16, 0, "n_hosts=0: must be at least 1"),
    (0, 1, "world_size=0: must be at least 1"),
])
def test_hosts_simulated_refuses_bad_counts(world, n, message):
    with pytest.raises(ArgumentError, match=message):
        hosts_simulated(world, n)


def test_host_maps_refuse_bad_values():
    with pytest.raises(ArgumentTypeError, match="n_hosts=True"):
        hosts_simulated(8, True)
    with pytest.raises(ArgumentError, match=r"rank=8: is outside the 8 ranks"):
        hosts_simulated(8, 2)(8)
    with pytest.raises(ArgumentError, match=r"names\[1\]=''"):
        hosts_from_names(["a", ""])
    with pytest.raises(ArgumentTypeError, match=r"host_of\(0\)=0: expected str"):
        host_ids(lambda r: 0, np.arange(2))
    with pytest.raises(ArgumentTypeError, match="host_of=3"):
        host_ids(3, np.arange(2))


def test_host_ids_agree_for_callables_and_hosts():
    ranks = np.arange(24).reshape(2, 3, 4)
    for n in (1, 2, 3, 4):
        fn_ids, fn_names = host_ids(round_robin(n), ranks)
        rr_ids, rr_names = host_ids(hosts_round_robin(24, n), ranks)
        assert fn_ids.tolist() == rr_ids.tolist()
        assert [fn_names[i] for i in fn_ids.reshape(-1)] == \
            [f"node{r % n}" for r in range(24)]


# -- crossing groups ---------------------------------------------------------------------------
def test_crossing_worked_example():
    spec = MeshSpec.row_major((2, 4), ("dp", "tp"))
    assert crossing_dims(spec, hosts_simulated(8, 2)) == {0: 4, 1: 0}
    spec = MeshSpec.row_major((4, 4), ("dp", "tp"))
    assert crossing_dims(spec, round_robin(2)) == {0: 0, 1: 4}


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 2, 4), (3, 4), (2, 3, 2), (1, 6)])
@pytest.mark.parametrize("hosts", ["blocks2", "rr2", "rr3", "named"])
def test_crossing_matches_brute_force(shape, hosts):
    n = math.prod(shape)
    host_of = {
        "blocks2": hosts_simulated(n, 2) if n % 2 == 0 else hosts_simulated(n, 1),
        "rr2": round_robin(2),
        "rr3": round_robin(3),
        "named": hosts_from_names([f"h{(r * 7) % 5 // 2}" for r in range(n)]),
    }[hosts]
    row_major = MeshSpec.row_major(shape)
    shuffled = MeshSpec.from_ranks(shape, np.random.default_rng(n).permutation(n).tolist())
    for spec in (row_major, shuffled):
        assert crossing_dims(spec, host_of) == brute_crossing(spec, host_of)


# -- host-aware order --------------------------------------------------------------------------
def test_host_aware_order_worked_example():
    """16 ranks dealt round-robin to 2 hosts: row-major "tp" groups all cross hosts."""
    order = host_aware_order((4, 4), round_robin(2))
    assert order == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    spec = MeshSpec.from_ranks((4, 4), order, ("dp", "tp"))
    assert spec.array().tolist() == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7],
                                     [9, 11, 13, 15]]
    assert brute_crossing(MeshSpec.row_major((4, 4)), round_robin(2)) == {0: 0, 1: 4}
    assert brute_crossing(spec, round_robin(2)) == {0: 4, 1: 0}


def test_host_aware_order_orders_hosts_by_smallest_rank():
    # rank 0 is on "z", so "z" comes first even though "a" sorts first by name
    names = ["z", "a", "z", "a", "z", "a"]
    assert host_aware_order((2, 3), hosts_from_names(names)) == [0, 2, 4, 1, 3, 5]
    assert host_aware_order((2, 3), lambda r: names[r]) == [0, 2, 4, 1, 3, 5]


@pytest.mark.parametrize("shape, host_of, why", [
    ((4, 4), hosts_simulated(16, 2), "blocks already keep inner dims inside hosts"),
    ((4, 4), hosts_simulated(16, 1), "one host"),
    ((3, 4), round_robin(2), "4 does not divide 6 ranks per host"),
    ((2, 3), hosts_from_names(["a", "b", "a", "a", "b", "a"]), "uneven hosts"),
    ((4, 1), round_robin(2), "inner block of size 1 fits but changes nothing"),
])
def test_host_aware_order_none(shape, host_of, why):
    assert host_aware_order(shape, host_of) is None, why


def test_host_aware_order_refuses_bad_shape():
    with pytest.raises(ArgumentError, match=r"shape\[1\]=0"):
        host_aware_order((4, 0), round_robin(2))


@st.composite
def shapes_and_hosts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    n = math.prod(shape)
    n_hosts = draw(st.sampled_from([h for h in (1, 2, 3, 4, 6, 8) if n % h == 0]))
    labels = [f"h{i % n_hosts}" for i in range(n)]
    labels = draw(st.permutations(labels))
    return shape, list(labels), n_hosts


@examples(1.5)
@given(shapes_and_hosts())
def test_host_aware_order_laws(case):
    shape, labels, n_hosts = case
    host_of = hosts_from_names(labels)
    n = math.prod(shape)
    per = n // n_hosts
    k = brute_inner_dims(shape, per)
    inner = list(range(len(shape) - k, len(shape)))
    before = brute_crossing(MeshSpec.row_major(shape), host_of)
    order = host_aware_order(shape, host_of)
    if order is None:
        # nothing to gain: no inner dim bigger than 1 fits, or those dims already stay inside
        assert math.prod(shape[len(shape) - k:]) == 1 or not any(before[d] for d in inner)
        return
    assert sorted(order) == list(range(n))
    first = {}
    for r, h in enumerate(labels):
        first.setdefault(h, r)
    assert order == sorted(range(n), key=lambda r: (first[labels[r]], r))
    after = brute_crossing(MeshSpec.from_ranks(shape, order), host_of)
    assert all(after[d] == 0 for d in inner)
    assert any(before[d] for d in inner)


# -- advice ------------------------------------------------------------------------------------
def test_advice_names_the_dim_and_the_fix():
    spec = MeshSpec.row_major((4, 4), ("dp", "tp"))
    assert advice(spec, round_robin(2)) == (
        "mesh dim 'tp': 4 of 4 groups cross hosts; a host-aware rank order keeps them inside "
        "one host. Fix: init_device_mesh(..., host_aware=True)."
    )
    fixed = MeshSpec.from_ranks((4, 4), host_aware_order((4, 4), round_robin(2)), ("dp", "tp"))
    assert advice(fixed, round_robin(2)) is None


def test_advice_lists_several_dims_and_unnamed_dims():
    spec = MeshSpec.row_major((2, 2, 2))
    checkerboard = hosts_from_names(["a", "b", "b", "a", "a", "b", "b", "a"])
    assert advice(spec, checkerboard) == (
        "mesh dims 1: 4 of 4 groups; 2: 4 of 4 groups cross hosts; a host-aware rank order "
        "keeps them inside one host. Fix: init_device_mesh(..., host_aware=True)."
    )


def test_advice_stays_quiet_when_nothing_helps():
    assert advice(MeshSpec.row_major((2, 4), ("dp", "tp")), hosts_simulated(8, 2)) is None
    assert advice(MeshSpec.row_major((3, 4)), round_robin(2)) is None  # 4 does not divide 6
    subset = MeshSpec.from_ranks((2, 2), [2, 3, 4, 5])  # not the whole world 0..N-1
    assert advice(subset, round_robin(2)) is None


def test_crossing_is_fast_for_a_million_ranks():
    import time

    spec = MeshSpec.row_major((1 << 14, 8, 8), ("dp", "x", "y"))
    start = time.perf_counter()
    found = crossing_dims(spec, Hosts.blocks(1 << 20, 128))
    assert found == {0: 64, 1: 0, 2: 0}
    assert time.perf_counter() - start < timing.bound(0, 10), timing.describe()
