"""tensorplay.distributed.tensor: torch's DTensor entry points taking our DeviceMesh.

On the 8 ranks of ``world8``, every entry point on every mesh kind (2-d, permuted, subset,
flattened, unflattened), each checked by value against the same computation on one process.
The last tests run in this process (a 1-rank gloo world).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    ones,
    zeros,
)

X = torch.arange(64, dtype=torch.float64).reshape(8, 8)


def _block(array: np.ndarray, rank: int) -> torch.Tensor:
    """Brute force: rank's block of X when X's rows are split over dim 0 of the mesh array and
    its columns over dim 1."""
    i, j = (int(c[0]) for c in np.nonzero(array == rank))
    rows, cols = 8 // array.shape[0], 8 // array.shape[1]
    return X[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]


def two_d_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    d = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    summed = DTensor.from_local(torch.full((3,), float(rank)), mesh["tp"], [Partial()])
    stacked = DTensor.from_local(torch.tensor([[float(rank)]]), mesh, [Shard(0), Shard(1)])
    # a distributed matmul: W split by columns over "tp", x replicated
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(8, 12, generator=gen)
    y = distribute_tensor(x, mesh["tp"], [Replicate()]) @ distribute_tensor(w, mesh["tp"],
                                                                          [Shard(1)])
    return {
        "local": torch.equal(d.to_local(), _block(np.arange(8).reshape(2, 4), rank)),
        "full": torch.equal(d.full_tensor(), X),
        "replicated": torch.equal(d.redistribute(placements=[Replicate(), Replicate()])
                                  .to_local(), X),
        "summed": summed.full_tensor().tolist(), "stacked": stacked.full_tensor().tolist(),
        "matmul_placements": y.placements, "matmul": (y.full_tensor() - x @ w).abs().max().item(),
        "is_dtensor": isinstance(d, DTensor) and issubclass(type(d), DTensor),
        "mesh_is_ours": d.device_mesh is mesh.to_torch(),
    }


@pytest.mark.slow
def test_distribute_redistribute_partial_and_matmul_on_a_2d_mesh(world8):
    for rank, out in enumerate(world8.run(two_d_job)):
        assert out["local"] and out["full"] and out["replicated"]
        row = list(range(4 * (rank // 4), 4 * (rank // 4) + 4))
        assert out["summed"] == [float(sum(row))] * 3  # Partial: the "tp" row's sum
        assert out["stacked"] == [[float(r) for r in row] for row in
                                  np.arange(8).reshape(2, 4).tolist()]
        assert out["matmul_placements"] == (Shard(1),) and out["matmul"] < 1e-6
        assert out["is_dtensor"] and out["mesh_is_ours"]


def kinds_job(rank: int, kind: str):
    if kind == "permuted":
        mesh = DeviceMesh("cpu", [[3, 1, 7, 5], [2, 0, 6, 4]], mesh_dim_names=("a", "b"))
    elif kind == "subset":
        mesh = DeviceMesh("cpu", [[0, 2], [4, 6]], mesh_dim_names=("x", "y"))
    elif kind == "unflattened":
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("u",)).unflatten(
            "u", (2, 4), ("ua", "ub"))
    stacked = DTensor.from_local(torch.tensor([[float(rank)]]), mesh, [Shard(0), Shard(1)])
    d = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    out = {"numel": d.to_local().numel(), "local": d.to_local().clone()}
    if mesh.get_coordinate() is not None:  # outside the mesh there is nothing to gather
        out["stacked"] = stacked.full_tensor().tolist()
        out["full"] = torch.equal(d.full_tensor(), X)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "array"), [
    ("permuted", np.array([[3, 1, 7, 5], [2, 0, 6, 4]])),
    ("subset", np.array([[0, 2], [4, 6]])),
    ("unflattened", np.arange(8).reshape(2, 4)),
])
def test_dtensors_follow_the_mesh_order_on_every_mesh_kind(world8, kind, array):
    for rank, out in enumerate(world8.run(kinds_job, kind)):
        if rank not in array:  # torch's rule outside a mesh: an empty local shard
            assert out["numel"] == 0 and "full" not in out
            continue
        assert torch.equal(out["local"], _block(array, rank))
        assert out["full"]
        assert out["stacked"] == array.astype(float).tolist()


def flattened_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    flat = mesh["pp", "dp"].flatten()
    d = distribute_tensor(X, flat, [Shard(0)])
    # on the root: rows split over "pp" then "dp"; gathering them may use the flattened group
    r = distribute_tensor(X, mesh, [Shard(0), Shard(0), Replicate()])
    return {"local": d.to_local().tolist(), "full": torch.equal(d.full_tensor(), X),
            "root_local": r.to_local().tolist(),
            "root_full": torch.equal(r.redistribute(placements=[Replicate()] * 3).to_local(), X)}


@pytest.mark.slow
def test_a_flattened_mesh_carries_dtensors(world8):
    for rank, out in enumerate(world8.run(flattened_job)):
        index = rank // 2  # position along "pp_dp": pp * 2 + dp
        assert out["local"] == out["root_local"] == X[2 * index:2 * index + 2].tolist()
        assert out["full"] and out["root_full"]


def module_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    local = torch.nn.Linear(8, 4, dtype=torch.float64)
    module = torch.nn.Linear(8, 4, dtype=torch.float64)
    module.load_state_dict(local.state_dict())
    handed = []

    def partition(name, mod, torch_mesh):  # torch hands its own mesh; ours takes it too
        handed.append(torch_mesh is mesh["tp"].to_torch())
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, torch.nn.Parameter(
                distribute_tensor(p.detach(), torch_mesh, [Replicate()])))

    distribute_module(module, mesh["tp"], partition,
                      input_fn=lambda mod, inputs, m: tuple(
                          DTensor.from_local(t, m, [Replicate()]) for t in inputs),
                      output_fn=lambda mod, out, m: out.to_local())
    x = torch.randn(3, 8, dtype=torch.float64)
    return {"handed": all(handed) and bool(handed),
            "params": all(isinstance(p, DTensor) for p in module.parameters()),
            "diff": (module(x) - local(x)).abs().max().item()}


@pytest.mark.slow
def test_distribute_module_hands_torch_mesh_to_callbacks_that_take_either(world8):
    for out in world8.run(module_job):
        assert out["handed"] and out["params"] and out["diff"] < 1e-12


def factories_job(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    made = {f.__name__: f(8, 16, device_mesh=mesh["tp"], placements=[Shard(0)],
                          dtype=torch.float64) for f in (zeros, ones, empty)}
    filled = full((8, 8), 2.5, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    return {"shapes": {n: tuple(d.to_local().shape) for n, d in made.items()},
            "meshes": all(d.device_mesh is mesh["tp"].to_torch() for d in made.values()),
            "ones": made["ones"].full_tensor().sum().item(),
            "full": (tuple(filled.to_local().shape), filled.full_tensor().sum().item())}


@pytest.mark.slow
def test_the_dtensor_factories_take_our_mesh(world8):
    for out in world8.run(factories_job):
        assert set(out["shapes"].values()) == {(2, 16)} and out["meshes"]  # 8 rows over 4
        assert out["ones"] == 128 and out["full"] == ((4, 2), 160.0)
    # rand and randn pass our mesh on alike; torch 2.13's DTensor random ops need a CUDA mesh


# -- in this process -----------------------------------------------------------------------------

def test_dtensor_answers_as_torchs_class(gloo1):
    from torch.distributed.tensor import DTensor as TorchDTensor

    mesh = init_device_mesh("cpu", (1,))
    d = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
    assert type(d) is TorchDTensor and isinstance(d, DTensor)
    assert issubclass(TorchDTensor, DTensor) and not isinstance(torch.ones(1), DTensor)
    assert DTensor.to_local is TorchDTensor.to_local  # other attributes are torch's
    assert distribute_tensor(torch.ones(2), mesh.to_torch(), [Shard(0)]).device_mesh is \
        mesh.to_torch()  # a torch mesh passes through unchanged
