"""The jobs that tests/distributed/backends/test_mpi.py runs under mpiexec, one per scenario.

    mpiexec -n 4 python tests/distributed/backends/mpi_jobs.py collectives

Each rank appends its results as JSON lines to ``$RESULT_DIR/rank<r>.jsonl`` for the test to
read (mpiexec may interleave the ranks' output); a scenario that injects a failure lets its
ranks' errors reach the output. numpy only: torch is used when importable
(the "collectives" scenario also moves torch tensors), and "no_torch" makes it unimportable.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np


def block_torch() -> None:
    """Make ``import torch`` fail, as in an environment without torch."""

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoTorch())


if sys.argv[1] == "no_torch":
    block_torch()

import tensorplay.distributed as dist  # noqa: E402
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402


def report(value: object, rank: int | None = None) -> None:
    rank = dist.get_rank() if rank is None else rank
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(value) + "\n")


def collectives(use_torch: bool) -> dict:
    """Every collective on the world and along each dim of a (2, n/2) mesh; plain data back."""
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    out: dict[str, object] = {"backend": dist.get_backend(), "coord": mesh.get_coordinate(),
                              "tp": tp.ranks, "dp": dp.ranks,
                              "mesh_type": type(mesh.mesh).__name__}
    a = np.full(3, float(r))
    dist.all_reduce(a, group=tp)
    out["tp_sum"] = a.tolist()
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        x = np.array([r + 1.0, -r])
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        out[f"world_{op}"] = x.tolist()
    flags = np.array([r == 1, True])
    dist.all_reduce(flags)
    out["bool_sum"] = flags.tolist()
    w = dist.all_reduce(np.full(2, float(r)), group=dp, async_op=True)
    w.wait()
    b = np.full(2, float(r))
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = b.tolist()
    red = np.full(2, float(r))
    dist.reduce(red, dst=1, op=dist.ReduceOp.MAX)
    out["reduce"] = red.tolist()
    parts = [np.zeros(2, dtype=np.int64) for _ in range(n)]
    dist.all_gather(parts, np.array([r, 10 * r]))
    out["all_gather"] = [p.tolist() for p in parts]
    into = np.zeros((n // 2, 2), dtype=np.int32)
    dist.all_gather_into_tensor(into, np.array([r, r], dtype=np.int32), group=tp)
    out["all_gather_into_tensor"] = into.tolist()
    rs = np.zeros(1)
    dist.reduce_scatter_tensor(rs, np.arange(n, dtype=np.float64) * (r + 1))
    out["reduce_scatter"] = rs.tolist()
    a2a = np.zeros(n, dtype=np.int64)
    dist.all_to_all_single(a2a, np.arange(n) + 100 * r)
    out["all_to_all"] = a2a.tolist()
    got = [np.zeros(1) for _ in range(n)] if r == 0 else None
    dist.gather(np.array([r * 2.0]), got, dst=0)
    out["gather"] = None if got is None else [g.tolist() for g in got]
    sc = np.zeros(2)
    dist.scatter(sc, [np.full(2, i * 3.0) for i in range(n)] if r == 2 else None, src=2)
    out["scatter"] = sc.tolist()
    column = np.zeros((3, 2))  # a non-contiguous column, received in place
    if r == 0:
        dist.send(np.array([7.0, 8.0, 9.0]), dst=1)
    elif r == 1:
        dist.recv(column[:, 1], src=0)
    out["recv_column"] = column.tolist()
    dist.barrier()
    out["shift_tp"] = list(mesh.shift("tp", 1, periodic=True))
    flat = mesh.flatten("dp_tp")
    z = np.ones(1)
    dist.all_reduce(z, group=flat.get_group())
    out["flat_sum"] = z.tolist()
    if use_torch:
        import torch

        t = torch.full((2, 2), float(r))
        dist.all_reduce(t, group=tp)
        out["torch_tp_sum"] = t.tolist()
        tt = torch.zeros(4, 2).t()  # non-contiguous tensor, broadcast into
        dist.broadcast(tt, src=0) if r else dist.broadcast(torch.ones(2, 4), src=0)
        out["torch_broadcast"] = tt.sum().item()
        bf = torch.full((2,), float(r), dtype=torch.bfloat16)
        dist.broadcast(bf, src=1)  # moved as bytes: exact
        out["torch_bf16_broadcast"] = bf.float().tolist()
        try:
            dist.all_reduce(bf)
            out["bf16_reduce"] = "no error"
        except dist.ArgumentError as err:
            out["bf16_reduce"] = str(err)
    return out


def main() -> None:
    scenario = sys.argv[1]
    timeout = float(os.environ.get("JOB_TIMEOUT", "30"))
    if scenario == "adopt":
        from mpi4py import MPI  # the user's own MPI start, before ours

        rank = MPI.COMM_WORLD.Get_rank()
        mine = MPI.COMM_WORLD.Split(0, -rank)  # the user's own communicator, ranks reversed
        dist.init_process_group(timeout=timeout)  # adopts it
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        x = np.ones(1)
        dist.all_reduce(x, group=mesh.get_group())
        wrapped = DeviceMesh.from_group(mine, "cpu")  # a mesh over the user's communicator
        y = np.full(1, float(rank))
        dist.all_reduce(y, group=wrapped.get_group())
        dist.destroy_process_group()
        after = MPI.COMM_WORLD.allreduce(1)  # the user's MPI still works after our destroy
        report([x.tolist(), after, wrapped.mesh.tolist(), y.tolist()], rank)
        return
    dist.init_process_group(timeout=timeout)  # no backend: the MPI engine under mpiexec
    r, n = dist.get_rank(), dist.get_world_size()
    if scenario in ("collectives", "no_torch"):
        use_torch = scenario == "collectives" and "--no-torch" not in sys.argv
        result = collectives(use_torch)
        result["torch_loaded"] = "torch" in sys.modules
        report(result)
    elif scenario == "mismatch":
        try:
            init_device_mesh("cpu", (2, n // 2) if r != 1 else (n, 1))
            report("no error")
        except dist.MeshMismatchError as err:
            report(str(err))
        x = np.ones(1)
        dist.all_reduce(x)  # the world still works
        report(x.tolist())
    elif scenario in ("raise", "exit", "kill", "hang", "stray", "absent"):
        x = np.ones(4)
        dist.all_reduce(x)
        if r == 2:
            if scenario == "raise":
                raise RuntimeError("rank 2 fails on purpose")
            if scenario == "exit":
                sys.exit(3)
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario == "hang":
                time.sleep(600)
            if scenario == "stray":
                dist.all_reduce(x)  # one call more than the others
        if scenario == "absent" and r == n - 1:
            time.sleep(600)  # never calls new_group
        if scenario == "absent" and r in (0, 2):
            dist.new_group([0, 2, n - 1])  # rank 0 waits for ranks 2 and n - 1 to come
        dist.all_reduce(x)
    elif scenario == "strict":  # TENSORPLAY_STRICT=1: rank 2 broadcasts, the others reduce
        x = np.ones(2)
        try:
            dist.broadcast(x, src=0) if r == 2 else dist.all_reduce(x)
            report("no error")
        except dist.CallMismatchError as err:
            report(str(err))
    elif scenario == "elastic":  # an MPI without ULFM: refused, before anything is made
        try:
            init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"), elastic="dp")
            report("no error")
        except dist.ArgumentError as err:
            report(str(err))
        x = np.ones(1)
        dist.all_reduce(x)  # the world still works
        report(x.tolist())
    elif scenario == "late" and r == 0:
        time.sleep(3)  # finishes its script 3 s after the others, with no collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
