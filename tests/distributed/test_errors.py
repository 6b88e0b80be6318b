"""errors.py's wording helpers: rank runs, in words and in the compact form stores carry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorplay.distributed.errors import compact_runs, format_ranks, parse_runs, rank_words


@given(st.sets(st.integers(0, 300), min_size=1))
def test_compact_runs_round_trip(ranks):
    ordered = sorted(ranks)
    assert parse_runs(compact_runs(ordered)) == ordered


@pytest.mark.parametrize(("ranks", "text"), [([0, 1, 2, 5], "0-2,5"), ([7], "7"),
                                             ([1, 3, 4], "1,3-4")])
def test_compact_runs_are_compact(ranks, text):
    assert compact_runs(ranks) == text


@pytest.mark.parametrize(("ranks", "text"), [([0, 1, 2, 3, 7], "0-3, 7"), ([], "(none)"),
                                             ([5, 4, 4], "4-5")])
def test_format_ranks_words_runs(ranks, text):
    assert format_ranks(ranks) == text


def test_a_long_list_is_cut_and_counted():
    assert format_ranks(range(0, 100, 2), limit=3) == "0, 2, 4, ... (50 in all)"
    assert rank_words([3]) == "rank 3" and rank_words([2, 0, 1]) == "ranks 0-2"
