"""The pure shrink step of elastic recovery: slices of the elastic dim that hold a lost rank go."""

from __future__ import annotations

import pytest

from tensorplay.distributed import ShrinkError
from tensorplay.distributed.geometry.shrink import Shrunk, shrink


def test_a_lost_rank_removes_its_dp_slice_and_its_healthy_peers_become_spares():
    assert shrink((2, 4), range(8), 0, {5}) == Shrunk(
        shape=(1, 4), ranks=(0, 1, 2, 3), removed=(1,), spares=(4, 6, 7), lost=(5,))


def test_the_elastic_dim_may_be_inner_and_the_mesh_unsorted():
    # (4, 2) named ("tp", "dp") with dp innermost, ranks laid out in any order
    ranks = [7, 6, 5, 4, 3, 2, 1, 0]
    assert shrink((4, 2), ranks, 1, {2}) == Shrunk(
        shape=(4, 1), ranks=(7, 5, 3, 1), removed=(1,), spares=(6, 4, 0), lost=(2,))


def test_two_deaths_in_one_slice_cost_one_slice_and_deaths_elsewhere_change_nothing():
    got = shrink((3, 2, 2), range(12), 0, {4, 7, 99})
    assert got.shape == (2, 2, 2) and got.ranks == (0, 1, 2, 3, 8, 9, 10, 11)
    assert got.removed == (1,) and got.spares == (5, 6) and got.lost == (4, 7)
    assert shrink((2, 4), range(8), 0, {42}) == Shrunk((2, 4), tuple(range(8)), (), (), ())


def test_a_mesh_may_shrink_to_one_slice_but_not_below_its_minimum():
    assert shrink((2, 4), range(8), 0, {1}, minimum=1).shape == (1, 4)
    with pytest.raises(ShrinkError) as err:
        shrink((2, 4), range(8), 0, {1, 6}, minimum=1, dim_name="dp")
    assert str(err.value) == (
        "mesh dim 'dp' would keep 0 of its 2 slices, below its minimum of 1: lost ranks 1, 6 "
        "in slices 0-1. Fix: restart the job from its last checkpoint, or allow a smaller "
        "minimum")
    with pytest.raises(ShrinkError) as err:
        shrink((2, 4), range(8), 0, {4, 5, 6, 7}, minimum=2, dim_name="dp", hosts=("hostB",))
    assert "its minimum of 2: lost ranks 4-7 (host hostB) in slice 1. Fix:" in str(err.value)
    with pytest.raises(ShrinkError, match="keep 3 of its 4 slices, below its minimum of 4"):
        shrink((4, 2), range(8), 0, {3}, minimum=4)


def test_lost_ranks_that_were_alive_are_said_to_be():
    """Issue 41: ranks 1 and 3 were declared lost for coming late, and the job's last line
    blamed rank 1: the error says they were alive (ranks alive but not lost go unnamed)."""
    with pytest.raises(ShrinkError) as err:
        shrink((2, 4), range(8), 0, {1, 3, 6}, minimum=1, dim_name="dp", hosts=("vm",),
               alive=(0, 1, 2, 3, 4))
    assert ("lost ranks 1, 3, 6 (host vm) in slices 0-1; ranks 1, 3 of them were alive, "
            "declared lost for reaching the recovery late. Fix:") in str(err.value)


def test_grow_puts_back_only_the_slices_whose_ranks_are_all_present():
    from tensorplay.distributed.geometry.shrink import grow

    assert grow((2, 4), range(8), 0, range(8)) == ((2, 4), tuple(range(8)))
    assert grow((2, 4), range(8), 0, {0, 1, 2, 3, 4, 6, 7}) == ((1, 4), (0, 1, 2, 3))
    assert grow((2, 4), range(8), 0, {4, 5, 6, 7}) == ((1, 4), (4, 5, 6, 7))  # rank 0's slice
    assert grow((4, 2), range(8), 1, {0, 2, 4, 6, 1, 3, 5}) == ((4, 1), (0, 2, 4, 6))
    assert grow((3, 2), [5, 4, 3, 2, 1, 0], 0, {5, 4, 1, 0}) == ((2, 2), (5, 4, 1, 0))


def test_shrink_then_grow_returns_the_full_mesh():
    from tensorplay.distributed.geometry.shrink import grow

    shrunk = shrink((2, 4), range(8), 0, {5})
    back = grow((2, 4), range(8), 0, set(shrunk.ranks) | set(shrunk.spares) | {5})
    assert back == ((2, 4), tuple(range(8)))
