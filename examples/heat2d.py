"""Solve the 2-d heat equation (Jacobi) on a grid split over a (2, 4) mesh, in numpy only.

Run it with 8 processes, on the MPI engine or on gloo; the script is the same:

    mpiexec -n 8 python examples/heat2d.py                 # MPI engine (mpi4py, mpich)
    tensorplay-run --nproc-per-node 8 examples/heat2d.py   # gloo engine (torch)

Where torch is not installed, tensorplay-run runs the mpiexec line above and says so.

The grid of ROWS x COLS points holds the temperature u; its edges are fixed (the top edge at
1, the others at 0) and each step replaces every inner point by the mean of its 4 neighbours.
The inner points are split over the mesh: mesh dim "y" (2) splits the rows and "x" (4) the
columns, so the rank at (y, x) holds a block of (ROWS-2)/2 x (COLS-2)/4 points plus a one-point
halo on each side. Before each step every rank swaps its edge rows and columns with its
neighbours, found with ``mesh.shift`` (MPI's Cart_shift): ``source, dest = mesh.shift("y")``
gives the rank above and the rank below (None at the grid's edge).

Rank 0 gathers the blocks at the end and compares them with the same solver run in one
process; the job exits 1 on every rank when the largest difference is above 1e-12.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

MESH_SHAPE, MESH_NAMES = (2, 4), ("y", "x")
ROWS, COLS = 66, 130  # with the fixed edges: 64 x 128 inner points, 32 x 32 per rank
TOLERANCE = 1e-12


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="Jacobi steps (default 200)")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    return a


def initial_grid() -> np.ndarray:
    """The whole grid at step 0: the top edge at 1, everything else at 0."""
    u = np.zeros((ROWS, COLS))
    u[0, :] = 1.0
    return u


def jacobi_step(u: np.ndarray) -> np.ndarray:
    """One step on a block with its halo (or the whole grid): new inner points, same edges."""
    new = u.copy()
    new[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
    return new


def reference(steps: int) -> np.ndarray:
    """The same solver in one process."""
    u = initial_grid()
    for _ in range(steps):
        u = jacobi_step(u)
    return u


def swap(send_lo, recv_lo, send_hi, recv_hi, lo, hi, first: bool) -> None:
    """Send ``send_hi`` to ``hi`` and ``send_lo`` to ``lo``, receiving the halos from them.

    Blocking sends must meet a receive: ranks at even coordinates along the dim send first,
    odd ones receive first, so every pair meets whatever the engine buffers.
    """
    pairs = [(send_hi, hi, recv_lo, lo), (send_lo, lo, recv_hi, hi)]
    for out, to, into, frm in pairs:
        if first:
            if to is not None:
                dist.send(np.ascontiguousarray(out), to)
            if frm is not None:
                dist.recv(into, frm)
        else:
            if frm is not None:
                dist.recv(into, frm)
            if to is not None:
                dist.send(np.ascontiguousarray(out), to)


def exchange_halos(u: np.ndarray, mesh) -> None:
    """Fill the halo rows from the ranks above and below, then the halo columns from the
    ranks left and right (a grid edge keeps its fixed values)."""
    y, x = mesh.get_coordinate()
    up, down = mesh.shift("y")  # receive from the rank above, send to the rank below
    swap(u[1], u[0], u[-2], u[-1], up, down, first=y % 2 == 0)
    left, right = mesh.shift("x")
    swap(u[:, 1], u[:, 0], u[:, -2], u[:, -1], left, right, first=x % 2 == 0)


def local_block(mesh) -> np.ndarray:
    """This rank's inner points with a one-point halo, cut from the initial grid."""
    y, x = mesh.get_coordinate()
    rows, cols = (ROWS - 2) // MESH_SHAPE[0], (COLS - 2) // MESH_SHAPE[1]
    return initial_grid()[y * rows: (y + 1) * rows + 2, x * cols: (x + 1) * cols + 2].copy()


def assemble(blocks: list[np.ndarray], mesh) -> np.ndarray:
    """The whole grid from every rank's inner points (indexed by global rank)."""
    u = initial_grid()
    rows, cols = (ROWS - 2) // MESH_SHAPE[0], (COLS - 2) // MESH_SHAPE[1]
    for (y, x), rank in np.ndenumerate(np.asarray(mesh.mesh)):
        u[1 + y * rows: 1 + (y + 1) * rows, 1 + x * cols: 1 + (x + 1) * cols] = \
            blocks[rank].reshape(rows, cols)
    return u


def main() -> int:
    a = parse_args()
    dist.init_process_group()  # mpi under mpiexec, gloo under tensorplay-run or torchrun
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_NAMES)
    rank = dist.get_rank()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    say(f"{mesh} on the {dist.get_backend()} backend; {ROWS - 2} x {COLS - 2} inner points")
    u = local_block(mesh)
    change = np.zeros(1)
    for step in range(a.steps):
        exchange_halos(u, mesh)
        new = jacobi_step(u)
        if (step + 1) % 50 == 0 or step + 1 == a.steps:
            change[0] = np.abs(new - u).max()
            dist.all_reduce(change, op=dist.ReduceOp.MAX)  # the largest change anywhere
            say(f"step {step + 1}/{a.steps}  largest change {change[0]:.3e}")
        u = new
    inner = np.ascontiguousarray(u[1:-1, 1:-1]).reshape(-1)
    blocks = [np.empty_like(inner) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(inner, blocks, dst=0)
    worst = np.zeros(1)
    if rank == 0:
        worst[0] = np.abs(assemble(blocks, mesh) - reference(a.steps)).max()
        say(f"max abs diff vs one process: {worst[0]:.3e} (tolerance {TOLERANCE:g})")
        say("OK: matches the one-process solver" if worst[0] <= TOLERANCE else
            "MISMATCH: the distributed solution differs from the one-process solver")
    dist.broadcast(worst, src=0)  # every rank learns rank 0's verdict
    dist.destroy_process_group()
    return 0 if worst[0] <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
