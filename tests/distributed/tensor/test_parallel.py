"""tensorplay.distributed.tensor.parallel, and FSDP2 on slices of our mesh's torch root.

On the 8 ranks of ``world8``: tensor parallelism over "tp" gives the local module's outputs
and gradients, and one training step with FSDP2 over "dp" (or over a flattened "dp_cp") and
TP over "tp" gives the weights of the same step in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.tensor import DTensor
from tensorplay.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.down = torch.nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(n, 8, generator=gen, dtype=torch.float64),
            torch.randn(n, 8, generator=gen, dtype=torch.float64))


def tp_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    local, model = MLP(), MLP()
    parallelize_module(model, mesh["tp"], PLAN)
    x, _ = _data()
    y, want = model(x), local(x)
    y.sum().backward()
    want.sum().backward()
    return {"shard": tuple(model.up.weight.to_local().shape),
            "out": (y - want).abs().max().item(),
            "grad": max((p.grad.full_tensor() - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), local.parameters(), strict=True))}


@pytest.mark.slow
def test_colwise_and_rowwise_give_the_local_outputs_and_gradients(world8):
    for out in world8.run(tp_job):
        assert out["shard"] == (4, 8)  # 16 output features over 4 "tp" ranks
        assert out["out"] < 1e-12 and out["grad"] < 1e-12


def _step(model: torch.nn.Module, x, target) -> None:
    ((model(x) - target) ** 2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()


def _trained_diff(model, reference) -> float:
    return max((p.full_tensor() - q).abs().max().item() for p, q in
               zip(model.parameters(), reference.parameters(), strict=True))


def fsdp_tp_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x, target = _data()
    reference = MLP()
    _step(reference, x, target)
    out = {}
    for via in ("root", "slices"):
        model = MLP()
        if via == "root":  # slices of the torch root, as a torch user writes it
            tm = mesh.to_torch()
            parallelize_module(model, tm["tp"], copy.deepcopy(PLAN))
            fully_shard(model, mesh=tm["dp"])
        else:  # our slices, converted: the same root
            parallelize_module(model, mesh["tp"], copy.deepcopy(PLAN))
            fully_shard(model, mesh=mesh["dp"].to_torch())
        half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
        _step(model, x[half], target[half])
        out[via] = {"diff": _trained_diff(model, reference),
                    "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
                    "mesh": next(model.parameters()).device_mesh.mesh_dim_names}
    return out


@pytest.mark.slow
def test_fsdp2_over_dp_with_tp_over_tp_trains_like_one_process(world8):
    for out in world8.run(fsdp_tp_job):
        for via in ("root", "slices"):
            assert out[via]["diff"] < 1e-12, (via, out)
            assert out[via]["dtensors"] and out[via]["mesh"] == ("dp", "tp")


def fsdp_flat_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    dp_cp = mesh["dp", "cp"].flatten()
    x, target = _data()
    reference, model = MLP(), MLP()
    _step(reference, x, target)
    parallelize_module(model, mesh["tp"], copy.deepcopy(PLAN))
    fully_shard(model, mesh=dp_cp.to_torch())
    part = slice(2 * dp_cp.get_local_rank(), 2 * dp_cp.get_local_rank() + 2)
    _step(model, x[part], target[part])
    return _trained_diff(model, reference)


@pytest.mark.slow
def test_fsdp2_over_a_flattened_dim_with_tp(world8):
    assert max(world8.run(fsdp_flat_job)) < 1e-12
