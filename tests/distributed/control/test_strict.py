"""Strict mode (``control/strict.py``): before each collective the members compare what they call,
and a difference is one CallMismatchError, worded alike on every member, naming who called what
and where. Four ranks as threads (``tests.fakes.ThreadRanks(strict=True)``): their collectives
meet across the threads, and the words travel through the in-memory store."""

from __future__ import annotations

import numpy as np

from tensorplay.distributed import collectives
from tensorplay.distributed.errors import CallMismatchError
from tensorplay.distributed.process_group import ReduceOp
from tests.fakes import ThreadRanks


def _call(group, name: str, *args):
    """What collectives.py does with a group given: count the call, then run it."""
    group.calls += 1
    return getattr(group.ops, name)(*args)


def _strict_job(world) -> dict:
    out = {}
    x = np.full(2, float(world.rank))
    collectives.all_reduce(x, group=world.default_group)  # the same call everywhere: checked
    out["sum"] = x.tolist()
    try:
        if world.rank == 2:
            _call(world.default_group, "broadcast", np.zeros(2), 0, False)
        else:
            _call(world.default_group, "all_reduce", np.zeros(2), ReduceOp.SUM, False)
    except CallMismatchError as err:
        out["error"], out["message"] = type(err).__name__, str(err)
    return out


def test_strict_mode_names_the_rank_whose_call_differs_and_where():
    out = ThreadRanks(4, timeout_s=10, strict=True).run(_strict_job)
    for result in out:
        assert not isinstance(result, BaseException), result
        assert result["sum"] == [6.0, 6.0]
        assert result["error"] == "CallMismatchError", result
        lines = result["message"].splitlines()
        assert lines[0] == "ranks made different calls on the world group [0-3] at its call #2:"
        assert lines[1].startswith("  ranks 0-1, 3: all_reduce((2,) float64, SUM) at "
                                   "test_strict.py:"), lines
        assert lines[2].startswith("  rank 2: broadcast((2,) float64, 0) at test_strict.py:"), lines
    assert len({r["message"] for r in out}) == 1  # every member words the same error


def test_the_same_calls_pass_and_run():
    def job(world):
        x = np.full(3, 1.0 + world.rank)
        for _ in range(3):
            collectives.all_reduce(x, group=world.default_group)
        return x.tolist()

    assert ThreadRanks(3, strict=True).run(job) == [[54.0] * 3] * 3  # 6, 18, 54
