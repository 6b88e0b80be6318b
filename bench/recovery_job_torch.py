"""Restart-the-world: the training of examples/train_elastic.py on plain torch.distributed.

    torchrun --nproc-per-node 8 --max-restarts 1 bench/recovery_job_torch.py \
        --ckpt-dir DIR --steps 16 --kill 5@4 --step-s 1.0

What bench/recovery.py runs against ``tensorplay-run ... examples/train_elastic.py``: the same
(2, 4) "dp" x "tp" MLP, the same initial weights and the same batch at every step (from
examples/mlp_problem.py, which imports torch only, so that this process imports nothing of
tensorplay), each step sleeping --step-s before its compute, on torch's own
``init_device_mesh`` and gloo. After every step each rank saves its shards and the step count
with ``torch.save`` to DIR/rank<r>-step<k>.pt (the last two kept, written atomically); at start
every rank loads the newest step that all ranks have saved. On the first attempt only
(TORCHELASTIC_RESTART_COUNT "0") rank RANK SIGKILLs itself as it starts step STEP + 1; torchrun
(--max-restarts 1) then stops the other ranks and starts all 8 again, which load the checkpoint
and go on. Rank 0 prints ``step k/N ... t=<unix time>`` after each step and ``attempt A
started at t=<process start> ...`` once its checkpoint is loaded; the killing rank prints
``rank R kills itself at step k  t=...``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import sys
import time

BEGAN = time.time()  # before torch is imported: a restarted rank's start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from mlp_problem import LR, MESH_NAMES, MESH_SHAPE, batch, weights  # noqa: E402


def train_step(mesh, w1: torch.Tensor, w2: torch.Tensor, step: int) -> float:
    """One SGD step on this rank's shards and its "dp" row's share of the batch; in place."""
    dp, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    x, target = (t.chunk(dp_size, dim=0)[dp] for t in batch(step))
    z = x @ w1
    h = torch.relu(z)
    y = h @ w2
    dist.all_reduce(y, group=tp_group)
    dy = 2 * (y - target) / y.numel()
    dw2 = h.T @ dy
    dw1 = x.T @ ((dy @ w2.T) * (z > 0))
    dist.all_reduce(dw1, op=dist.ReduceOp.AVG, group=dp_group)
    dist.all_reduce(dw2, op=dist.ReduceOp.AVG, group=dp_group)
    loss = ((y - target) ** 2).mean().reshape(1)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
    w1 -= LR * dw1
    w2 -= LR * dw2
    return loss.item()


def save(ckpt_dir: str, rank: int, w1: torch.Tensor, w2: torch.Tensor, step: int) -> None:
    """This rank's shards after ``step`` steps; the checkpoint before it is kept too (a rank
    killed mid-step may leave the others one step apart), older ones removed."""
    path = os.path.join(ckpt_dir, f"rank{rank}-step{step}.pt")
    torch.save({"w1": w1, "w2": w2, "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)
    old = os.path.join(ckpt_dir, f"rank{rank}-step{step - 2}.pt")
    if os.path.exists(old):
        os.remove(old)


def load(ckpt_dir: str, rank: int) -> dict | None:
    """The newest step every rank has saved (agreed with an all_reduce MIN), or None."""
    mine = [int(m.group(1)) for p in glob.glob(os.path.join(ckpt_dir, f"rank{rank}-step*.pt"))
            if (m := re.search(r"-step(\d+)\.pt$", p))]
    newest = torch.tensor([max(mine, default=0)])
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest.item())
    if step == 0:
        return None
    return torch.load(os.path.join(ckpt_dir, f"rank{rank}-step{step}.pt"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="folder for the checkpoints")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--step-s", type=float, default=1.0, help="sleep before each step's compute")
    p.add_argument("--kill", default="5@4", metavar="RANK@STEP",
                   help="that rank SIGKILLs itself after STEP steps (first attempt only)")
    a = p.parse_args()
    kill_rank, kill_step = (int(v) for v in a.kill.split("@"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)

    def say(text: str, everyone: bool = False) -> None:
        if rank == 0 or everyone:
            print(f"{text}  t={time.time():.3f}", flush=True)

    tp, tp_size = mesh.get_local_rank("tp"), MESH_SHAPE[1]
    w1, w2 = weights()
    w1, w2 = w1.chunk(tp_size, dim=1)[tp].clone(), w2.chunk(tp_size, dim=0)[tp].clone()
    step = 0
    ckpt = load(a.ckpt_dir, rank)
    if ckpt is not None:
        w1, w2, step = ckpt["w1"], ckpt["w2"], ckpt["step"]
    say(f"attempt {attempt} started at t={BEGAN:.3f}, resumed at step {step}")
    while step < a.steps:
        if attempt == 0 and rank == kill_rank and step == kill_step:
            say(f"rank {rank} kills itself at step {step + 1}", True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(a.step_s)
        loss = train_step(mesh, w1, w2, step)
        step += 1
        save(a.ckpt_dir, rank, w1, w2, step)
        say(f"step {step}/{a.steps}  mesh {tuple(mesh.shape)}  attempt {attempt}  "
            f"loss {loss:.6f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
