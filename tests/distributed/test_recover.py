"""Elastic recovery's core on real gloo ranks: a rank SIGKILLed mid-training, the survivors
agree, shrink the mesh along "dp" and keep reducing on groups of a new epoch."""

from __future__ import annotations

import pytest

from tests import spawn

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _train(rank: int) -> dict[str, object]:
    import os
    import signal

    import torch

    import tensorplay.distributed as dist
    from tensorplay.distributed import init_device_mesh
    from tensorplay.distributed._recover import shrink_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    caught = None
    for step in range(20):
        if rank == 3 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            t = torch.ones(2)
            dist.all_reduce(t, group=mesh.get_group("dp"))
            dist.all_reduce(t, group=mesh.get_group("tp"))
        except (dist.RankFailedError, dist.DistributedTimeoutError) as err:
            caught = type(err).__name__
            mesh, shrunk = shrink_mesh(mesh, err, "dp")
            break
    out = {"caught": caught, "shape": mesh.shape, "coordinate": mesh.get_coordinate(),
           "spares": list(shrunk.spares), "lost": list(shrunk.lost)}
    if mesh.get_coordinate() is not None:  # the survivors in the mesh go on training
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=mesh.get_group("tp"))
        out["after"] = t.tolist()
        out["group"] = mesh.get_group("tp").name
    return out


def test_a_killed_rank_leaves_a_smaller_mesh_that_keeps_reducing():
    results = spawn.run(_train, 4, timeout=120, pg_timeout=3, expect_errors=True)
    assert results[3] is spawn.NO_ANSWER or getattr(results[3], "kind", "") == "NoAnswer"
    for rank in (0, 1, 2):
        got = results[rank]
        assert isinstance(got, dict), got
        assert got["caught"] in ("RankFailedError", "DistributedTimeoutError"), got
        assert got["lost"] == [3] and got["spares"] == [2], got
        assert got["shape"] == (1, 2), got
    assert results[0]["coordinate"] == [0, 0] and results[1]["coordinate"] == [0, 1]
    assert results[2]["coordinate"] is None  # a spare: its slice is gone
    assert results[0]["after"] == results[1]["after"] == [3.0, 3.0]  # ranks 0 and 1: 1 + 2
    assert results[0]["group"].split("-")[1] == "e1"  # a group of the new epoch
