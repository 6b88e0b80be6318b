"""Train a transformer-style MLP block with FSDP2 over "dp" and tensor parallelism over "tp".

Run it with 8 processes; any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
works, so either of

    tensorplay-run --nproc-per-node 8 --preload torch.distributed.tensor examples/train_fsdp_tp.py
    torchrun --nproc-per-node 8 examples/train_fsdp_tp.py

The block is y = x + down(relu(up(norm(x)))), with a layer norm over 16 features and 64 hidden
units. On the (2, 4) mesh [[0, 1, 2, 3], [4, 5, 6, 7]] named ("dp", "tp"):

- tensor parallelism over each "tp" row: ``up`` is split by output features (16 hidden units
  per rank) and ``down`` by input features; the 4 partial outputs are summed on the row's
  "tp" group. Built with tensorplay's ``parallelize_module`` on ``mesh["tp"]``;
- FSDP2 over each "dp" column: torch's ``fully_shard`` on ``mesh["dp"].to_torch()`` shards
  every parameter again over the 2 ranks of the column, gathers it for the forward and
  backward, and averages the gradients; each "dp" row trains on its half of the batch.

Both torch meshes come from one root (our mesh's ``to_torch()``), which FSDP2 with TP
requires. Rank 0 prints the mesh, the loss of each step and how far the trained weights are
from the same training in one process with plain torch; above 1e-5 every rank exits 1.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch.distributed.fsdp import fully_shard

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.tensor import DTensor
from tensorplay.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

MESH_SHAPE, MESH_NAMES = (2, 4), ("dp", "tp")
D_MODEL, HIDDEN = 16, 64  # HIDDEN must be a multiple of the "tp" size
BATCH = 32  # the global batch of one step, split over the "dp" rows
LR, SEED, TOLERANCE = 0.5, 0, 1e-5
DTYPE = torch.float64  # float64 keeps the 1e-5 check far above rounding noise


class Block(torch.nn.Module):
    """The MLP half of a transformer layer: pre-norm, up, relu, down, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D_MODEL, dtype=DTYPE)
        self.up = torch.nn.Linear(D_MODEL, HIDDEN, dtype=DTYPE)
        self.down = torch.nn.Linear(HIDDEN, D_MODEL, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    return a


def make_problem() -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The initial block and one (inputs, targets) batch, the same on every rank (seeded)."""
    torch.manual_seed(SEED)
    block = Block()
    x = torch.randn(BATCH, D_MODEL, dtype=DTYPE)
    target = torch.sin(x) + 0.1 * x.roll(1, dims=1)  # some function of x for the block to learn
    return block, x, target


def train(block: torch.nn.Module, x, target, steps: int, say=None) -> None:
    """Plain SGD on the mean squared error; ``say`` reports each step's whole-batch loss."""
    opt = torch.optim.SGD(block.parameters(), lr=LR)
    for step in range(steps):
        loss = ((block(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if say is not None:
            say(step, steps, loss.detach())


def main() -> int:
    a = parse_args()
    dist.init_process_group()  # env://: tensorplay-run's or torchrun's variables; gloo on CPU
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    rank = dist.get_rank()
    if rank == 0:
        print(mesh, flush=True)

    block, x, target = make_problem()
    reference = copy.deepcopy(block)
    # Tensor parallelism over "tp", then FSDP2 over "dp": both on this mesh's own groups.
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"].to_torch())
    dp = mesh.get_local_rank("dp")
    mine = slice(dp * BATCH // MESH_SHAPE[0], (dp + 1) * BATCH // MESH_SHAPE[0])

    def say(step: int, steps: int, loss: torch.Tensor) -> None:
        loss = loss.reshape(1).clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))  # both halves
        if rank == 0:
            print(f"step {step + 1}/{steps}  loss {loss.item():.6f}", flush=True)

    train(block, x[mine], target[mine], a.steps, say)
    train(reference, x, target, a.steps)  # the same training in this one process

    worst = torch.zeros(1, dtype=DTYPE)
    block.unshard()  # FSDP2 gathers each parameter over "dp": TP's DTensors on "tp" remain
    for p, ref in zip(block.parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p  # gathered over "tp" too
        worst = torch.maximum(worst, (full.detach() - ref.detach()).abs().max().reshape(1))
    block.reshard()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # NaN anywhere stays NaN
    ok = bool(worst.item() <= TOLERANCE)
    if rank == 0:
        print(f"max abs diff: {worst.item():.3e} (tolerance {TOLERANCE:g})")
        print("OK: matches single-process training" if ok else
              "MISMATCH: trained weights differ from single-process training", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
