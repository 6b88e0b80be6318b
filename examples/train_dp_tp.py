"""Train a small MLP on a (2, 4) mesh: data parallel over "dp", tensor parallel over "tp".

Run it with 8 processes; any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
works, so either of

    tensorplay-run --nproc-per-node 8 examples/train_dp_tp.py
    torchrun --nproc-per-node 8 examples/train_dp_tp.py

The model is y = relu(x @ W1) @ W2 with 32 hidden units, split over the 4 ranks of a "tp" row:
the rank at (dp, tp) holds columns 8*tp .. 8*tp+7 of W1 and the same rows of W2. Each of the
2 "dp" rows holds the whole model (as 4 shards) and trains on its own half of the batch.
Rank 0 prints the mesh, where every rank sits, the loss of each step, and finally how far the
trained weights are from the same training done in one process with plain torch; the job
exits 1 on every rank when that distance is above 1e-5.
"""

from __future__ import annotations

import argparse
import sys

import torch

# the sizes, learning rate, seed and dtype (float64) of the problem, shared with
# train_elastic.py and bench/recovery_job_torch.py
from mlp_problem import BATCH, D_IN, D_OUT, DTYPE, HIDDEN, LR, MESH_NAMES, MESH_SHAPE, SEED

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

TOLERANCE = 1e-5


def parse_args() -> argparse.Namespace:
    """The command line: --steps, and a switch that breaks training on purpose."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    p.add_argument("--skip-dp-average", action="store_true",
                   help="for tests only: skip the gradient average over 'dp', so each dp row "
                        "learns from half the data and the final check must fail")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    return a


def make_problem() -> tuple[torch.Tensor, ...]:
    """Initial W1, W2 and the (inputs, targets) batch; the same on every rank (same seed)."""
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    w1, w2 = randn(D_IN, HIDDEN) / D_IN**0.5, randn(HIDDEN, D_OUT) / HIDDEN**0.5
    teacher = randn(D_IN, D_OUT)  # the function the MLP learns: tanh(x @ teacher)
    x = randn(BATCH, D_IN)
    return w1, w2, x, torch.tanh(x @ teacher)


def forward(x, w1, w2, tp_group):
    """This rank's hidden units, then the partial outputs summed over "tp" into the full y."""
    z = x @ w1  # (local batch, HIDDEN / 4): only this rank's hidden units
    h = torch.relu(z)
    y = h @ w2  # this rank's share of the output; the 4 shares of a "tp" row add up to y
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=tp_group)
    return z, h, y


def backward(x, z, h, y, target, w2):
    """Gradients of the local batch's mean squared error wrt this rank's shards.

    y is the same on every rank of a "tp" row, so dy is too, and each hidden unit's gradient
    needs only its own row of W2: no communication in the backward pass.
    """
    dy = 2 * (y - target) / y.numel()  # d loss / d y for loss = mean((y - target) ** 2)
    dw2 = h.T @ dy
    dh = dy @ w2.T  # (local batch, HIDDEN / 4): this rank's hidden units only
    dw1 = x.T @ (dh * (z > 0))  # back through the relu
    return dw1, dw2


def train(mesh, problem, steps: int, average_dp: bool, say) -> tuple[torch.Tensor, ...]:
    """Plain SGD on this rank's shards and batch rows; returns the trained shards."""
    w1, w2, x, target = problem
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dp_size, tp_size = mesh.shape
    w1 = w1.chunk(tp_size, dim=1)[tp].clone()  # my columns of W1
    w2 = w2.chunk(tp_size, dim=0)[tp].clone()  # the same rows of W2
    x = x.chunk(dp_size, dim=0)[dp]  # my dp row's half of the batch
    target = target.chunk(dp_size, dim=0)[dp]
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    for step in range(steps):
        z, h, y = forward(x, w1, w2, tp_group)
        dw1, dw2 = backward(x, z, h, y, target, w2)
        if average_dp:  # equal halves, so the mean of the halves' gradients = the full batch's
            dist.all_reduce(dw1, op=dist.ReduceOp.AVG, group=dp_group)
            dist.all_reduce(dw2, op=dist.ReduceOp.AVG, group=dp_group)
        w1 -= LR * dw1
        w2 -= LR * dw2
        loss = ((y - target) ** 2).mean().reshape(1)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)  # the whole batch's loss
        say(f"step {step + 1}/{steps}  loss {loss.item():.6f}")
    return w1, w2


def reference(problem, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same training in one process: full weights, full batch, autograd for gradients."""
    w1, w2, x, target = (t.clone() for t in problem)
    w1.requires_grad_()
    w2.requires_grad_()
    for _ in range(steps):
        loss = ((torch.relu(x @ w1) @ w2 - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for w in (w1, w2):
                w -= LR * w.grad
                w.grad = None
    return w1.detach(), w2.detach()


def gather_world(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t``, stacked in global rank order (on every rank)."""
    world = dist.get_world_size()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))  # the pieces end to end along dim 0
    dist.all_gather_into_tensor(out, t.contiguous())
    return out.view(world, *t.shape)


def print_layout(mesh, say) -> None:
    """Rank 0 prints every rank's coordinate and its "dp" and "tp" group members."""
    mine = [dist.get_rank(), *mesh.get_coordinate(),
            *dist.get_process_group_ranks(mesh.get_group("dp")),
            *dist.get_process_group_ranks(mesh.get_group("tp"))]
    n_dp = mesh.shape[0]  # row layout: rank, dp, tp, then n_dp "dp" ranks, then "tp" ranks
    say(f"{'rank':>4}  {'(dp, tp)':<9} {'dp group':<9} tp group")
    for row in gather_world(torch.tensor(mine)).tolist():
        coord, dp_ranks, tp_ranks = tuple(row[1:3]), row[3:3 + n_dp], row[3 + n_dp:]
        say(f"{row[0]:>4}  {str(coord):<9} {str(dp_ranks):<9} {tp_ranks}")


def compare(mesh, shards, problem, steps: int, say) -> bool:
    """Whether both "dp" replicas' weights are within TOLERANCE of the reference (all ranks)."""
    w1s, w2s = gather_world(shards[0]), gather_world(shards[1])  # indexed by global rank
    worst = torch.zeros((), dtype=DTYPE)  # rank 0 fills it in; the others add 0 in the sum
    if dist.get_rank() == 0:
        ref1, ref2 = reference(problem, steps)
        for dp, row in enumerate(mesh.mesh.tolist()):  # row: the ranks of one "tp" group
            w1 = torch.cat([w1s[r] for r in row], dim=1)  # columns back side by side
            w2 = torch.cat([w2s[r] for r in row], dim=0)  # rows back on top of each other
            d = torch.maximum((w1 - ref1).abs().max(), (w2 - ref2).abs().max())  # NaN stays NaN
            say(f"dp replica {dp} (ranks {row}): max abs diff vs single process {d:.3e}")
            worst = torch.maximum(worst, d)
        say(f"max abs diff: {worst:.3e} (tolerance {TOLERANCE:g})")
        say("OK: matches single-process training" if worst <= TOLERANCE else
            f"MISMATCH: trained weights differ from single-process training by {worst:.3e}")
    verdict = worst.reshape(1)
    dist.all_reduce(verdict, op=dist.ReduceOp.SUM)  # every rank learns rank 0's result
    return verdict.item() <= TOLERANCE  # False for NaN too


def main() -> int:
    """Set up the world and mesh, train, check; the exit code is 1 on a mismatch."""
    a = parse_args()
    # 1. Join the job: the launcher's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env://), gloo.
    dist.init_process_group()
    # 2. Lay the 8 ranks out as [[0, 1, 2, 3], [4, 5, 6, 7]]: a row is a "tp" group, a column
    #    a "dp" group. Every rank makes the same call; the groups are ready when it returns.
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    rank = dist.get_rank()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    say(f"{mesh}")
    print_layout(mesh, say)
    # 3. Train: every rank builds the same full problem from the seed and keeps its own part.
    problem = make_problem()
    shards = train(mesh, problem, a.steps, not a.skip_dp_average, say)
    # 4. Check: both "dp" replicas against one-process training, then agree on the exit code.
    ok = compare(mesh, shards, problem, a.steps, say)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
