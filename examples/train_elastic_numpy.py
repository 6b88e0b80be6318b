"""Keep training when ranks die, on numpy arrays: the loop of train_elastic.py with no torch,
the same on both engines.

    mpiexec --with-ft ulfm --mca btl tcp,self --mca async_mpi_finalize 1 -n 8 \
        python examples/train_elastic_numpy.py --kill 5@4
    tensorplay-run --nproc-per-node 8 --max-restarts 1 examples/train_elastic_numpy.py --kill 5@4

A linear model y = x @ W (W of 16 x 8, its rows split over the 4 "tp" ranks of a row, each
step's batch of 16 split over the "dp" rows) trained by SGD on a (WORLD_SIZE / 4, 4) mesh
elastic on "dp". Rank 5 SIGKILLs itself at step 4: the survivors recover on (1, 4) (ranks 4, 6,
7 wait in grow() as spares); the members' next grow() brings rank 5 back (on MPI the survivors
spawn it; under tensorplay-run the launcher restarts it) and ``sync_replicas`` copies the
weights to the fresh ranks. A step that failed is done again from the weights before it, so the
weights must equal one process's within 1e-9 at the end; exit 1 if not. ``--verbose`` prints
each rank's pid at the start (for a test that kills one from outside) and each change of mesh.
``--no-elastic --resume-from STEP`` is the other side of bench/recovery_mpi.py: a plain mesh
whose loss ends the job, started again from the weights of step STEP (the checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh, sync_replicas

D_IN, D_OUT, BATCH, LR, TP = 16, 8, 16, 0.1, 4
TOLERANCE = 1e-9
FAILURES = (dist.RankFailedError, dist.DistributedTimeoutError)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="SGD steps (default 12)")
    p.add_argument("--step-s", type=float, default=0.2,
                   help="seconds each step lasts, standing in for compute (default 0.2)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                   help="that rank SIGKILLs itself as it starts that step (not a replacement)")
    p.add_argument("--stop", action="append", default=[], metavar="RANK@STEP",
                   help="for tests: that rank SIGSTOPs itself as it starts that step (hung)")
    p.add_argument("--die-in-recovery", type=int, action="append", default=[], metavar="RANK",
                   help="for tests: that rank SIGKILLs itself as it starts a recovery")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="elastic_min: the fewest 'dp' replicas to go on with (default 1)")
    p.add_argument("--no-elastic", action="store_true",
                   help="a plain mesh: a lost rank ends the job (restart-the-world)")
    p.add_argument("--resume-from", type=int, default=0, metavar="STEP",
                   help="start from the weights after STEP steps (a checkpoint; default 0)")
    p.add_argument("--verbose", action="store_true",
                   help="every rank prints its pid, and the mesh at each recovery or growth")
    a = p.parse_args()
    try:
        a.kills = {int(r): int(s) for r, s in (k.split("@") for k in a.kill)}
        a.stops = {int(r): int(s) for r, s in (k.split("@") for k in a.stop)}
    except ValueError:
        p.error(f"--kill and --stop take RANK@STEP (e.g. 5@4), got {a.kill + a.stop}")
    return a


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s full batch (inputs, targets), the same on every rank in any mesh."""
    x = np.random.default_rng(1 + step).standard_normal((BATCH, D_IN))
    teacher = np.random.default_rng(1000).standard_normal((D_IN, D_OUT))
    return x, np.tanh(x @ teacher)


def train_step(mesh, w: np.ndarray, step: int) -> float:
    """One SGD step on this rank's rows of W and its "dp" row's share of the batch."""
    dp, dp_size, tp = mesh.get_local_rank("dp"), mesh.size("dp"), mesh.get_local_rank("tp")
    x, target = (np.array_split(t, dp_size)[dp] for t in batch(step))
    cols = np.array_split(np.arange(D_IN), TP)[tp]
    y = x[:, cols] @ w
    dist.all_reduce(y, group=mesh.get_group("tp"))
    err = y - target
    grad = x[:, cols].T @ err * (2.0 / (BATCH * D_OUT))  # this row's share of the batch mean
    loss = np.array([(err ** 2).sum() / (BATCH * D_OUT)])
    for t in (grad, loss):
        dist.all_reduce(t, group=mesh.get_group("dp"))
    w -= LR * grad
    return float(loss[0])


def reference(steps: int) -> np.ndarray:
    """The same training in one process."""
    w = np.zeros((D_IN, D_OUT))
    for step in range(steps):
        x, target = batch(step)
        w -= LR * x.T @ (x @ w - target) * (2.0 / (BATCH * D_OUT))
    return w


def roll_back(mesh, state: list[np.ndarray], before: list[np.ndarray]) -> None:
    """After a recovery, every member goes back to the earliest step any of them is at (a
    rank may have finished the step in which the others failed)."""
    step = state[1].copy()
    for dim in ("dp", "tp"):
        dist.all_reduce(step, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    if step[0] < state[1][0]:
        for now, then in zip(state, before, strict=True):
            now[...] = then


def check(mesh, w: np.ndarray, steps: int) -> float:
    """The largest difference from one process's weights, agreed over the mesh."""
    tp = mesh.get_local_rank("tp")
    full = np.zeros((D_IN, D_OUT))
    full[np.array_split(np.arange(D_IN), TP)[tp]] = w
    dist.all_reduce(full, group=mesh.get_group("tp"))
    diff = np.array([np.abs(full - reference(steps)).max()])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=mesh.get_group("dp"))
    return float(diff[0])


def main() -> int:
    a = parse_args()
    dist.init_process_group()
    rank = dist.get_rank()
    elastic = {} if a.no_elastic else {"elastic": "dp", "elastic_min": a.min_replicas}
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"),
                            **elastic)
    # spawned, or restarted, into a running job
    replacement = bool(elastic) and rank in mesh.fresh_ranks

    def say(text: str, everyone: bool = False) -> None:
        if mesh.get_coordinate() == [0, 0] or everyone:
            print(f"{text}  t={time.time():.3f}", flush=True)

    say(f"rank {rank} pid {os.getpid()}" + (" (a replacement)" if replacement else ""),
        a.verbose)
    rows = np.array_split(np.arange(D_IN), TP)[mesh.get_local_rank("tp")]
    state = [reference(a.resume_from)[rows],  # my rows of W, the step
             np.array([a.resume_from], dtype=np.int64)]
    before = [t.copy() for t in state]
    sync, undo = replacement or bool(elastic and mesh.fresh_ranks), False
    while True:
        try:
            if sync:  # new ranks in the mesh: they take the state of a replica that trained
                sync_replicas(mesh, state)
                sync = False
            if undo:
                roll_back(mesh, state, before)
                undo = False
            if mesh.get_coordinate() is None:  # a spare: wait until its slice is back
                mesh = mesh.grow()  # MembersFinished (exit code 0) if the members end first
                sync = True
                say(f"rank {rank} is back in the mesh {mesh.shape} at epoch {mesh.epoch}",
                    a.verbose)
                continue
            step = int(state[1][0])
            if step >= a.steps:
                break
            grown = mesh.grow() if elastic else mesh
            if grown is not mesh:
                mesh, sync = grown, True
                say(f"mesh grew back to {mesh.shape} at epoch {mesh.epoch}; fresh ranks "
                    f"{mesh.fresh_ranks}")
                continue
            if not replacement and a.kills.get(rank) == step:
                say(f"rank {rank} kills itself at step {step + 1}", True)
                os.kill(os.getpid(), signal.SIGKILL)
            if not replacement and a.stops.get(rank) == step:
                say(f"rank {rank} stops itself (SIGSTOP) at step {step + 1}", True)
                os.kill(os.getpid(), signal.SIGSTOP)
            start = [t.copy() for t in state]
            time.sleep(a.step_s)
            loss = train_step(mesh, state[0], step)
            state[1] += 1
            before = start
            say(f"step {step + 1}/{a.steps}  mesh {mesh.shape} epoch {mesh.epoch}  "
                f"loss {loss:.6f}")
        except FAILURES as err:
            if not elastic:
                raise  # restart-the-world: the job ends here
            if rank in a.die_in_recovery and not replacement:
                os.kill(os.getpid(), signal.SIGKILL)
            mesh = mesh.recover(err)
            undo = mesh.get_coordinate() is not None
            recovery = mesh.last_recovery
            say(f"recovered: mesh {mesh.shape} at epoch {mesh.epoch}, lost "
                f"{list(recovery.lost_ranks) if recovery else []}")
    diff = check(mesh, state[0], a.steps)
    say(f"max abs diff vs single process: {diff:.3e} (tolerance {TOLERANCE:g})")
    ok = diff <= TOLERANCE
    say("OK: matches single-process training" if ok else "MISMATCH: differs from one process")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
