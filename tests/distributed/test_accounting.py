"""Collective accounting and strict mode: a stray collective never goes unnamed.

The stray case is the one a user met: on a (2, 4) "dp" x "tp" mesh of 8 gloo ranks, rank 0
makes one extra all_reduce on the "tp" group inside the training loop. Its sums are silently
wrong from then on; at the end rank 0 must be named, with the "tp" group and the counts.
"""

from __future__ import annotations

import pytest
import torch

import tensorplay.distributed as dist
from tests import spawn

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def stray_job(rank: int, extra_at: int) -> dict:
    from tensorplay.distributed import init_device_mesh

    dist.init_process_group("gloo", timeout=20)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    sums = []
    try:
        for step in range(4):
            x = torch.ones(1)
            dist.all_reduce(x, group=tp)
            if rank == 0 and step == extra_at:
                dist.all_reduce(torch.ones(1), group=tp)  # the stray call
            sums.append(x.item())
        dist.destroy_process_group()
    except dist.DistributedError as err:
        return {"error": type(err).__name__, "message": str(err), "sums": sums,
                "counts": getattr(err, "counts", None)}
    return {"error": None, "sums": sums}


def test_an_extra_all_reduce_on_rank_0_is_named_with_the_tp_group():
    out = spawn.run(stray_job, 8, 1, init=False, timeout=120, pg_timeout=20)  # inside the loop
    zero = out[0]
    assert zero["error"] == "CallMismatchError", out
    assert zero["message"].startswith(
        "ranks made different numbers of collective calls on the 'tp' group [0-3]: "
        "rank 0 made 5; ranks 1-3 made 4."), zero["message"]
    assert zero["counts"] == {5: [0], 4: [1, 2, 3]}
    for rank in range(4, 8):  # the other "tp" row made matching calls and ends cleanly
        assert out[rank]["error"] is None, out[rank]
        assert out[rank]["sums"] == [4.0] * 4


def strict_job(rank: int) -> dict:
    import numpy as np

    out = {}
    x = np.full(2, float(rank))
    dist.all_reduce(x)  # the same call everywhere: checked, then run
    out["sum"] = x.tolist()
    try:
        if rank == 2:
            dist.broadcast(torch.zeros(2, dtype=torch.float64), src=0)
        else:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
    except dist.DistributedError as err:
        out["error"], out["message"] = type(err).__name__, str(err)
    return out


def test_strict_mode_names_the_rank_whose_call_differs_and_where():
    out = spawn.run(strict_job, 4, timeout=120, env={"TENSORPLAY_STRICT": "1"})
    for result in out:
        assert result["sum"] == [6.0, 6.0]
        assert result["error"] == "CallMismatchError", result
        lines = result["message"].splitlines()
        assert lines[0] == "ranks made different calls on the world group [0-3] at its call #2:"
        assert lines[1].startswith("  ranks 0-1, 3: all_reduce((2,) torch.float64, SUM) at "
                                   "test_accounting.py:"), lines
        assert lines[2].startswith("  rank 2: broadcast((2,) torch.float64, 0) at "
                                   "test_accounting.py:"), lines
    assert len({r["message"] for r in out}) == 1  # every member words the same error


def progress_job(rank: int) -> list[str]:
    import logging
    import time

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("tensorplay.distributed").addHandler(Keep())
    if rank == 1:
        time.sleep(4)
    dist.all_reduce(torch.ones(1))
    return seen


def test_a_long_wait_says_what_it_waits_in():
    out = spawn.run(progress_job, 2, timeout=120, env={"TENSORPLAY_PROGRESS_S": "1"})
    notes = [m for m in out[0] if "still in" in m]
    assert len(notes) == 1, out[0]  # said once
    assert notes[0].startswith("rank 0: still in all_reduce() on the world group [0-1] after ")
    assert not [m for m in out[1] if "still in" in m]


def dead_peer_job(rank: int) -> dict:
    import os
    import signal

    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))
    except dist.DistributedError as err:
        return {"error": type(err).__name__, "message": str(err),
                "ranks": getattr(err, "ranks", None)}
    return {"error": None}


def test_a_collective_that_loses_a_peer_names_it():
    out = spawn.run(dead_peer_job, 3, timeout=120, pg_timeout=20, expect_errors=True)
    for rank in (0, 1):
        assert out[rank]["error"] == "RankFailedError", out[rank]
        assert out[rank]["ranks"] == [2], out[rank]
        assert out[rank]["message"].startswith(
            "all_reduce() on the world group [0-2] failed: rank 2 (pid "), out[rank]
