"""Mesh set-up time and collective overhead on 8 real gloo ranks: tensorplay vs PyTorch.

    /work/venv/bin/python bench/mesh_init.py                 # ~1-2 minutes on 2 cores
    /work/venv/bin/python bench/mesh_init.py --repeats 3 --iters 10

(a) Set-up: from the start of init_process_group to a (2, 4) mesh ("dp", "tp") with every
    group ready and a barrier passed. Ours: tensorplay's init_process_group + init_device_mesh;
    PyTorch: torch.distributed's init_process_group + torch.distributed.device_mesh's
    init_device_mesh. Both connect over tcp://127.0.0.1 (a fresh port per repeat), and both
    run one 4-byte all_reduce on each dim group before the barrier, so lazily made groups are
    made inside the timed span. Each implementation runs in its own set of 8 processes; each
    set runs one warm-up cycle (imports, first connections) and then --repeats cycles of
    init -> mesh -> destroy. Every rank starts a cycle at the same agreed wall-clock instant,
    so one repeat = (last rank's end) - (common start): the max over ranks. Sets run as
    ours, torch (--rounds 2: ours, torch, torch, ours, so load drift hits both alike; each
    set costs 8 torch imports, the bulk of the run's time on 2 cores).
(b) Collectives: in the first tensorplay set, all_reduce (SUM, float32 zeros) along "dp"
    (groups of 2) and "tp" (groups of 4) at 4 B, 1 MiB and 16 MiB: ours
    (tensorplay.distributed.all_reduce(t, group=mesh.get_group(d))) against a direct
    torch.distributed.all_reduce(t, group=mesh.get_group(d).engine_group) on the same ranks.
    Calls are interleaved (order alternating per iteration), each after a world barrier that is
    not timed; per iteration the max over ranks, then the median over iterations.

Processes are started by the project's tests/spawn.py (``run(fn, n, init=False)``): spawn
start method, a deadline on every wait, every child killed on the way out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.spawn import free_port, run  # noqa: E402

WORLD = 8
SHAPE = (2, 4)
NAMES = ("dp", "tp")
SIZES_B = (4, 1 << 20, 16 << 20)
START_MARGIN_S = 0.6  # time between agreeing on the next start and that start
LATE_S = 0.005  # a rank that starts a cycle later than this after the common start is "late"


# -- what runs on each rank ---------------------------------------------------------------------
class _Ours:
    """tensorplay's entry points."""

    def __init__(self):
        import tensorplay.distributed as tdist
        from tensorplay.distributed.device_mesh import init_device_mesh

        self.dist, self.init_device_mesh = tdist, init_device_mesh

    def init(self, rank: int, port: int) -> None:
        self.dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                     world_size=WORLD, timeout=60)

    def mesh(self):
        return self.init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)

    def all_reduce(self, tensor, mesh, dim: str) -> None:
        self.dist.all_reduce(tensor, group=mesh.get_group(dim))

    def broadcast(self, tensor) -> None:
        self.dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        self.dist.barrier()

    def destroy(self) -> None:
        self.dist.destroy_process_group()


class _Torch:
    """PyTorch's entry points."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.dist, self.init_device_mesh = dist, init_device_mesh

    def init(self, rank: int, port: int) -> None:
        from datetime import timedelta

        self.dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                     world_size=WORLD, timeout=timedelta(seconds=60))

    def mesh(self):
        return self.init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)

    def all_reduce(self, tensor, mesh, dim: str) -> None:
        self.dist.all_reduce(tensor, group=mesh.get_group(dim))

    def broadcast(self, tensor) -> None:
        self.dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        self.dist.barrier()

    def destroy(self) -> None:
        self.dist.destroy_process_group()


def _sleep_until(instant: float) -> None:
    while (left := instant - time.time()) > 0:
        time.sleep(min(left, 0.05))


def rank_main(rank: int, impl: str, ports: list[int], collect: dict | None) -> dict:
    """One rank of a process set: set-up cycles, then (optionally) the collective timings.

    Returns {"setup": [(start, began, ready), ...], "coll": {(dim, bytes, kind): [s, ...]}}
    with wall-clock instants (time.time(), one clock for every process of this machine).
    """
    entered = time.time()
    import torch

    api = _Ours() if impl == "ours" else _Torch()
    out: dict = {"setup": [], "coll": {}, "phases": {"entered": entered, "imported": time.time()}}
    start = None
    mesh = None
    for cycle, port in enumerate(ports):
        if start is not None:
            _sleep_until(start)
        began = time.time()
        api.init(rank, port)
        mesh = api.mesh()
        for dim in NAMES:
            api.all_reduce(torch.zeros(1), mesh, dim)
        api.barrier()
        ready = time.time()
        out["setup"].append((start if start is not None else began, began, ready))
        if cycle == len(ports) - 1:
            break
        instant = torch.tensor([time.time() + START_MARGIN_S], dtype=torch.float64)
        api.broadcast(instant)  # rank 0's value: the common start of the next cycle
        start = float(instant.item())
        api.destroy()
        mesh = None
    out["phases"]["cycles"] = time.time()
    if collect is not None:
        out["coll"] = _collectives(mesh, collect)
    out["phases"]["collectives"] = time.time()
    api.destroy()
    out["phases"]["destroyed"] = time.time()
    return out


def _collectives(mesh, plan: dict) -> dict:
    """Interleaved ours/direct all_reduce timings along each dim, per size."""
    import torch
    import torch.distributed as dist

    import tensorplay.distributed as tdist

    times: dict = {}
    for dim in NAMES:
        group = mesh.get_group(dim)
        engine = group.engine_group
        calls = {
            "ours": lambda t, g=group: tdist.all_reduce(t, group=g),
            "direct": lambda t, e=engine: dist.all_reduce(t, group=e),
        }
        for nbytes in SIZES_B:
            tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
            warm, iters = plan["warm"], plan["iters"] if nbytes <= 1 << 20 else plan["big_iters"]
            for kind in calls:
                times[dim, nbytes, kind] = []
            for i in range(warm + iters):
                order = ("ours", "direct") if i % 2 == 0 else ("direct", "ours")
                for kind in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    calls[kind](tensor)
                    elapsed = time.perf_counter() - t0
                    if i >= warm:
                        times[dim, nbytes, kind].append(elapsed)
    return times


# -- the parent ----------------------------------------------------------------------------------
def process_set(impl: str, repeats: int, collect: dict | None, timeout: float) -> list[dict]:
    ports = [free_port() for _ in range(repeats + 1)]
    return run(rank_main, WORLD, impl, ports, collect, init=False, timeout=timeout)


def setup_times(per_rank: list[dict]) -> list[float]:
    """Per timed cycle (warm-up dropped): last rank ready - common start."""
    cycles = len(per_rank[0]["setup"])
    return [max(r["setup"][c][2] for r in per_rank) - per_rank[0]["setup"][c][0]
            for c in range(1, cycles)]


def late_starts(per_rank: list[dict]) -> float:
    """Largest delay, over ranks and timed cycles, between the common start and a rank's start."""
    return max(r["setup"][c][1] - r["setup"][c][0]
               for r in per_rank for c in range(1, len(r["setup"])))


def wrapper_cost(calls: int = 20000) -> float:
    """Seconds per tensorplay all_reduce call spent before the engine (fake world, 1 float)."""
    import torch

    import tensorplay.distributed as tdist

    tdist.init_process_group("fake", rank=0, world_size=WORLD)
    try:
        tensor = torch.zeros(1)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                tdist.all_reduce(tensor)
            samples.append((time.perf_counter() - t0) / (calls // 5))
        return statistics.median(samples)
    finally:
        tdist.destroy_process_group()


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_size(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes >> 20} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed set-up cycles per set")
    parser.add_argument("--rounds", type=int, default=1,
                        help="process-set rounds: ours,torch, then torch,ours, ...")
    parser.add_argument("--iters", type=int, default=20, help="timed calls, 4 B and 1 MiB")
    parser.add_argument("--big-iters", type=int, default=6, help="timed calls, 16 MiB")
    parser.add_argument("--warm", type=int, default=2, help="untimed warm-up calls per size")
    parser.add_argument("--timeout", type=float, default=150.0, help="per process set, s")
    opts = parser.parse_args()
    wall = time.perf_counter()
    print(f"mesh_init: {WORLD} gloo ranks on {os.cpu_count()} CPUs (loopback), mesh {SHAPE} "
          f"{NAMES}", file=sys.stderr)

    plan = {"warm": opts.warm, "iters": opts.iters, "big_iters": opts.big_iters}
    order: list[str] = []
    for r in range(opts.rounds):
        order += ["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]
    setup: dict[str, list[float]] = {"ours": [], "torch": []}
    late = 0.0
    coll = None
    for impl in order:
        t0 = time.perf_counter()
        t0_wall = time.time()
        collect = plan if impl == "ours" and coll is None else None
        per_rank = process_set(impl, opts.repeats, collect, opts.timeout)
        phases = {k: max(r["phases"][k] for r in per_rank) for k in per_rank[0]["phases"]}
        marks = [("spawn+start", t0_wall, phases["entered"])] + [
            (b, phases[a], phases[b]) for a, b in itertools.pairwise(phases)
        ] + [("exit", phases["destroyed"], time.time())]
        print("   " + ", ".join(f"{k} {end - begin:.1f} s" for k, begin, end in marks),
              file=sys.stderr)
        setup[impl] += setup_times(per_rank)
        late = max(late, late_starts(per_rank))
        if collect is not None:
            coll = [r["coll"] for r in per_rank]
        print(f"  {impl} set done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    ours, torch_ = statistics.median(setup["ours"]), statistics.median(setup["torch"])
    print(f"\n### (a) Set-up: init_process_group -> (2, 4) mesh, every group used once, barrier "
          f"({WORLD} gloo ranks)\n")
    print("| implementation | median | min | max | repeats |")
    print("|---|---:|---:|---:|---:|")
    for name, key in (("tensorplay", "ours"), ("PyTorch", "torch")):
        values = setup[key]
        print(f"| {name} | {fmt_time(statistics.median(values))} | {fmt_time(min(values))} | "
              f"{fmt_time(max(values))} | {len(values)} |")
    print(f"\nours/PyTorch (median): {ours / torch_:.2f}. One repeat = last rank ready - common "
          f"start (max over ranks); the latest any rank began a cycle after the common start: "
          f"{fmt_time(late)}.")

    print(f"\n### (b) all_reduce along each mesh dim: ours vs direct torch.distributed on the "
          f"same group ({WORLD} gloo ranks)\n")
    print("| dim (group size) | size | ours | direct | ours/direct | paired Δ | iters |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for dim, size in zip(NAMES, SHAPE, strict=True):
        for nbytes in SIZES_B:
            per_iter = {
                kind: [max(r[dim, nbytes, kind][i] for r in coll)
                       for i in range(len(coll[0][dim, nbytes, kind]))]
                for kind in ("ours", "direct")
            }
            o, d = statistics.median(per_iter["ours"]), statistics.median(per_iter["direct"])
            delta = statistics.median(a - b for a, b in zip(per_iter["ours"], per_iter["direct"],
                                                            strict=True))
            worst = max(worst, o / d)
            sign = "+" if delta >= 0 else "-"
            print(f"| {dim} ({size}) | {fmt_size(nbytes)} | {fmt_time(o)} | {fmt_time(d)} | "
                  f"{o / d:.3f} | {sign}{fmt_time(abs(delta))} | {len(per_iter['ours'])} |")
    print("\nper iteration: max over the 8 ranks of one call's wall time (after an untimed "
          "barrier); shown: median over iterations; paired Δ: median of (ours - direct) per "
          "iteration.")

    guard = wrapper_cost()
    print(f"\nour all_reduce's own Python cost (argument checks and dispatch, measured in a "
          f"fake world where nothing moves): {fmt_time(guard)} per call.")

    setup_ok = ours <= torch_
    coll_ok = worst <= 1.05
    print("\nGoal: mesh set-up no slower than PyTorch's; collectives within 5% of the direct "
          "call.")
    print(f"  set-up: ours {fmt_time(ours)} vs PyTorch {fmt_time(torch_)} "
          f"[{'ok' if setup_ok else 'MISSED'}]")
    print(f"  collectives: worst ours/direct {worst:.3f} <= 1.05 [{'ok' if coll_ok else 'MISSED'}]")
    print(f"Goal met: {'YES' if setup_ok and coll_ok else 'NO'}")
    print(f"\nwall time of this run: {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
