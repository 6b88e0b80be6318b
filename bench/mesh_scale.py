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
cache or peak leaks between rows. In it, after the imports, each call is init_process_group ->
operations -> destroy_process_group, so every call starts from an empty world:
  cold:  the first call in the process; also the RSS delta around it (/proc/self/statm,
         resident pages, objects still alive: sees C++ allocations too);
  warm:  wall time (time.perf_counter) of further calls, until --repeats or --budget seconds;
  peak:  one more call under tracemalloc: peak Python-heap bytes during the operations (numpy
         reports its buffers to tracemalloc; torch's C++ allocations do not show). Skipped
         when the timed calls took over --peak-max (10) seconds: tracemalloc multiplies them.
The child prints a line as each call starts and ends; a call that runs --timeout (120) seconds
gets the subprocess killed. A series stops once one timed call passes --limit (60) seconds or
is killed; its larger sizes then read "stopped: > 60 s at N".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc

from _common import fmt_bytes, fmt_time, machine, tree_state
from _results import add_out, recorded

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


def _operations(init_device_mesh, family: str, size: int):
    """The measured work, the same for both libraries: build, get every group, slice, flatten."""
    names, shape_of = FAMILIES[family]
    shape = shape_of(size)

    def operations():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = [mesh.get_group(d) for d in names]
        if family == "2d":
            sliced, flat = mesh["dp"], mesh._flatten()
        else:
            sliced, flat = mesh["dp", "tp"], mesh["dp", "cp"]._flatten()
        return mesh, groups, sliced, flat

    return operations


def _ours(size: int, family: str):
    """(init, operations, describe, destroy) for tensorplay's fake world, as rank size-1."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh

    def init() -> None:
        dist.init_process_group("fake", rank=size - 1, world_size=size)

    def describe(kept) -> list[list[int]]:
        groups = list(kept[1]) + [kept[3].get_group()]
        return [[g.size(), g.global_rank(0), g.global_rank(g.size() - 1)] for g in groups]

    return init, _operations(init_device_mesh, family, size), describe, dist.destroy_process_group


def _torch(size: int, family: str):
    """(init, operations, describe, destroy) for PyTorch on its fake backend, as rank size-1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init() -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=size - 1, world_size=size)

    def describe(kept) -> list[list[int]]:
        groups = list(kept[1]) + [kept[3].get_group()]
        out = []
        for g in groups:
            ranks = dist.get_process_group_ranks(g)
            out.append([len(ranks), ranks[0], ranks[-1]])
        return out

    return init, _operations(init_device_mesh, family, size), describe, dist.destroy_process_group


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def child(impl: str, family: str, size: int, repeats: int, budget: float, limit: float,
          peak_max: float) -> None:
    """Measure one cell, printing one JSON line as each call starts and ends."""
    init, operations, describe, destroy = (_ours if impl == "ours" else _torch)(size, family)

    init()  # the cold call: first in this process; RSS delta around it
    _emit(phase="cold", start=True)
    before = _rss()
    t0 = time.perf_counter()
    kept = operations()
    cold = time.perf_counter() - t0
    rss_delta = _rss() - before
    _emit(phase="cold", seconds=cold, rss_delta_b=rss_delta, groups=describe(kept))
    del kept
    destroy()
    if cold > limit:
        return

    spent, done = 0.0, 0  # warm calls, until --repeats or --budget seconds
    while done < repeats and (done == 0 or spent < budget):
        init()
        _emit(phase="warm", start=True)
        t0 = time.perf_counter()
        kept = operations()
        elapsed = time.perf_counter() - t0
        _emit(phase="warm", seconds=elapsed)
        del kept
        destroy()
        spent, done = spent + elapsed, done + 1
        if elapsed > limit:
            return
    if cold > peak_max and spent / done > peak_max:
        _emit(phase="peak", skipped=True)
        return

    init()  # last, being the slowest (tracemalloc hooks every allocation): the Python peak
    _emit(phase="peak", start=True)
    tracemalloc.start()
    kept = operations()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    _emit(phase="peak", peak_b=peak)
    del kept
    destroy()


# -- the parent: one subprocess per cell, then the tables ---------------------------------------
def measure(impl: str, family: str, size: int, opts) -> dict:
    """Run one cell in a fresh interpreter; a call that runs past --timeout gets it killed.

    Returns {"status": "ok" | "killed" | "error", "cold_s", "rss_delta_b", "groups",
    "times_s", "peak_b", "killed_in"}, filled as far as the child got.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--families", family,
           "--sizes", str(size), "--repeats", str(opts.repeats), "--budget", str(opts.budget),
           "--limit", str(opts.limit), "--peak-max", str(opts.peak_max)]
    cell = {"status": "ok", "cold_s": None, "rss_delta_b": None, "groups": None,
            "times_s": [], "peak_b": None, "killed_in": None}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [
        lines.put(None)], daemon=True)
    reader.start()
    phase = "start-up"
    try:
        while (line := lines.get(timeout=opts.timeout)) is not None:
            event = json.loads(line)
            phase = event["phase"]
            if event.get("start"):
                continue
            if phase == "cold":
                cell.update(cold_s=event["seconds"], rss_delta_b=event["rss_delta_b"],
                            groups=event["groups"])
            elif phase == "warm":
                cell["times_s"].append(event["seconds"])
            elif event.get("skipped"):
                cell["peak_skipped"] = True
            else:
                cell["peak_b"] = event["peak_b"]
    except queue.Empty:
        proc.kill()
        cell.update(status="killed", killed_in=phase)
    proc.wait()
    errors = proc.stderr.read().strip().splitlines()
    if cell["status"] == "ok" and proc.returncode != 0:
        cell.update(status="error", detail=errors[-1:])
    return cell


def median_time(cell: dict) -> float | None:
    """Median warm time, else the cold time, else None (killed before any call ended)."""
    return statistics.median(cell["times_s"]) if cell["times_s"] else cell["cold_s"]


def killed_in_call(cell: dict) -> bool:
    """Killed while a timed call (cold or warm) was running: that call passed --timeout."""
    return cell["status"] == "killed" and cell["killed_in"] in ("cold", "warm")






def cell_text(cell: dict | None, stopped_at: int | None, opts) -> tuple[str, str, str, str]:
    """(time, peak, rss delta, cold time) texts of one cell."""
    if cell is None:
        return f"stopped: > {opts.limit:g} s at {stopped_at:,}", "-", "-", "-"
    if cell["status"] == "error":
        return f"error: {' '.join(cell['detail'])[:60]}", "-", "-", "-"
    killed = f"> {opts.timeout:g} s (killed)"
    if cell["cold_s"] is None:
        return (killed if killed_in_call(cell) else "killed in start-up"), "-", "-", "-"
    t = median_time(cell)
    n = len(cell["times_s"])
    time_text = fmt_time(t) + (f" (n={n})" if n else " (cold only)")
    if cell["killed_in"] == "warm":
        time_text += f"; a warm call {killed}"
    if cell["killed_in"] == "peak":
        peak = f"{killed} under tracemalloc"
    elif cell.get("peak_skipped"):
        peak = f"skipped: call > {opts.peak_max:g} s"
    else:
        peak = fmt_bytes(cell["peak_b"])
    return time_text, peak, fmt_bytes(cell["rss_delta_b"]), fmt_time(cell["cold_s"])


def too_slow(cell: dict, opts) -> bool:
    """Whether this cell stops its series: a call passed --limit, was killed, or failed."""
    if cell["status"] == "error" or killed_in_call(cell) or cell["cold_s"] is None:
        return True
    return max([cell["cold_s"], *cell["times_s"]]) > opts.limit


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
    """Torch time / our time; a lower bound ('>=') when PyTorch was stopped or killed.

    A stopped PyTorch cell (an earlier, smaller size already passed --limit) counts as
    --limit seconds, a call killed at --timeout as --timeout seconds.
    """
    mine = None if ours is None or ours["status"] == "error" else median_time(ours)
    if mine is None:
        return "-", None
    if torch is None:
        bound = opts.limit / mine
    elif killed_in_call(torch) and torch["cold_s"] is None:
        bound = opts.timeout / mine
    elif torch["status"] == "error" or median_time(torch) is None:
        return "-", None
    else:
        value = median_time(torch) / mine
        return f"{value:,.0f}x", value
    return f">= {bound:,.0f}x", bound


def check_groups(results: dict, opts) -> tuple[int, list[str]]:
    """(rows compared, rows whose groups differ) between ours and PyTorch.

    A group is compared by (size, first rank, last rank), for every dim and the flattened one.
    """
    bad, compared = [], 0
    for family in opts.families:
        for size in opts.sizes:
            ours, torch = results[family, size, "ours"], results[family, size, "torch"]
            if not (ours and torch and ours["groups"] and torch["groups"]):
                continue
            compared += 1
            if ours["groups"] != torch["groups"]:
                bad.append(f"{family} N={size}: ours {ours['groups']} torch {torch['groups']}")
    return compared, bad


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
        if ours is None or ours["status"] != "ok" or median_time(ours) is None:
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
    parser.add_argument("--budget", type=float, default=10.0,
                        help="stop repeating a cell after this many seconds of timed calls")
    parser.add_argument("--limit", type=float, default=60.0, help="per-call limit, seconds")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="kill a cell's subprocess when one call runs this long, seconds")
    parser.add_argument("--peak-max", type=float, default=10.0,
                        help="skip the tracemalloc call when a timed call took longer (it is "
                             "several times slower under tracemalloc), seconds")
    parser.add_argument("--child", choices=("ours", "torch"), help=argparse.SUPPRESS)
    add_out(parser, __file__)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.families[0], opts.sizes[0], opts.repeats, opts.budget, opts.limit,
              opts.peak_max)
        return
    if opts.quick:
        opts.sizes = [s for s in opts.sizes if s <= QUICK_MAX]
    opts.sizes = sorted(set(opts.sizes))
    bad = [s for s in opts.sizes if s % 64]
    if bad:
        parser.error(f"--sizes must be multiples of 64 (for the 3-D shape), got {bad}")
    with recorded(__file__, opts.out):
        run_benchmark(opts)


def run_benchmark(opts: argparse.Namespace) -> None:
    """Run the benchmark; print its tables and its goal block."""
    start = time.perf_counter()
    print(f"mesh_scale: sizes {opts.sizes}, families {opts.families}; one fresh subprocess per "
          f"cell", file=sys.stderr)
    print(f"mesh_scale: tensorplay at {tree_state()}; {machine()}; measured rank: N-1")
    results = run_all(opts)
    print_tables(results, opts)
    compared, mismatched = check_groups(results, opts)
    print("\nGroups agree with PyTorch's (size, first and last rank of every dim's group and of "
          f"the flattened group; {compared} rows compared): {'yes' if not mismatched else 'NO'}")
    for line in mismatched:
        print(f"  {line}")
    print_goal(results, opts)
    print(f"\nwall time of this run: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
