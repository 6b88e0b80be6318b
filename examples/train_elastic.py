"""Keep training when ranks die: the (2, 4) "dp" x "tp" MLP of train_dp_tp.py, elastic on "dp".

    tensorplay-run --nproc-per-node 8 --max-restarts 1 \
        examples/train_elastic.py --steps 12 --kill 5@4

Rank 5 SIGKILLs itself at step 4. The survivors agree it is lost, drop its "dp" slice (ranks
4-7) and train on (1, 4); ranks 4, 6, 7 wait as spares. tensorplay-run restarts rank 5; once it
and the spares wait, the members' next ``mesh.grow()`` returns the (2, 4) mesh and
``sync_replicas`` copies the weights to the fresh ranks along "dp". Each step's batch is the
same whatever the mesh (split over the "dp" rows there are, each row's gradient weighed by its
share of the batch), and a step that failed is done
again from the weights before it, so at the end the weights must equal a single-process run on
the same batches (within 1e-6): nothing lost, nothing counted twice. Exits 1 if they differ.
Every step prints the mesh it ran on and the wall time ``t=`` (from the member at coordinate
(0, 0)), so the time from a kill to the first step on the shrunk mesh can be read off.

Other faults, for the tests and bench/recovery.py: ``--stop RANK@STEP`` (that rank SIGSTOPs
itself: hung; tensorplay-run kills it after --node-grace-s), ``--stall RANK@STEP:SECONDS``
(it sleeps, and comes back after the others went on: a straggler of the old epoch),
``--die-in-recovery RANK`` (it SIGKILLs itself as it starts a recovery), ``--wait-full-s
SECONDS`` (after the last step, members on a shrunk mesh wait that long for it to be whole
again: a host started again joins before the end). The mesh is (WORLD_SIZE / 4, 4): three
hosts of 4 ranks train on (3, 4).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time

import torch
from mlp_problem import BATCH, LR, MESH_NAMES, MESH_SHAPE, batch, weights
from train_dp_tp import backward

import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh, sync_replicas

TOLERANCE = 1e-6
FAILURES = (dist.RankFailedError, dist.DistributedTimeoutError)


def parse_args() -> argparse.Namespace:
    """--steps N, and --kill RANK@STEP (repeatable): that rank SIGKILLs itself at that step."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="SGD steps (default 12)")
    p.add_argument("--step-s", type=float, default=1.0,
                   help="seconds each step lasts, standing in for a real model's compute, so a "
                        "restarted rank can join before the end (default 1)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                   help="that rank SIGKILLs itself as it starts that step (first run only)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="elastic_min: the fewest 'dp' replicas to go on with (default 1)")
    p.add_argument("--stop", action="append", default=[], metavar="RANK@STEP",
                   help="for tests: that rank SIGSTOPs itself as it starts that step (hung)")
    p.add_argument("--stall", action="append", default=[], metavar="RANK@STEP:SECONDS",
                   help="for tests: that rank sleeps SECONDS as it starts that step")
    p.add_argument("--die-in-recovery", type=int, action="append", default=[], metavar="RANK",
                   help="for tests: that rank SIGKILLs itself as it starts a recovery")
    p.add_argument("--wait-full-s", type=float, default=0.0, metavar="SECONDS",
                   help="after the last step, members on a shrunk mesh keep calling grow() "
                        "(no more steps) for up to SECONDS until the mesh is whole again, so a "
                        "replacement still starting (a host started again) gets in (default 0)")
    p.add_argument("--stop-mid", action="append", default=[], metavar="RANK@STEP",
                   help="for tests: that rank SIGSTOPs itself in that step, after its 'tp' "
                        "reduction, before its 'dp' ones: the ranks outside its 'dp' group "
                        "finish the step, its 'dp' partners do not (ranks at different steps)")
    p.add_argument("--verbose", action="store_true",
                   help="every rank prints the mesh it gets at each recovery or growth")
    a = p.parse_args()
    try:
        a.kills = {int(r): int(s) for r, s in (k.split("@") for k in a.kill)}
        a.stops = {int(r): int(s) for r, s in (k.split("@") for k in a.stop)}
        a.stops_mid = {int(r): int(s) for r, s in (k.split("@") for k in a.stop_mid)}
        a.stalls = {int(r): (int(s.split(":")[0]), float(s.split(":")[1]))
                    for r, s in (k.split("@") for k in a.stall)}
    except (ValueError, IndexError):
        p.error(f"--kill, --stop and --stop-mid take RANK@STEP (e.g. 5@4), --stall "
                f"RANK@STEP:SECONDS; got {a.kill + a.stop + a.stop_mid + a.stall}")
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    return a


def train_step(mesh, w1, w2, step: int, midway=None) -> float:
    """One SGD step on this rank's shards and its "dp" row's share of the batch; in place.
    ``midway()``, if given, runs between the "tp" and the "dp" reductions (for --stop-mid)."""
    dp, dp_size = mesh.get_local_rank("dp"), mesh.size("dp")
    x, target = (t.chunk(dp_size, dim=0)[dp] for t in batch(step))
    z = x @ w1
    h = torch.relu(z)
    y = h @ w2
    dist.all_reduce(y, group=mesh.get_group("tp"))
    if midway is not None:
        midway()
    dw1, dw2 = backward(x, z, h, y, target, w2)
    loss = ((y - target) ** 2).mean().reshape(1)
    share = x.shape[0] * dp_size / BATCH  # rows split unevenly (16 over 3: 6, 6, 4) weigh
    for t in (dw1, dw2, loss):  # by their rows, so the average is the whole batch's mean
        t *= share
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
    w1 -= LR * dw1  # only once every reduction of the step went through
    w2 -= LR * dw2
    return loss.item()


def reference(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same training in one process: full weights, each step's full batch, autograd."""
    w1, w2 = (w.requires_grad_() for w in weights())
    for step in range(steps):
        x, target = batch(step)
        ((torch.relu(x @ w1) @ w2 - target) ** 2).mean().backward()
        with torch.no_grad():
            for w in (w1, w2):
                w -= LR * w.grad
                w.grad = None
    return w1.detach(), w2.detach()


def roll_back(mesh, state: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    """After a recovery: every member goes back to the earliest step any of them is at. A
    rank may have finished the step in which others failed (its reductions went through
    before the loss broke theirs): it is one step ahead, and ``before``, the state from
    before its last completed step, undoes that step. Returns whether this rank rolled back."""
    step = state[2].clone()
    for dim in MESH_NAMES:
        dist.all_reduce(step, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    if step.item() >= state[2].item():
        return False
    for now, then in zip(state, before, strict=True):
        now.copy_(then)
    return True


def stop_midway(say, rank: int, step: int) -> None:
    """--stop-mid: SIGSTOP this rank between its step's "tp" and "dp" reductions."""
    say(f"rank {rank} stops itself (SIGSTOP) in step {step + 1}", True)
    os.kill(os.getpid(), signal.SIGSTOP)


def check(mesh, w1, w2, steps: int, say) -> bool:
    """Whether this replica's weights are within TOLERANCE of one-process training; the
    worst difference is agreed over the mesh, so every rank returns the same answer."""
    tp = mesh.get_group("tp")
    w1s = [torch.empty_like(w1) for _ in range(tp.size())]
    w2s = [torch.empty_like(w2) for _ in range(tp.size())]
    dist.all_gather(w1s, w1, group=tp)
    dist.all_gather(w2s, w2, group=tp)
    ref1, ref2 = reference(steps)
    diff = torch.maximum((torch.cat(w1s, dim=1) - ref1).abs().max(),
                         (torch.cat(w2s, dim=0) - ref2).abs().max()).reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=mesh.get_group("dp"))
    say(f"max abs diff vs single process: {diff.item():.3e} (tolerance {TOLERANCE:g})")
    return bool(diff.item() <= TOLERANCE)


def full_shape() -> tuple[int, int]:
    """The mesh at full size: 4 ranks per "tp" row, as many "dp" rows as the world holds
    ((2, 4) for 8 ranks, (3, 4) for 12: three hosts of 4)."""
    tp = MESH_SHAPE[1]
    return int(os.environ.get("WORLD_SIZE", tp * MESH_SHAPE[0])) // tp, tp


def waits_for_full(mesh, a: argparse.Namespace, done_at: float) -> bool:
    """Whether a member that did every step (at ``done_at``) still waits for the mesh to grow
    back: the mesh is short of slices and --wait-full-s has not run out. Agreed over the mesh
    (one all_reduce per dim per poll), so every member stops waiting at the same poll."""
    if a.wait_full_s <= 0:
        return False
    short = torch.tensor([int(mesh.size("dp") < full_shape()[0]
                              and time.time() - done_at < a.wait_full_s)])
    for dim in MESH_NAMES:
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return bool(short.item())


def main() -> int:
    """Train through losses and restarts; exit 1 when the weights differ from one process."""
    a = parse_args()
    began = time.time()
    dist.init_process_group()
    rank, first_run = dist.get_rank(), os.environ.get("TENSORPLAY_RESTART_COUNT", "0") == "0"
    mesh = init_device_mesh("cpu", full_shape(), mesh_dim_names=MESH_NAMES, elastic="dp",
                            elastic_min=a.min_replicas)

    def say(text: str, everyone: bool = False) -> None:
        if mesh.get_coordinate() == [0, 0] or everyone:
            print(f"{text}  t={time.time():.3f}", flush=True)

    if not first_run:
        say(f"rank {rank} restarted at t={began:.3f}, joined the mesh {mesh.shape} at epoch "
            f"{mesh.epoch}", True)

    w1, w2 = weights()
    tp_size, tp = MESH_SHAPE[1], mesh.get_local_rank("tp")
    state = [w1.chunk(tp_size, dim=1)[tp].clone(), w2.chunk(tp_size, dim=0)[tp].clone(),
             torch.zeros(1, dtype=torch.int64)]  # my W1 columns, the same W2 rows, the step
    before = [t.clone() for t in state]  # the state before the last completed step
    sync, undo = bool(mesh.fresh_ranks), False
    done_at = 0.0  # when this rank had done every step (--wait-full-s counts from there)
    while True:
        try:
            if sync:  # new ranks in the mesh: they take the state of a replica that trained
                sync_replicas(mesh, state)
                sync = False
            if undo:
                if roll_back(mesh, state, before):
                    say(f"rank {rank} rolled back to step {int(state[2].item())}", a.verbose)
                undo = False
            if mesh.get_coordinate() is None:  # a spare: wait until its slice is back
                mesh = mesh.grow()  # MembersFinished (exit code 0) if the members end first
                sync = True
                say(f"rank {rank} is back in the mesh {mesh.shape} at epoch {mesh.epoch}",
                    a.verbose)
                continue
            step = int(state[2].item())
            if step >= a.steps:
                done_at = done_at or time.time()
                if not waits_for_full(mesh, a, done_at):
                    break
            grown = mesh.grow()
            if grown is not mesh:
                mesh, sync = grown, True
                say(f"rank {rank}: mesh grew back to {mesh.shape} at epoch {mesh.epoch}; fresh "
                    f"ranks {mesh.fresh_ranks}", a.verbose)
                continue
            if step >= a.steps:  # done, waiting for the mesh to be whole (--wait-full-s)
                time.sleep(0.1)
                continue
            if first_run and a.kills.get(rank) == step:
                say(f"rank {rank} kills itself at step {step + 1}", True)
                os.kill(os.getpid(), signal.SIGKILL)
            if first_run and a.stops.get(rank) == step:
                say(f"rank {rank} stops itself (SIGSTOP) at step {step + 1}", True)
                os.kill(os.getpid(), signal.SIGSTOP)
            if first_run and rank in a.stalls and a.stalls[rank][0] == step:
                say(f"rank {rank} stalls {a.stalls[rank][1]:g} s at step {step + 1}", True)
                time.sleep(a.stalls.pop(rank)[1])
            start = [t.clone() for t in state]
            time.sleep(a.step_s)
            midway = None
            if first_run and a.stops_mid.get(rank) == step:
                midway = functools.partial(stop_midway, say, rank, step)
            loss = train_step(mesh, state[0], state[1], step, midway)
            state[2] += 1
            before = start
            say(f"step {step + 1}/{a.steps}  mesh {mesh.shape} epoch {mesh.epoch}  "
                f"loss {loss:.6f}")
        except FAILURES as err:
            if rank in a.die_in_recovery:
                os.kill(os.getpid(), signal.SIGKILL)
            mesh = mesh.recover(err)
            undo = mesh.get_coordinate() is not None
            say(f"rank {rank} recovered: mesh {mesh.shape} at epoch {mesh.epoch}, ranks "
                f"{mesh.mesh.flatten().tolist()}", a.verbose)
    ok = check(mesh, state[0], state[1], a.steps, say)
    say("OK: matches single-process training" if ok else "MISMATCH: differs from one process")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
