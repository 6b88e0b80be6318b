"""Laws of geometry/layout.py's Layout and fit(), checked against a brute-force numpy reference.

The reference for a layout is the array of positions it should enumerate: np.arange(N)
reshaped to the layout's shape (plus an offset), then indexed, transposed and reshaped the way
select / flatten / unflatten are meant to act. One helper per law, then many cases.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tensorplay.distributed.geometry.layout import Layout, fit
from tests.laws import examples

LAWS = examples(1.0)

# -- the brute-force reference ------------------------------------------------------------


def ref_row_major(shape, offset=0):
    """The positions of a row-major layout: arange reshaped."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape) + offset


def ref_coordinate(ref, position):
    """Coordinate of ``position`` in the array ``ref`` by search."""
    found = np.argwhere(ref == position)
    assert len(found) == 1, f"{position} occurs {len(found)} times in the reference"
    return tuple(int(c) for c in found[0])


def ref_select(ref, dims, position):
    """The sub-array of ``dims`` (in that order) through ``position``."""
    coord = ref_coordinate(ref, position)
    sub = ref[tuple(slice(None) if d in dims else c for d, c in enumerate(coord))]
    ascending = sorted(dims)
    return sub.transpose([ascending.index(d) for d in dims])


def ref_flatten(ref, dims):
    """Move ``dims`` next to each other (in that order) where the first one was; reshape."""
    others = [d for d in range(ref.ndim) if d not in dims]
    before = sum(1 for d in others if d < dims[0])
    order = others[:before] + list(dims) + others[before:]
    merged = math.prod(ref.shape[d] for d in dims)
    shape = [ref.shape[d] for d in order[:before]] + [merged]
    shape += [ref.shape[d] for d in others[before:]]
    return ref.transpose(order).reshape(shape)


def ref_unflatten(ref, dim, sizes):
    """Reshape axis ``dim`` into ``sizes``."""
    return ref.reshape(ref.shape[:dim] + tuple(sizes) + ref.shape[dim + 1 :])


def is_additive(ref):
    """Whether ref[c] == ref[0] + sum over d of (ref along d at c[d] - ref[0]).

    Every Layout enumerates an additive array (position = offset + one term per dim), so an
    array that is not additive has no layout.
    """
    if ref.ndim == 0:
        return True
    base = ref.reshape(-1)[0]
    total = np.full(ref.shape, base, dtype=np.int64)
    for d in range(ref.ndim):
        index = [0] * ref.ndim
        index[d] = slice(None)
        shape = [1] * ref.ndim
        shape[d] = ref.shape[d]
        total = total + (ref[tuple(index)] - base).reshape(shape)
    return bool(np.array_equal(total, ref))


# -- one helper per law --------------------------------------------------------------------


def check_enumerates(layout, ref):
    """position() of every coordinate is the reference value; positions() is the reference."""
    assert layout.shape == ref.shape
    assert layout.ndim == ref.ndim
    assert layout.numel == ref.size
    for coord in np.ndindex(*ref.shape):
        assert layout.position(coord) == ref[coord], coord
    positions = layout.positions()
    assert positions.shape == ref.shape
    assert np.array_equal(positions, ref)


def check_round_trip(layout):
    """coordinate(position(c)) == c for every coordinate."""
    for coord in np.ndindex(*layout.shape):
        assert layout.coordinate(layout.position(coord)) == tuple(coord)


def check_non_members(layout, ref):
    """coordinate() of every position the layout does not hold (around its range) is None."""
    members = set(ref.reshape(-1).tolist())
    low, high = min(members), max(members)
    for position in range(low - 4, high + 6):
        if position not in members:
            assert layout.coordinate(position) is None, position


def check_ordered(layout):
    """Every layout derived from row_major is ordered (coordinate() is exact)."""
    assert layout.is_ordered()


def check_fit(layout):
    """fit() of the enumerated sequence gives a 1-d layout with the same sequence and key."""
    values = layout.positions().reshape(-1).tolist()
    found = fit(values)
    assert found is not None, values
    assert found.ndim == 1 and found.is_ordered()
    assert found.positions().tolist() == values
    assert found.canonical() == layout.canonical()


def check_all_laws(layout, ref):
    check_enumerates(layout, ref)
    check_round_trip(layout)
    check_non_members(layout, ref)
    check_ordered(layout)
    check_fit(layout)


def check_fit_is_exact(values):
    """fit() returns None or an ordered 1-d layout enumerating exactly ``values``."""
    found = fit(values)
    if found is not None:
        assert found.ndim == 1 and found.is_ordered()
        assert found.positions().tolist() == list(values)
    return found


# -- strategies ------------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)
offsets = st.integers(0, 20)


def factorizations(n, parts):
    """Every ordered tuple of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [
        (f, *rest)
        for f in range(1, n + 1)
        if n % f == 0
        for rest in factorizations(n // f, parts - 1)
    ]


@st.composite
def dim_choices(draw, ndim, min_size=0):
    """A subset of range(ndim) in a random order (so non-adjacent and reversed too)."""
    order = draw(st.permutations(range(ndim)))
    return tuple(order[: draw(st.integers(min_size, ndim))])


@st.composite
def ops_on(draw, ref, count):
    """Up to ``count`` random operations and the reference after each (None after a split
    that no layout can make)."""
    ops = []
    for _ in range(count):
        kind = draw(st.sampled_from(["select", "flatten", "unflatten"]))
        if kind == "select":
            dims = draw(dim_choices(ref.ndim))
            position = draw(st.sampled_from(ref.reshape(-1).tolist()))
            ops.append(("select", dims, position))
            ref = ref_select(ref, dims, position)
        elif kind == "flatten" and ref.ndim:
            dims = draw(dim_choices(ref.ndim, min_size=1))
            ops.append(("flatten", dims))
            ref = ref_flatten(ref, dims)
        elif ref.ndim:
            dim = draw(st.integers(0, ref.ndim - 1))
            parts = draw(st.integers(1, 3))
            sizes = draw(st.sampled_from(factorizations(ref.shape[dim], parts)))
            ops.append(("unflatten", dim, sizes))
            ref = ref_unflatten(ref, dim, sizes)
    return ops


def apply(layout, op):
    if op[0] == "select":
        return layout.select(op[1], op[2])
    if op[0] == "flatten":
        return layout.flatten(op[1])
    return layout.unflatten(op[1], op[2])


def apply_ref(ref, op):
    if op[0] == "select":
        return ref_select(ref, op[1], op[2])
    if op[0] == "flatten":
        return ref_flatten(ref, op[1])
    return ref_unflatten(ref, op[1], op[2])


@st.composite
def derived(draw, max_ops=3):
    """(layout, reference) after a random chain of operations on a row-major layout."""
    shape, offset = draw(shapes), draw(offsets)
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    for op in draw(ops_on(ref, draw(st.integers(0, max_ops)))):
        try:
            layout = apply(layout, op)
        except ValueError:
            # Only a split that no layout can represent may fail; the laws test says so.
            assume(False)
        ref = apply_ref(ref, op)
    return layout, ref


# -- worked examples -------------------------------------------------------------------------


def test_worked_example_2x4():
    layout = Layout.row_major((2, 4))
    assert layout.dims == (((2, 4),), ((4, 1),))
    assert layout.position((1, 1)) == 5
    assert layout.coordinate(5) == (1, 1)
    assert layout.line(5, 1).positions().tolist() == [4, 5, 6, 7]
    assert layout.line(5, 0).positions().tolist() == [1, 5]
    assert layout.coordinate(8) is None and layout.coordinate(-1) is None


def test_worked_example_fit():
    found = fit([0, 1, 4, 5])
    assert found == Layout((((2, 4), (2, 1)),), 0)
    assert fit([3, 2, 1, 0]) is None
    assert fit([]) is None
    assert fit([7]).positions().tolist() == [7]


def test_unflatten_after_flatten_splits_a_contiguous_dim():
    # (2, 6) flattened is 0..11; any factorisation of 12 is a plain reshape of it.
    flat = Layout.row_major((2, 6)).flatten()
    for sizes in factorizations(12, 2) + factorizations(12, 3):
        check_all_laws(flat.unflatten(0, sizes), ref_row_major(sizes))


def test_unflatten_refuses_a_split_no_layout_makes():
    # Positions 0..5 and 100..105 in rows of 4: row 1 would be [4, 5, 100, 101].
    layout = Layout((((2, 100), (6, 1)),))
    with pytest.raises(ValueError):
        layout.unflatten(0, (3, 4))
    check_all_laws(layout.unflatten(0, (4, 3)), np.array(
        [[0, 1, 2], [3, 4, 5], [100, 101, 102], [103, 104, 105]]))


# -- laws on many cases ----------------------------------------------------------------------


@LAWS
@given(shapes, offsets)
def test_row_major_agrees_with_arange(shape, offset):
    check_all_laws(Layout.row_major(shape, offset), ref_row_major(shape, offset))


@LAWS
@given(shapes, offsets, st.data())
def test_select_enumerates_the_sub_array(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    dims = data.draw(dim_choices(len(shape)))
    position = data.draw(st.sampled_from(ref.reshape(-1).tolist()))
    check_all_laws(layout.select(dims, position), ref_select(ref, dims, position))


@LAWS
@given(shapes, offsets, st.data())
def test_line_is_select_of_one_dim(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    dim = data.draw(st.integers(0, len(shape) - 1))
    position = data.draw(st.sampled_from(ref.reshape(-1).tolist()))
    line = layout.line(position, dim)
    check_all_laws(line, ref_select(ref, (dim,), position))
    assert line.coordinate(position) == (ref_coordinate(ref, position)[dim],)


@LAWS
@given(shapes, offsets, st.data())
def test_select_of_a_non_member_raises(shape, offset, data):
    layout = Layout.row_major(shape, offset)
    position = data.draw(st.sampled_from([offset - 1, offset + layout.numel]))
    with pytest.raises(ValueError):
        layout.select((0,), position)


@LAWS
@given(shapes, offsets, st.data())
def test_flatten_enumerates_transpose_reshape(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    dims = data.draw(dim_choices(len(shape), min_size=1))
    check_all_laws(layout.flatten(dims), ref_flatten(ref, dims))


@LAWS
@given(shapes, offsets)
def test_flatten_all_is_the_sequence(shape, offset):
    flat = Layout.row_major(shape, offset).flatten()
    check_all_laws(flat, ref_row_major((math.prod(shape),), offset))


@LAWS
@given(shapes, offsets, st.data())
def test_unflatten_agrees_with_reshape(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    dim = data.draw(st.integers(0, len(shape) - 1))
    sizes = data.draw(st.sampled_from(
        factorizations(shape[dim], 1) + factorizations(shape[dim], 2)
        + factorizations(shape[dim], 3)))
    check_all_laws(layout.unflatten(dim, sizes), ref_unflatten(ref, dim, sizes))


@LAWS
@given(shapes, st.data())
def test_unflatten_raises_when_sizes_do_not_multiply(shape, data):
    layout = Layout.row_major(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    assume(math.prod(sizes) != shape[dim])
    with pytest.raises(ValueError):
        layout.unflatten(dim, sizes)


@LAWS
@given(shapes, offsets, st.data())
def test_chain_select_flatten_unflatten(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    position = data.draw(st.sampled_from(ref.reshape(-1).tolist()))
    dims = data.draw(dim_choices(len(shape), min_size=1))
    layout, ref = layout.select(dims, position), ref_select(ref, dims, position)
    check_all_laws(layout, ref)
    merged = data.draw(dim_choices(len(dims), min_size=1))
    layout, ref = layout.flatten(merged), ref_flatten(ref, merged)
    check_all_laws(layout, ref)
    dim = data.draw(st.integers(0, ref.ndim - 1))
    sizes = data.draw(st.sampled_from(
        factorizations(ref.shape[dim], 2) + factorizations(ref.shape[dim], 3)))
    check_unflatten(layout, ref, dim, sizes)


def check_unflatten(layout, ref, dim, sizes):
    """unflatten() agrees with reshape, or raises because no layout enumerates the reshape."""
    expected = ref_unflatten(ref, dim, sizes)
    try:
        split = layout.unflatten(dim, sizes)
    except ValueError:
        assert not is_additive(expected), f"{layout}.unflatten({dim}, {sizes}) refused a " \
            f"reshape that a layout can make:\n{expected}"
        return None
    check_all_laws(split, expected)
    return split


@LAWS
@given(shapes, offsets, st.data())
def test_random_chains_agree(shape, offset, data):
    layout, ref = Layout.row_major(shape, offset), ref_row_major(shape, offset)
    for op in data.draw(ops_on(ref, 5)):
        if op[0] == "unflatten":
            layout = check_unflatten(layout, ref, op[1], op[2])
            if layout is None:
                return
        else:
            layout = apply(layout, op)
        ref = apply_ref(ref, op)
        check_all_laws(layout, ref)


@LAWS
@given(derived(), derived())
def test_canonical_equal_iff_same_sequence(first, second):
    (a, ref_a), (b, ref_b) = first, second
    same = np.array_equal(ref_a.reshape(-1), ref_b.reshape(-1))
    assert (a.canonical() == b.canonical()) == same


@LAWS
@given(derived(), st.data())
def test_canonical_ignores_how_the_sequence_is_cut(pair, data):
    layout, ref = pair
    if layout.ndim:
        assert layout.flatten().canonical() == layout.canonical()
    n = ref.size
    sizes = data.draw(st.sampled_from(factorizations(n, 2) + factorizations(n, 3)))
    fitted = fit(ref.reshape(-1).tolist())
    cut = check_unflatten(fitted, ref.reshape(-1), 0, sizes)
    if cut is not None:
        assert cut.canonical() == layout.canonical()
    shifted = Layout(layout.dims, layout.offset + 1)
    assert shifted.canonical() != layout.canonical()


@LAWS
@given(derived(), derived())
def test_equal_layouts_iff_equal_arrays(first, second):
    (a, ref_a), (b, ref_b) = first, second
    same = ref_a.shape == ref_b.shape and np.array_equal(ref_a, ref_b)
    assert (a == b) == same
    if same:
        assert hash(a) == hash(b)


@LAWS
@given(derived())
def test_a_layout_is_determined_by_its_array(pair):
    layout, ref = pair
    assume(layout.ndim > 0)
    rebuilt = check_unflatten(fit(ref.reshape(-1).tolist()), ref.reshape(-1), 0, ref.shape)
    assert rebuilt is not None
    assert rebuilt == layout and hash(rebuilt) == hash(layout)


def test_equal_arrays_give_equal_layouts():
    row = Layout.row_major
    assert row((2, 6)).flatten() == row((12,))
    assert row((12,)).unflatten(0, (2, 6)) == row((2, 6))
    assert row((1, 8)) == row((8,)).unflatten(0, (1, 8)) == row((2, 4)).flatten().unflatten(
        0, (1, 8))
    assert row((2, 3, 4)).select((1, 2), 12) == row((3, 4), 12)
    assert row((2, 3, 4)).flatten((1, 2)) == row((2, 12))
    assert row((2, 3)) != row((3, 2)) and row((6,)) != row((6,), 1)


@LAWS
@given(derived(), st.integers(1, 5), st.integers(-10, 10))
def test_fit_round_trips_layout_sequences(pair, scale, shift):
    layout, ref = pair
    check_fit(layout)
    values = (ref.reshape(-1) * scale + shift).tolist()
    assert check_fit_is_exact(values) is not None


@LAWS
@given(st.integers(1, 24).flatmap(lambda n: st.permutations(range(n))))
def test_fit_of_a_permutation_is_exact_or_none(values):
    found = check_fit_is_exact(values)
    if values == sorted(values):
        assert found is not None


@LAWS
@given(st.lists(st.integers(-5, 40), min_size=1, max_size=16))
def test_fit_of_any_values_is_exact_or_none(values):
    found = check_fit_is_exact(values)
    if len(set(values)) != len(values):
        assert found is None


def test_fit_finds_every_ordered_two_mode_sequence():
    # Exhaustive over small (size, stride) pairs: outer x inner, injective and ordered.
    for (n1, s1), (n2, s2) in itertools.product(
        itertools.product(range(1, 5), range(1, 9)), repeat=2
    ):
        layout = Layout((((n1, s1), (n2, s2)),), 3)
        if not layout.is_ordered():
            continue
        values = layout.positions().tolist()
        assert len(set(values)) == len(values)
        found = check_fit_is_exact(values)
        assert found is not None and found.canonical() == layout.canonical()
