"""A world that plain torch.distributed started (as Lightning or accelerate do) is adopted."""

from __future__ import annotations

import pytest

from tests import spawn

pytestmark = pytest.mark.slow


def torch_first_job(rank: int) -> dict:
    import torch
    import torch.distributed as tdist

    import tensorplay.distributed as dist
    from tensorplay.distributed import init_device_mesh

    tdist.init_process_group("gloo")  # env:// from the spawn helper
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # adopts it
    x = torch.full((1,), float(rank))
    dist.all_reduce(x, group=mesh.get_group("tp"))
    out = {"coordinate": mesh.get_coordinate(), "tp_sum": x.item(),
           "rank": dist.get_rank(), "size": dist.get_world_size()}
    dist.destroy_process_group()  # ours: our groups go, torch's world stays
    out["torch_still_up"] = tdist.is_initialized()
    y = torch.ones(1)
    tdist.all_reduce(y)
    out["torch_sum"] = y.item()
    tdist.destroy_process_group()
    return out


def test_a_mesh_is_built_on_a_world_torch_started():
    out = spawn.run(torch_first_job, 4, init=False, timeout=120)
    for rank, result in enumerate(out):
        assert result["coordinate"] == [rank // 2, rank % 2]
        assert result["tp_sum"] == (1.0 if rank < 2 else 5.0)
        assert (result["rank"], result["size"]) == (rank, 4)
        assert result["torch_still_up"] and result["torch_sum"] == 4.0


def init_after_torch_job(rank: int) -> str:
    import torch.distributed as tdist

    import tensorplay.distributed as dist

    tdist.init_process_group("gloo")
    dist.init_process_group("fake", rank=5, world_size=8)  # a simulated world is never adopted
    simulated = (dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
    dist.init_process_group()  # adopts torch's world instead of failing
    adopted = (dist.get_backend(), dist.get_world_size())
    dist.destroy_process_group()
    tdist.destroy_process_group()
    return simulated, adopted


def test_init_process_group_adopts_torch_world():
    out = spawn.run(init_after_torch_job, 2, init=False, timeout=120)
    assert out == [((5, 8), ("gloo", 2))] * 2
