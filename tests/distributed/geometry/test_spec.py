"""Laws of geometry/spec.py's MeshSpec and Ranks, checked against the rank array held in numpy.

Every case is a numpy array of distinct ranks (row-major, strided subsets, permutations such as
[[3, 1], [2, 0]], random subsets); the spec built from it must answer every question the way
indexing that array by brute force does. One helper per law, then many cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorplay.distributed.geometry.layout import Layout
from tensorplay.distributed.geometry.spec import MeshSpec, Ranks
from tests.laws import examples

LAWS = examples(0.8)
NAMES = ("a", "b", "c", "d", "e")

# -- the brute-force reference ------------------------------------------------------------


def ref_coordinate(array, rank):
    found = np.argwhere(array == rank)
    return None if len(found) == 0 else tuple(int(c) for c in found[0])


def ref_select(array, dims, rank):
    """Sub-array of ``dims`` (in that order) through ``rank``."""
    coord = ref_coordinate(array, rank)
    sub = array[tuple(slice(None) if d in dims else c for d, c in enumerate(coord))]
    ascending = sorted(dims)
    return sub.transpose([ascending.index(d) for d in dims])


def ref_line(array, rank, dim):
    return ref_select(array, (dim,), rank).tolist()


def ref_flatten(array, dims):
    """``dims`` moved together (in that order) where the first was, then merged."""
    others = [d for d in range(array.ndim) if d not in dims]
    before = sum(1 for d in others if d < dims[0])
    order = others[:before] + list(dims) + others[before:]
    shape = [array.shape[d] for d in others[:before]] + [math.prod(array.shape[d] for d in dims)]
    shape += [array.shape[d] for d in others[before:]]
    return array.transpose(order).reshape(shape), order, before


def ref_unflatten(array, dim, sizes):
    return array.reshape(array.shape[:dim] + tuple(sizes) + array.shape[dim + 1 :])


def factorizations(n, parts):
    if parts == 1:
        return [(n,)]
    return [(f, *rest) for f in range(1, n + 1) if n % f == 0
            for rest in factorizations(n // f, parts - 1)]


# -- one helper per law --------------------------------------------------------------------


def check_array(spec, array):
    """shape, ndim, size and array() are the reference's."""
    assert spec.shape == array.shape and spec.ndim == array.ndim and spec.size == array.size
    assert np.array_equal(spec.array(), array)


def check_rank_at(spec, array):
    for coord in np.ndindex(*array.shape):
        assert spec.rank_at(coord) == array[coord], coord


def check_coordinate_of(spec, array):
    """coordinate_of() finds every member; every other rank (around them) gives None."""
    members = set(array.reshape(-1).tolist())
    for rank in range(-2, max(members) + 4):
        assert spec.coordinate_of(rank) == ref_coordinate(array, rank), rank


def check_ranks_law(ranks, values):
    """A Ranks behaves like the list ``values``, and shares its key with Ranks.of(values)."""
    n = len(values)
    assert len(ranks) == n
    assert ranks.tolist() == values and list(ranks) == values
    for i, value in enumerate(values):
        assert ranks[i] == value and ranks[i - n] == value
        assert ranks.index(value) == i
        assert value in ranks and np.int64(value) in ranks
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            ranks[bad]
    for other in set(range(min(values) - 2, max(values) + 3)) - set(values):
        assert ranks.index(other) is None and other not in ranks
    rebuilt = Ranks.of(values)
    assert rebuilt.key() == ranks.key() and rebuilt == ranks and hash(rebuilt) == hash(ranks)


def check_lines(spec, array):
    """line(rank, d) is the array's line through rank along d, in mesh order."""
    checked = set()
    for rank in array.reshape(-1).tolist():
        coord = ref_coordinate(array, rank)
        for dim in range(array.ndim):
            line = spec.line(rank, dim)
            expected = ref_line(array, rank, dim)
            assert line.tolist() == expected and line.index(rank) == coord[dim]
            if (dim, tuple(expected)) not in checked:  # the full law once per line
                checked.add((dim, tuple(expected)))
                check_ranks_law(line, expected)


def check_all_ranks(spec, array):
    check_ranks_law(spec.ranks(), array.reshape(-1).tolist())


def check_select(spec, array, dims, rank):
    sub = spec.select(dims, rank)
    expected = ref_select(array, dims, rank)
    check_array(sub, expected)
    assert sub.names == (None if spec.names is None else tuple(spec.names[d] for d in dims))
    if sub.ndim:
        check_coordinate_of(sub, expected)
    return sub, expected


def check_flatten(spec, array, dims, name):
    flat = spec.flatten(name, dims)
    expected, order, before = ref_flatten(array, dims)
    check_array(flat, expected)
    check_coordinate_of(flat, expected)
    if spec.names is not None:
        merged = name if name is not None else "_".join(spec.names[d] for d in dims)
        others = [spec.names[d] for d in order if d not in dims]
        assert flat.names == (*others[:before], merged, *others[before:])
    return flat, expected


def check_unflatten(spec, array, dim, sizes):
    names = None
    if spec.names is not None:
        names = tuple(f"{spec.names[dim]}{i}" for i in range(len(sizes)))
    split = spec.unflatten(dim, sizes, names)
    expected = ref_unflatten(array, dim, sizes)
    check_array(split, expected)
    check_coordinate_of(split, expected)
    if names is not None:
        assert split.names == spec.names[:dim] + names + spec.names[dim + 1 :]
    return split, expected


def check_value(spec, array):
    """A spec is a value: rebuilding it from its array and names gives an equal spec."""
    again = MeshSpec.from_ranks(array.shape, array.reshape(-1).tolist(), spec.names)
    assert again == spec and hash(again) == hash(spec)


def check_all_laws(spec, array):
    check_array(spec, array)
    check_rank_at(spec, array)
    check_coordinate_of(spec, array)
    check_lines(spec, array)
    check_all_ranks(spec, array)
    check_value(spec, array)


# -- strategies ------------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def rank_arrays(draw):
    """A rank array of a random shape: row-major, strided, a permutation or a subset."""
    shape = draw(shapes)
    n = math.prod(shape)
    kind = draw(st.sampled_from(["row_major", "strided", "permutation", "subset"]))
    if kind == "row_major":
        values = list(range(n))
    elif kind == "strided":
        start, step = draw(st.integers(0, 9)), draw(st.integers(1, 4))
        values = list(range(start, start + n * step, step))
    elif kind == "permutation":
        values = list(draw(st.permutations(range(n))))
    else:
        pool = draw(st.permutations(range(3 * n)))
        values = list(pool[:n])
        if draw(st.booleans()):
            values.sort()
    array = np.array(values, dtype=np.int64).reshape(shape)
    if draw(st.booleans()) and len(shape) > 1:  # a transposed array: strides out of order
        array = np.ascontiguousarray(array.transpose(draw(st.permutations(range(len(shape))))))
    return array


@st.composite
def specs(draw):
    array = draw(rank_arrays())
    names = NAMES[: array.ndim] if draw(st.booleans()) else None
    return MeshSpec.from_ranks(array.shape, array.reshape(-1).tolist(), names), array


@st.composite
def dim_choices(draw, ndim, min_size=0):
    order = draw(st.permutations(range(ndim)))
    return tuple(order[: draw(st.integers(min_size, ndim))])


# -- worked examples -------------------------------------------------------------------------


def test_worked_example_2x4():
    spec = MeshSpec.row_major((2, 4), ("dp", "tp"))
    assert spec.coordinate_of(5) == (1, 1)
    assert spec.rank_at((1, 1)) == 5
    assert spec.line(5, 1).tolist() == [4, 5, 6, 7]
    assert spec.line(5, 0).tolist() == [1, 5]
    assert spec.select((1,), 5).names == ("tp",)
    assert spec.coordinate_of(8) is None
    check_all_laws(spec, np.arange(8).reshape(2, 4))


EXPLICIT = [
    [[3, 1], [2, 0]],
    [[4, 6], [5, 7]],
    [[0, 2], [1, 3]],
    [[7, 6, 5, 4], [3, 2, 1, 0]],
    [[1, 3, 5], [7, 9, 11]],
    [[[0, 4], [2, 6]], [[1, 5], [3, 7]]],
    [[10]],
    [5, 3, 9],
    [[0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105]],
]


@pytest.mark.parametrize("ranks", EXPLICIT, ids=str)
def test_explicit_arrays(ranks):
    array = np.array(ranks, dtype=np.int64)
    for names in (None, NAMES[: array.ndim]):
        spec = MeshSpec.from_ranks(array.shape, array.reshape(-1).tolist(), names)
        check_all_laws(spec, array)
        for rank in array.reshape(-1).tolist():
            for d in range(array.ndim):
                check_select(spec, array, (d,), rank)
            check_select(spec, array, tuple(reversed(range(array.ndim))), rank)
        check_flatten(spec, array, tuple(range(array.ndim)), None)
        for dim, size in enumerate(array.shape):
            for sizes in factorizations(size, 2):
                check_unflatten(spec, array, dim, sizes)


def test_permuted_mesh_keeps_mesh_order():
    # On [[3, 1], [2, 0]] rank 0 is at (1, 1): its dim-1 line is [2, 0], not sorted.
    spec = MeshSpec.from_ranks((2, 2), [3, 1, 2, 0])
    assert spec.table is not None
    assert spec.coordinate_of(0) == (1, 1)
    assert spec.line(0, 1).tolist() == [2, 0] and spec.line(0, 1).index(0) == 1
    assert spec.line(0, 0).tolist() == [1, 0]


def test_ordered_arrays_need_no_table():
    assert MeshSpec.from_ranks((2, 2), [4, 6, 5, 7]).table is None
    assert MeshSpec.from_ranks((2, 4), list(range(8))) == MeshSpec.row_major((2, 4))
    assert MeshSpec.from_ranks((1, 8), list(range(8))) == MeshSpec.row_major((1, 8))


def test_line_of_a_non_member_raises():
    for spec in (MeshSpec.row_major((2, 4)), MeshSpec.from_ranks((2, 2), [3, 1, 2, 0])):
        with pytest.raises(ValueError):
            spec.line(9, 0)
        with pytest.raises(ValueError):
            spec.select((0,), -1)


def test_unflatten_sizes_that_do_not_multiply_raise():
    for spec in (MeshSpec.row_major((2, 6)), MeshSpec.from_ranks((2, 2), [3, 1, 2, 0])):
        with pytest.raises(ValueError):
            spec.unflatten(1, (4, 4), None)


# -- laws on many cases ----------------------------------------------------------------------


@LAWS
@given(shapes)
def test_row_major_agrees_with_arange(shape):
    spec = MeshSpec.row_major(shape)
    assert spec.table is None
    check_all_laws(spec, np.arange(math.prod(shape)).reshape(shape))


@LAWS
@given(specs())
def test_from_ranks_agrees_with_the_array(case):
    check_all_laws(*case)


@LAWS
@given(specs(), st.data())
def test_select_agrees_with_the_array(case, data):
    spec, array = case
    dims = data.draw(dim_choices(array.ndim, min_size=1))
    rank = data.draw(st.sampled_from(array.reshape(-1).tolist()))
    check_all_laws(*check_select(spec, array, dims, rank))


@LAWS
@given(specs(), st.data())
def test_flatten_agrees_with_the_array(case, data):
    spec, array = case
    dims = data.draw(dim_choices(array.ndim, min_size=1))
    name = data.draw(st.sampled_from([None, "merged"]))
    check_all_laws(*check_flatten(spec, array, dims, name))


@LAWS
@given(specs(), st.data())
def test_unflatten_agrees_with_the_array(case, data):
    spec, array = case
    dim = data.draw(st.integers(0, array.ndim - 1))
    sizes = data.draw(st.sampled_from(
        factorizations(array.shape[dim], 2) + factorizations(array.shape[dim], 3)))
    check_all_laws(*check_unflatten(spec, array, dim, sizes))


@LAWS
@given(specs(), st.data())
def test_chain_select_flatten_unflatten(case, data):
    spec, array = case
    rank = data.draw(st.sampled_from(array.reshape(-1).tolist()))
    spec, array = check_select(spec, array, data.draw(dim_choices(array.ndim, 1)), rank)
    spec, array = check_flatten(spec, array, data.draw(dim_choices(array.ndim, 1)), None)
    dim = data.draw(st.integers(0, array.ndim - 1))
    sizes = data.draw(st.sampled_from(factorizations(array.shape[dim], 2)))
    check_all_laws(*check_unflatten(spec, array, dim, sizes))


@LAWS
@given(st.integers(1, 30).flatmap(lambda n: st.permutations(range(n))))
def test_ranks_of_a_permutation_behave_like_the_list(values):
    check_ranks_law(Ranks.of(list(values)), list(values))


@LAWS
@given(st.lists(st.integers(0, 50), min_size=1, max_size=20, unique=True))
def test_ranks_of_any_list_behave_like_the_list(values):
    check_ranks_law(Ranks.of(values), values)
    check_ranks_law(Ranks(explicit=values), values)


@LAWS
@given(shapes, st.integers(0, 20), st.data())
def test_ranks_of_a_list_share_the_key_of_the_layout_line(shape, offset, data):
    # Group sharing relies on it: a line built from a layout and the same ranks as a list
    # must be one registry key.
    layout = Layout.row_major(shape, offset)
    array = np.arange(layout.numel).reshape(shape) + offset
    rank = data.draw(st.sampled_from(array.reshape(-1).tolist()))
    dims = data.draw(dim_choices(len(shape), 1))
    cut = layout.select(dims, rank).flatten()
    values = ref_select(array, dims, rank).reshape(-1).tolist()
    assert Ranks(layout=cut).key() == Ranks.of(values).key()
    check_ranks_law(Ranks(layout=cut), values)


def test_ranks_of_lists_and_layouts_worked_examples():
    line = MeshSpec.row_major((2, 4)).line(5, 1)
    assert line.key() == Ranks.of([4, 5, 6, 7]).key() == Ranks(explicit=None, layout=Layout(
        (((4, 1),),), 4)).key()
    assert Ranks.of([3, 1]).key() != Ranks.of([1, 3]).key()
    assert Ranks.of([0, 2, 4]) == Ranks(layout=Layout((((3, 2),),)))
    assert repr(Ranks.of(list(range(0, 40, 2)))) == "Ranks([0, 2, ..., 38], size=20)"


# -- root_dims: which root dims each dim of a slice or flatten runs along ------------------------


def test_root_dims_worked_example():
    root = MeshSpec.row_major((2, 2, 2), ("dp", "cp", "tp"))
    assert root.root_dims(root, 5) == ((0,), (1,), (2,))
    assert root.select((0, 1), 5).flatten("dp_cp").root_dims(root, 5) == ((0, 1),)
    assert root.select((2,), 5).root_dims(root, 5) == ((2,),)
    with pytest.raises(ValueError, match="does not walk root dims"):  # a transposed slice
        root.select((1, 0), 5).flatten(None).root_dims(root, 5)


@LAWS
@given(specs(), st.data())
def test_root_dims_of_any_slice_then_flatten(case, data):
    """Slice dims D (in mesh order) through a rank, then merge a run of them: each dim of the
    result runs along its root dims of size above 1."""
    root, array = case
    rank = data.draw(st.sampled_from(array.reshape(-1).tolist()))
    kept = sorted(data.draw(dim_choices(array.ndim, 1)))
    start = data.draw(st.integers(0, len(kept) - 1))
    stop = data.draw(st.integers(start + 1, len(kept)))
    mesh = root.select(kept, rank).flatten(None, range(start, stop))
    groups = [[d] for d in kept[:start]] + [kept[start:stop]] + [[d] for d in kept[stop:]]
    expected = tuple(tuple(d for d in g if array.shape[d] > 1) for g in groups)
    assert mesh.root_dims(root, rank) == expected
