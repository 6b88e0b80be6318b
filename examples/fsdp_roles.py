"""FSDP2 on our mesh, FSDP or HSDP chosen by the mesh's roles; run it on 4 processes:

    tensorplay-run --nproc-per-node 4 --preload torch.distributed.tensor examples/fsdp_roles.py
"""

from __future__ import annotations

import sys

import torch

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.fsdp import fully_shard
from tensorplay.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4, dtype=torch.float64))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(3):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max((p.full_tensor() - q).abs().max().item()  # each parameter gathered whole
               for p, q in zip(model.parameters(), reference.parameters(), strict=True))


dist.init_process_group()  # env://, as tensorplay-run and torchrun set it; gloo on CPU
rank = dist.get_rank()
x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
y = torch.sin(x[:, :4])
reference = make_model()
train(reference, x, y)  # the same training in this one process, on the whole batch

# FSDP over "dp_shard" and tensor parallelism over "tp": [[0, 1], [2, 3]]
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"),
                        mesh_dim_roles={"dp_shard": "shard", "tp": "tensor"})
model = make_model()
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp_shard"])  # a "shard" dim: FSDP over [0, 2] or [1, 3]
half = mesh.get_local_rank("dp_shard")  # each "dp_shard" index trains on half the batch
train(model, x[8 * half:8 * half + 8], y[8 * half:8 * half + 8])
fsdp_tp = max_diff(model, reference)

# HSDP: shard over "dp_shard", replicate over "dp_replicate"
hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"),
                        mesh_dim_roles={"dp_replicate": "replicate", "dp_shard": "shard"})
model = make_model()
fully_shard(model, mesh=hsdp)
quarter = 2 * hsdp.get_local_rank("dp_replicate") + hsdp.get_local_rank("dp_shard")
train(model, x[4 * quarter:4 * quarter + 4], y[4 * quarter:4 * quarter + 4])
hsdp_diff = max_diff(model, reference)

try:  # "tp" is no data-parallel dim: fully_shard says which slice to pass
    fully_shard(make_model(), mesh=mesh)
except dist.ArgumentError as err:
    refused = str(err)

ok = max(fsdp_tp, hsdp_diff) < 1e-12
if rank == 0:
    print(f"FSDP over 'dp_shard' + TP over 'tp': max diff {fsdp_tp:.1e}")
    print(f"HSDP over ('dp_replicate', 'dp_shard'): max diff {hsdp_diff:.1e}")
    print(f"the whole mesh: {refused}")
    print("OK: both match one process" if ok else "MISMATCH", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
