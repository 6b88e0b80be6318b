"""torchtitan's five views of one world: communicators per rank and set-up time, ours vs PyTorch.

    python bench/views.py                 # (a) 128 simulated ranks, (b) 8 gloo ranks
    python bench/views.py --skip-gloo     # (a) only

(a) The world (pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=4) = 128 ranks, cut five ways as
torchtitan's ``ParallelDims.build_mesh()`` cuts it: data (pp, batch, cp, tp), FSDP (pp,
dp_replicate, dp_shard, cp, tp), dense (pp, dp_replicate, fsdp, tp), expert (pp, dp_replicate,
efsdp, ep; ep = 8 carved from dp_shard x cp x tp) and loss (batch x cp, flattened). PyTorch
builds them as torchtitan does, a 1-d ("world",) mesh ``_unflatten``-ed into each view, on its
"fake" backend (FakeStore); ours ``reshape``s the same 1-d mesh in our "fake" world. For each
of several ranks, in this one process: the communicators the rank holds once the views exist,
after one collective on every dim of every view (ours makes a view's groups at first use), the
``new_group`` calls PyTorch made, and the set-up time (median over the ranks). Ours is also run
with ``eager_groups=True`` (every group made with its view).

(b) examples/train_moe.py under ``tensorplay-run --nproc-per-node 8`` (gloo, this machine): the
communicators rank 0 holds after the first step and the time from joining to the end of that
step, by default and with TENSORPLAY_EAGER_GROUPS=1; PyTorch's count for the same two views
(dense (2, 4) and its expert (2, 2, 2) ``_unflatten``) comes from its fake backend.

Goal (issue 21): ours makes one communicator per distinct layout that is used, PyTorch one per
dim per view.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import _common
from _common import fmt_time
from _results import add_out, recorded

WORLD = 128
VIEWS = {  # name: (shape, dim names); "loss" is data's ("batch", "cp") flattened
    "data": ((2, 8, 2, 4), ("pp", "batch", "cp", "tp")),
    "fsdp": ((2, 2, 4, 2, 4), ("pp", "dp_replicate", "dp_shard", "cp", "tp")),
    "dense": ((2, 2, 8, 4), ("pp", "dp_replicate", "fsdp", "tp")),
    "expert": ((2, 2, 4, 8), ("pp", "dp_replicate", "efsdp", "ep")),
}
DIMS = sum(len(names) for _, names in VIEWS.values()) + 1  # + loss: 18
RANKS = (0, 5, 37, 77, 127)


def distinct_layouts(rank: int) -> int:
    """The reference: distinct ordered rank lists of every view dim through ``rank``, without
    the world's (numpy's reshape of arange(128))."""
    import numpy as np

    array = np.arange(WORLD)
    lines = set()
    for shape, _ in VIEWS.values():
        grid = array.reshape(shape)
        coord = np.argwhere(grid == rank)[0]
        for d in range(len(shape)):
            index = tuple(slice(None) if e == d else int(c) for e, c in enumerate(coord))
            lines.add(tuple(grid[index].tolist()))
    data = array.reshape(VIEWS["data"][0])
    pp, _, _, tp = (int(c) for c in np.argwhere(data == rank)[0])
    lines.add(tuple(data[pp, :, :, tp].reshape(-1).tolist()))  # loss = batch x cp
    return len(lines - {tuple(range(WORLD))})


def ours(rank: int, eager: bool | None) -> dict:
    import numpy as np

    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.world import current_world

    dist.init_process_group("fake", rank=rank, world_size=WORLD)
    try:
        world = current_world("bench")
        start = time.perf_counter()
        root = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",),
                                eager_groups=eager)
        views = {name: root.reshape(shape, names) for name, (shape, names) in VIEWS.items()}
        loss = views["data"]["batch", "cp"].flatten("loss")
        setup_s = time.perf_counter() - start
        at_setup = world.registry.created
        groups = [v.get_group(n) for v in views.values() for n in v.mesh_dim_names or ()]
        groups.append(loss.get_group())
        for group in groups:  # one collective on every dim of every view
            dist.all_reduce(np.zeros(1), group=group)
        by_ranks = {}
        for group in groups:  # coinciding layouts: one object
            assert by_ranks.setdefault(tuple(group.ranks), group) is group
        return {"setup_s": setup_s, "at_setup": at_setup, "used": world.registry.created,
                "objects": len({id(g) for g in groups if g is not world.default_group})}
    finally:
        dist.destroy_process_group()


def theirs(rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls = [0]
    made = device_mesh.new_group

    def counted(*args, **kwargs):
        calls[0] += 1
        return made(*args, **kwargs)

    device_mesh.new_group = counted  # what _unflatten calls, once per group of each new dim
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        start = time.perf_counter()
        root = device_mesh.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
        views = {name: root._unflatten(0, shape, names)
                 for name, (shape, names) in VIEWS.items()}
        loss = views["data"]["batch", "cp"]._flatten("loss")
        setup_s = time.perf_counter() - start
        groups = [v.get_group(n) for v in views.values() for n in v.mesh_dim_names or ()]
        groups.append(loss.get_group())
        return {"setup_s": setup_s, "held": len(c10d._world.pg_map) - 1, "calls": calls[0],
                "objects": len({id(g) for g in groups})}
    finally:
        device_mesh.new_group = made
        dist.destroy_process_group()


def theirs_moe() -> int:
    """PyTorch's groups per rank for train_moe.py's two views of 8 ranks (fake backend)."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        root = device_mesh.init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        root._unflatten(0, (2, 4), ("dp_replicate", "dp_shard"))
        root._unflatten(0, (2, 2, 2), ("dp_replicate", "efsdp", "ep"))
        return len(c10d._world.pg_map) - 1
    finally:
        dist.destroy_process_group()


def simulated() -> None:
    ours(1, None), ours(1, True), theirs(1)  # warm-up: imports and first calls, not measured
    rows = []
    for rank in RANKS:
        lazy, eager, torch = ours(rank, None), ours(rank, True), theirs(rank)
        rows.append((rank, lazy, eager, torch, distinct_layouts(rank)))
    print(f"## (a) torchtitan's five views, {WORLD} simulated ranks ({DIMS} view dims)\n")
    print("| rank | ours: made at set-up | ours: after one collective per dim | "
          "ours eager: made at set-up | distinct layouts (numpy) | PyTorch: groups held | "
          "PyTorch: new_group calls |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rank, lazy, eager, torch, distinct in rows:
        print(f"| {rank} | {lazy['at_setup']} | {lazy['used']} | {eager['at_setup']} | "
              f"{distinct} | {torch['held']} | {torch['calls']} |")
    print()
    median = {k: statistics.median(r[i]["setup_s"] for r in rows)
              for k, i in (("ours", 1), ("eager", 2), ("torch", 3))}
    print("| set-up of the five views (median over the ranks above) | time |")
    print("|---|---:|")
    print(f"| ours (views' groups at first use) | {fmt_time(median['ours'])} |")
    print(f"| ours, eager_groups=True | {fmt_time(median['eager'])} |")
    print(f"| PyTorch `_unflatten` on its fake backend | {fmt_time(median['torch'])} |")
    print()
    global RESULT
    RESULT = rows


RESULT: list = []
LINE = re.compile(r"communicators of rank 0 \((\d+) made in this world\)")
FIRST = re.compile(r"first step done ([\d.]+) s after")


def moe_run(eager: bool) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=_common.pythonpath())
    env.pop("TENSORPLAY_EAGER_GROUPS", None)
    if eager:
        env["TENSORPLAY_EAGER_GROUPS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "tensorplay.distributed.run", "--nproc-per-node", "8",
         os.path.join(_common.ROOT, "examples", "train_moe.py")],
        capture_output=True, text=True, env=env, timeout=600, cwd=_common.ROOT)
    made, first = LINE.search(done.stdout), FIRST.search(done.stdout)
    if done.returncode != 0 or made is None or first is None:
        raise SystemExit(f"train_moe.py failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"\n{done.stderr[-2000:]}")
    return int(made.group(1)) - 1, float(first.group(1))  # without the world's


def gloo(repeat: int) -> None:
    runs = {eager: [moe_run(eager) for _ in range(repeat)] for eager in (False, True)}
    torch_held = theirs_moe()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print("## (b) examples/train_moe.py, 8 gloo ranks (dense (2, 4), expert (2, 2, 2))\n")
    print(f"| run | communicators rank 0 holds after step 1 (world not counted) | "
          f"join to end of step 1 (median of {repeat}) |")
    print("|---|---:|---:|")
    for eager, label in ((False, "ours (views' groups at first use)"),
                         (True, "ours, TENSORPLAY_EAGER_GROUPS=1")):
        counts = {c for c, _ in runs[eager]}
        times = statistics.median(t for _, t in runs[eager])
        print(f"| {label} | {', '.join(map(str, sorted(counts)))} | {times:.2f} s |")
    print(f"| PyTorch, the same views by `_unflatten` (fake backend, count only) | "
          f"{torch_held} | - |")
    print(f"\nload average after the runs: {load} (1, 5, 15 min) on {os.cpu_count()} cores\n")


def goal() -> None:
    ok = all(lazy["used"] == distinct and lazy["at_setup"] == 0 and torch["held"] == DIMS
             for _, lazy, _, torch, distinct in RESULT)
    worst = max(lazy["used"] for _, lazy, _, _, _ in RESULT)
    print("Goal: ours makes only the distinct layouts that are used; PyTorch makes one per "
          "dim per view.")
    print(f"  ours: 0 communicators when the views are made, {worst} after a collective on "
          f"every dim (= the distinct layouts numpy finds); PyTorch: {DIMS} per rank "
          f"(one per dim per view).")
    print(f"Goal met: {'yes' if ok else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-gloo", action="store_true", help="only the simulated world")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the example per mode")
    add_out(parser, __file__)
    opts = parser.parse_args()
    with recorded(__file__, opts.out):
        simulated()
        if not opts.skip_gloo:
            gloo(opts.repeat)
        goal()


if __name__ == "__main__":
    main()
