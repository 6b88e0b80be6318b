"""Per-rank cost of building a DeviceMesh and using it, from 64 to 1,048,576 ranks.

    /work/venv/bin/python bench/mesh_scale.py            # full run (minutes: PyTorch's big rows)
    /work/venv/bin/python bench/mesh_scale.py --quick    # sizes up to 16,384 (seconds)
    /work/venv/bin/python bench/mesh_scale.py --sizes 1024 1048576 --families 3d

One simulated rank, the last one (N-1), does what a trainer does at start-up:
``init_device_mesh("cpu", shape, mesh_dim_names=...)``, ``get_group`` for every dim, one slice
and one flatten. 2-D is (N/8, 8) named ("dp", "tp"): slice mesh["dp"], flatten mesh._flatten().
3-D is (N/64, 8, 8) named ("dp", "cp", "tp"): slice mesh["dp", "tp"], flatten
mesh["dp", "cp"]._flatten(). Ours runs in tensorplay's "fake" world, PyTorch's
torch.distributed.device_mesh on its "fake" backend (FakeStore); both in this same run.

Every (family, size, implementation) cell runs in a fresh subprocess, so no group registry,
cache or peak leaks between rows. In it, after the imports:
  cycle 1 (cold):  time of the first call, and the RSS delta (/proc/self/statm, resident pages,
                   objects still alive) around it;
  cycle 2:         tracemalloc peak of the operations (Python heap; numpy reports its buffers
                   to tracemalloc, torch's C++ allocations do not show);
  cycles 3+ (warm): wall time (time.perf_counter), repeated until --repeats or --budget.
Each cycle is init_process_group -> operations -> destroy_process_group, so every cycle starts
from an empty world. A series stops once one call passes --limit seconds (60) or its
subprocess passes --timeout (120); larger sizes then read "stopped: > 60 s at N".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

SIZES = (64, 1024, 16384, 131072, 1048576)
QUICK_MAX = 16384
FAMILIES = {
    "2d": (("dp", "tp"), lambda n: (n // 8, 8)),
    "3d": (("dp", "cp", "tp"), lambda n: (n // 64, 8, 8)),
}
GOAL_SIZE = 1048576
GOAL_TIME_S = 1e-3
GOAL_PEAK_B = 1 << 20
GOAL_RATIO = 100.0
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the child: one implementation, one family, one size ----------------------------------------
def _rss() -> int:
    """Resident set size in bytes (second column of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _ours(size: int, family: str):
    """(init, operations, destroy) for tensorplay in its fake world, as rank size-1."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh

    names, shape_of = FAMILIES[family]
    shape = shape_of(size)

    def init() -> None:
        dist.init_process_group("fake", rank=size - 1, world_size=size)

    def operations():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = [mesh.get_group(d) for d in names]
        if family == "2d":
            sliced, flat = mesh["dp"], mesh._flatten()
        else:
            sliced, flat = mesh["dp", "tp"], mesh["dp", "cp"]._flatten()
        return mesh, groups, sliced, flat

    def describe(kept) -> list[list[int]]:
        groups = list(kept[1]) + [kept[3].get_group()]
        return [[g.size(), g.global_rank(0), g.global_rank(g.size() - 1)] for g in groups]

    return init, operations, describe, dist.destroy_process_group


def _torch(size: int, family: str):
    """(init, operations, destroy) for PyTorch's DeviceMesh on its fake backend, rank size-1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    names, shape_of = FAMILIES[family]
    shape = shape_of(size)

    def init() -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=size - 1, world_size=size)

    def operations():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = [mesh.get_group(d) for d in names]
        if family == "2d":
            sliced, flat = mesh["dp"], mesh._flatten()
        else:
            sliced, flat = mesh["dp", "tp"], mesh["dp", "cp"]._flatten()
        return mesh, groups, sliced, flat

    def describe(kept) -> list[list[int]]:
        groups = list(kept[1]) + [kept[3].get_group()]
        out = []
        for g in groups:
            ranks = dist.get_process_group_ranks(g)
            out.append([len(ranks), ranks[0], ranks[-1]])
        return out

    return init, operations, describe, dist.destroy_process_group


def child(impl: str, family: str, size: int, repeats: int, budget: float, limit: float) -> dict:
    """Measure one cell; returns what the parent prints."""
    init, operations, describe, destroy = (_ours if impl == "ours" else _torch)(size, family)

    init()  # cycle 1: cold call, RSS delta
    before = _rss()
    t0 = time.perf_counter()
    kept = operations()
    cold = time.perf_counter() - t0
    rss_delta = _rss() - before
    groups = describe(kept)
    del kept
    destroy()
    result = {"cold_s": cold, "rss_delta_b": rss_delta, "groups": groups, "times_s": [],
              "peak_b": None}
    if cold > limit:
        return result

    init()  # cycle 2: Python heap peak
    tracemalloc.start()
    kept = operations()
    result["peak_b"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del kept
    destroy()

    spent = 0.0  # cycles 3+: warm wall time
    while len(result["times_s"]) < repeats and (not result["times_s"] or spent < budget):
        init()
        t0 = time.perf_counter()
        kept = operations()
        elapsed = time.perf_counter() - t0
        del kept
        destroy()
        result["times_s"].append(elapsed)
        spent += elapsed
    return result


# -- the parent: one subprocess per cell, then the tables ---------------------------------------
def measure(impl: str, family: str, size: int, opts) -> dict:
    """Run one cell in a fresh interpreter; {'status': 'ok'|'timeout'|'error', ...}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--families", family,
           "--sizes", str(size), "--repeats", str(opts.repeats), "--budget", str(opts.budget),
           "--limit", str(opts.limit)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    if proc.returncode != 0:
        return {"status": "error", "detail": proc.stderr.strip().splitlines()[-1:]}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def median_time(cell: dict) -> float:
    return statistics.median(cell["times_s"]) if cell["times_s"] else cell["cold_s"]


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < 1 << 20:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{n / (1 << 20):.1f} MiB"


def cell_text(cell: dict | None, stopped_at: int | None, opts) -> tuple[str, str, str, str]:
    """(time, peak, rss delta, cold time) texts of one cell."""
    if cell is None:
        note = f"stopped: > {opts.limit:g} s at {stopped_at}"
        return note, "-", "-", "-"
    if cell["status"] == "timeout":
        return f"> {opts.timeout:g} s (killed)", "-", "-", "-"
    if cell["status"] == "error":
        return f"error: {' '.join(cell['detail'])[:60]}", "-", "-", "-"
    t = median_time(cell)
    suffix = f" (n={len(cell['times_s'])})" if cell["times_s"] else " (cold only)"
    return (fmt_time(t) + suffix, fmt_bytes(cell["peak_b"]), fmt_bytes(cell["rss_delta_b"]),
            fmt_time(cell["cold_s"]))


def too_slow(cell: dict, opts) -> bool:
    return cell["status"] != "ok" or cell["cold_s"] > opts.limit or median_time(cell) > opts.limit


def run_all(opts) -> dict:
    results: dict = {}
    for family in opts.families:
        stopped: dict[str, int | None] = {"ours": None, "torch": None}
        for size in opts.sizes:
            for impl in ("ours", "torch"):
                if stopped[impl] is not None:
                    results[family, size, impl] = None
                    continue
                t0 = time.perf_counter()
                cell = measure(impl, family, size, opts)
                results[family, size, impl] = cell
                print(f"  {family} N={size:>8} {impl:<5} {cell['status']:<7} "
                      f"{time.perf_counter() - t0:6.1f} s", file=sys.stderr, flush=True)
                if too_slow(cell, opts):
                    stopped[impl] = size
        results[family, "stopped"] = stopped
    return results


def ratio_text(ours: dict | None, torch: dict | None, opts) -> tuple[str, float | None]:
    """Torch time / our time; a lower bound ('>=') when PyTorch was stopped or killed."""
    if ours is None or ours["status"] != "ok":
        return "-", None
    mine = median_time(ours)
    if torch is None or torch["status"] == "timeout":
        bound = opts.limit / mine
        return f">= {bound:,.0f}x", bound
    if torch["status"] != "ok":
        return "-", None
    value = median_time(torch) / mine
    return f"{value:,.0f}x", value


def check_groups(results: dict, opts) -> list[str]:
    """Rows whose groups (size, first rank, last rank) differ between ours and PyTorch."""
    bad = []
    for family in opts.families:
        for size in opts.sizes:
            ours, torch = results[family, size, "ours"], results[family, size, "torch"]
            both = ours and torch and ours["status"] == torch["status"] == "ok"
            if both and ours["groups"] != torch["groups"]:
                bad.append(f"{family} N={size}: ours {ours['groups']} torch {torch['groups']}")
    return bad


def print_tables(results: dict, opts) -> None:
    print("\n### Per-rank cost: init_device_mesh + get_group(every dim) + 1 slice + 1 flatten "
          "(rank N-1)\n")
    print("| mesh | world size N | ours time | ours peak | ours RSS Δ | torch time | torch peak "
          "| torch RSS Δ | torch/ours time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for family in opts.families:
        names, shape_of = FAMILIES[family]
        stopped = results[family, "stopped"]
        for size in opts.sizes:
            ours, torch = results[family, size, "ours"], results[family, size, "torch"]
            o = cell_text(ours, stopped["ours"], opts)
            t = cell_text(torch, stopped["torch"], opts)
            ratio, _ = ratio_text(ours, torch, opts)
            shape = "x".join(str(s) for s in shape_of(size))
            print(f"| {family} {shape} | {size:,} | {o[0]} | {o[1]} | {o[2]} | {t[0]} | {t[1]} "
                  f"| {t[2]} | {ratio} |")
    print("\ntime: median wall time (time.perf_counter) of n warm calls, each in a fresh world; "
          "peak: tracemalloc peak during the operations (Python heap only: PyTorch's C++ "
          "allocations, e.g. its rank tensors, are not seen); RSS Δ: resident memory "
          "(/proc/self/statm) after the first call minus before, objects alive (sees C++ too; "
          "page granularity, noisy below ~100 KiB).")

    print("\n### First call in a fresh process (includes one-time lazy imports and warm-up)\n")
    print("| mesh | world size N | ours cold | torch cold |")
    print("|---|---:|---:|---:|")
    for family in opts.families:
        stopped = results[family, "stopped"]
        for size in opts.sizes:
            o = cell_text(results[family, size, "ours"], stopped["ours"], opts)
            t = cell_text(results[family, size, "torch"], stopped["torch"], opts)
            print(f"| {family} | {size:,} | {o[3]} | {t[3]} |")


def print_goal(results: dict, opts) -> None:
    print(f"\nGoal: at {GOAL_SIZE:,} ranks ours < 1 ms and < 1 MiB per rank, >= "
          f"{GOAL_RATIO:.0f}x faster than PyTorch.")
    if GOAL_SIZE not in opts.sizes:
        print("Goal: not evaluated (run without --quick, or include 1048576 in --sizes).")
        return
    met = True
    for family in opts.families:
        ours, torch = results[family, GOAL_SIZE, "ours"], results[family, GOAL_SIZE, "torch"]
        if ours is None or ours["status"] != "ok":
            print(f"  {family}: ours did not finish -> NOT MET")
            met = False
            continue
        t, peak = median_time(ours), ours["peak_b"]
        ratio_str, ratio = ratio_text(ours, torch, opts)
        parts = [
            (f"time {fmt_time(t)} < 1 ms", t < GOAL_TIME_S),
            (f"peak {fmt_bytes(peak)} < 1 MiB", peak is not None and peak < GOAL_PEAK_B),
            (f"speed-up {ratio_str} >= {GOAL_RATIO:.0f}x",
             ratio is not None and ratio >= GOAL_RATIO),
        ]
        met &= all(ok for _, ok in parts)
        print(f"  {family}: " + "; ".join(f"{text} [{'ok' if ok else 'MISSED'}]"
                                          for text, ok in parts))
    print(f"Goal met: {'YES' if met else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--quick", action="store_true", help=f"only sizes <= {QUICK_MAX}")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["2d", "3d"])
    parser.add_argument("--repeats", type=int, default=7, help="warm timed calls per cell")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="stop repeating a cell after this many seconds of timed calls")
    parser.add_argument("--limit", type=float, default=60.0, help="per-call limit, seconds")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-subprocess limit")
    parser.add_argument("--child", choices=("ours", "torch"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        out = child(opts.child, opts.families[0], opts.sizes[0], opts.repeats, opts.budget,
                    opts.limit)
        print(json.dumps(out))
        return
    if opts.quick:
        opts.sizes = [s for s in opts.sizes if s <= QUICK_MAX]
    opts.sizes = sorted(set(opts.sizes))
    bad = [s for s in opts.sizes if s % 64]
    if bad:
        parser.error(f"--sizes must be multiples of 64 (for the 3-D shape), got {bad}")
    start = time.perf_counter()
    print(f"mesh_scale: sizes {opts.sizes}, families {opts.families}, "
          f"{os.cpu_count()} CPUs; one fresh subprocess per cell", file=sys.stderr)
    results = run_all(opts)
    print_tables(results, opts)
    mismatched = check_groups(results, opts)
    print("\nGroups agree with PyTorch (size, first and last rank of every dim's group and the "
          f"flattened group): {'yes' if not mismatched else 'NO'}")
    for line in mismatched:
        print(f"  {line}")
    print_goal(results, opts)
    print(f"\nwall time of this run: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
