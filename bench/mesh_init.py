"""Mesh set-up time and collective overhead on 8 real gloo ranks: tensorplay vs PyTorch.

    python bench/mesh_init.py                # ~4 minutes on 2 busy cores
    python bench/mesh_init.py --rounds 4     # the README's tables (~6 minutes)
    python bench/mesh_init.py --rounds 1 --repeats 3 --iters 10 --big-iters 3 --pair-rounds 500

(a) Set-up: from the start of init_process_group to a (2, 4) mesh ("dp", "tp") with every
    group ready and a barrier passed. Ours: tensorplay's init_process_group + init_device_mesh;
    PyTorch: torch.distributed's init_process_group + torch.distributed.device_mesh's
    init_device_mesh. Both connect over tcp://127.0.0.1 (a fresh port per repeat), and both
    run one 4-byte all_reduce on each dim group before the barrier, so lazily made groups are
    made inside the timed span. Each implementation runs in its own set of 8 processes; each
    set runs one warm-up cycle (imports, first connections) and then --repeats cycles of
    init -> mesh -> destroy. Every rank starts a cycle at the same wall-clock instant, agreed
    through files in a temporary folder (no process group exists between cycles), so one
    repeat = (last rank's end) - (common start): the max over ranks. The old world's
    teardown (and a gc.collect()) happens before that rendezvous, outside the timed span. A second
    table splits the span at init_process_group / mesh built / groups used. Sets run as
    ours, torch, torch, ours (--rounds 2), so load drift hits both alike; each set costs 8
    torch imports, the bulk of the run's time on 2 cores (--rounds 1 halves it).
(a2) Set-up, interleaved: one more set of 8 processes runs the same cycle as ours, torch and
    torch again in turn (--triples rounds, order rotating, after one warm-up cycle of each),
    so the three kinds of a round run seconds apart. Judged: the median over rounds of
    ours/torch within each round, with torch-again/torch as the A/A control. Load that
    drifts over seconds can slow a whole process set of (a); here it cancels.
(b) Collectives: in the first tensorplay set, all_reduce (SUM, float32 zeros) along "dp"
    (groups of 2) and "tp" (groups of 4) at 4 B, 1 MiB and 16 MiB: ours
    (tensorplay.distributed.all_reduce(t, group=mesh.get_group(d))) against a direct
    torch.distributed.all_reduce(t, group=mesh.get_group(d).engine_group) on the same ranks.
    A third kind, the same direct call again, is an A/A control: its gap to "direct" is the
    noise floor. The kinds are interleaved (order rotating per sample); one sample is 10 (4 B),
    3 (1 MiB) or 1 (16 MiB) back-to-back calls after an untimed world barrier, per call; per
    sample the max over ranks. Shown: the median over samples of each kind, and the ratios
    judged: the median over samples of (ours / direct) and of (direct again / direct), taken
    within each sample (the three kinds ran back to back), so that drift of the machine
    between samples cancels.

(c) Per call, on 2 ranks: a 4-byte all_reduce, ours vs direct vs direct again, each call
    timed alone, in an order shuffled per round (shared seed). Two processes on 2 cores
    leave little noise, so this shows the per-call cost that (b) cannot resolve; it is
    reported, not judged.

Verdicts. Set-up, from (a2): ok when the paired ours/torch is <= 1 (no slower); MISSED when it
is above 1 by more than the A/A control moves; else not resolved. The per-round comparison of
the process sets of (a) is printed beside it. Collectives: ok when every paired ours/direct is
<= 1.05; MISSED when one is above and every row's A/A control is within 5%; else not resolved.

Processes are started by the project's tests/spawn.py (``run(fn, n, init=False)``): spawn
start method, a deadline on every wait, every child killed on the way out; reusing it keeps one
spawn helper in the repository. init=False because the timed span starts before
init_process_group; each cycle connects with tcp:// to a port picked here, not MASTER_PORT.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import operator
import os
import shutil
import statistics
import sys
import tempfile
import time

from _common import fmt_time, machine, paired, tree_state
from _results import add_out, recorded

from tests.spawn import free_port, run

WORLD = 8
SHAPE = (2, 4)
NAMES = ("dp", "tp")
SIZES_B = (4, 1 << 20, 16 << 20)
CALLS = {4: 10, 1 << 20: 3, 16 << 20: 1}  # back-to-back calls per timed sample
NOISE_KINDS = ("ours", "direct", "direct2")
START_MARGIN_S = 0.1  # from the last rank's arrival at the file rendezvous to the common start


# -- what runs on each rank ---------------------------------------------------------------------
class _Api:
    """The entry points one implementation offers; ours and PyTorch's have the same shape."""

    def __init__(self, impl: str):
        if impl == "ours":
            import tensorplay.distributed as dist
            from tensorplay.distributed.device_mesh import init_device_mesh
        else:
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

    def barrier(self) -> None:
        self.dist.barrier()

    def destroy(self) -> None:
        self.dist.destroy_process_group()


def _sleep_until(instant: float) -> None:
    while (left := instant - time.time()) > 0:
        time.sleep(min(left, 0.05))


def _rendezvous(sync_dir: str, tag: str, rank: int, deadline_s: float = 120.0) -> float:
    """Wait for every rank at ``tag`` (files, no process group) and return the common start.

    Each rank writes its arrival time; once all WORLD files exist, every rank computes the
    same start: the last arrival + START_MARGIN_S. time.time() is one clock for the machine.
    """
    mine = os.path.join(sync_dir, f"{tag}-{rank}")
    with open(mine + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(mine + ".tmp", mine)
    paths = [os.path.join(sync_dir, f"{tag}-{r}") for r in range(WORLD)]
    end = time.time() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.time() > end:
            raise TimeoutError(f"rendezvous {tag}: not every rank arrived in {deadline_s:g} s")
        time.sleep(0.001)
    arrivals = []
    for p in paths:
        with open(p) as f:
            arrivals.append(float(f.read()))
    return max(arrivals) + START_MARGIN_S


def rank_main(rank: int, kinds: list[str], ports: list[int], collect: dict | None,
              sync_dir: str) -> dict:
    """One rank of a process set: set-up cycles (``kinds[c]`` makes cycle c), then
    (optionally, when the last cycle was ours) the collective timings.

    A kind is "ours", "torch" or "torch2" (PyTorch again: the A/A control of table (a2)).
    Returns {"setup": [(start, began, joined, built, used, ready), ...],
    "coll": {(dim, bytes, kind): [s, ...]}, "phases": {...}} with wall-clock instants
    (time.time(), one clock for every process of this machine).
    """
    entered = time.time()
    import torch

    apis = {kind: _Api("ours" if kind == "ours" else "torch") for kind in set(kinds)}
    out: dict = {"setup": [], "coll": {}, "phases": {"entered": entered, "imported": time.time()}}
    mesh = None
    for cycle, (kind, port) in enumerate(zip(kinds, ports, strict=True)):
        api = apis[kind]
        start = _rendezvous(sync_dir, f"cycle-{cycle}", rank)
        _sleep_until(start)
        began = time.time()
        api.init(rank, port)
        joined = time.time()
        mesh = api.mesh()
        built = time.time()
        for dim in NAMES:
            api.all_reduce(torch.zeros(1), mesh, dim)
        used = time.time()
        api.barrier()
        ready = time.time()
        out["setup"].append((start, began, joined, built, used, ready))
        if cycle == len(ports) - 1:
            break
        api.destroy()
        mesh = None
        gc.collect()  # free the old world's groups (engine teardown) before the next rendezvous
    out["phases"]["cycles"] = time.time()
    if collect is not None:
        out["coll"] = _collectives(mesh, collect)
    out["phases"]["collectives"] = time.time()
    api.destroy()
    out["phases"]["destroyed"] = time.time()
    return out


def _collectives(mesh, plan: dict) -> dict:
    """Interleaved all_reduce timings along each dim, per size: ours, direct, direct again.

    "direct2" is the very same direct call a second time: an A/A control whose gap to "direct"
    is the noise floor of this machine. One sample = CALLS[size] back-to-back calls after an
    untimed world barrier, divided by their number; the order of the three kinds rotates.
    """
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
            "direct2": lambda t, e=engine: dist.all_reduce(t, group=e),
        }
        kinds = list(calls)
        for nbytes in SIZES_B:
            tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
            warm, iters = plan["warm"], plan["iters"] if nbytes <= 1 << 20 else plan["big_iters"]
            batch = CALLS[nbytes]
            for kind in kinds:
                times[dim, nbytes, kind] = []
            for i in range(warm + iters):
                for kind in kinds[i % 3:] + kinds[:i % 3]:
                    call = calls[kind]
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(batch):
                        call(tensor)
                    elapsed = (time.perf_counter() - t0) / batch
                    if i >= warm:
                        times[dim, nbytes, kind].append(elapsed)
    return times


# -- the parent ----------------------------------------------------------------------------------
def process_set(kinds: list[str], collect: dict | None, timeout: float) -> list[dict]:
    ports = [free_port() for _ in kinds]
    sync_dir = tempfile.mkdtemp(prefix="mesh_init-")
    try:
        return run(rank_main, WORLD, kinds, ports, collect, sync_dir, init=False,
                   timeout=timeout)
    finally:
        shutil.rmtree(sync_dir, ignore_errors=True)


PHASES = ("init_process_group", "+ mesh built", "+ each dim's group used", "+ barrier")
SETUP_KINDS = ("ours", "torch", "torch2")


def setup_times(per_rank: list[dict], first: int = 1) -> list[tuple[float, ...]]:
    """Per cycle from ``first`` on (warm-up dropped), for each phase: last rank past it -
    common start. The last entry (barrier passed) is the repeat's set-up time.
    """
    cycles = len(per_rank[0]["setup"])
    return [tuple(max(r["setup"][c][k] for r in per_rank) - per_rank[0]["setup"][c][0]
                  for k in range(2, 2 + len(PHASES)))
            for c in range(first, cycles)]


def interleaved_kinds(triples: int) -> list[str]:
    """One warm-up cycle of each kind, then ``triples`` rounds of all three, order rotating."""
    kinds = list(SETUP_KINDS)
    return kinds + [k for t in range(triples) for k in kinds[t % 3:] + kinds[:t % 3]]


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




def pair_calls(rank: int, rounds: int) -> dict:
    """(c) One rank of a 2-rank world: per-call times of a 4-byte all_reduce, three kinds.

    Each round calls ours, direct and direct again once each, in an order shuffled by a seed
    both ranks share (so both always make the same call), timing every call on its own.
    """
    import random

    import torch
    import torch.distributed as dist

    import tensorplay.distributed as tdist
    from tensorplay.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)).get_group("dp")
    engine, tensor = group.engine_group, torch.zeros(1)
    calls = {"ours": lambda: tdist.all_reduce(tensor, group=group),
             "direct": lambda: dist.all_reduce(tensor, group=engine),
             "direct2": lambda: dist.all_reduce(tensor, group=engine)}
    times: dict[str, list[float]] = {kind: [] for kind in calls}
    for i in range(rounds):
        order = list(calls)
        random.Random(i).shuffle(order)
        for kind in order:
            t0 = time.perf_counter()
            calls[kind]()
            times[kind].append(time.perf_counter() - t0)
    return times


def fmt_size(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes >> 20} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="timed set-up cycles per set")
    parser.add_argument("--rounds", type=int, default=2,
                        help="process-set rounds: ours,torch, then torch,ours, ...")
    # enough samples that the A/A control of (b) settles within a few percent on 2 busy cores
    # (40/12 left it at 7-8%, too loose to judge a 5% goal)
    parser.add_argument("--iters", type=int, default=150, help="timed samples, 4 B and 1 MiB")
    parser.add_argument("--big-iters", type=int, default=45, help="timed samples, 16 MiB")
    parser.add_argument("--pair-rounds", type=int, default=3000,
                        help="rounds of the 2-rank call-by-call table (c)")
    parser.add_argument("--triples", type=int, default=12,
                        help="rounds of ours, torch, torch again in the interleaved set (a2)")
    parser.add_argument("--warm", type=int, default=2, help="untimed warm-up calls per size")
    parser.add_argument("--timeout", type=float, default=150.0, help="per process set, s")
    add_out(parser, __file__)
    opts = parser.parse_args()
    with recorded(__file__, opts.out):
        run_benchmark(opts)


def run_benchmark(opts: argparse.Namespace) -> None:
    """Run the benchmark; print its tables and its goal block."""
    wall = time.perf_counter()
    print(f"mesh_init: tensorplay at {tree_state()}; {machine()}; {WORLD} gloo ranks over "
          f"loopback; mesh {SHAPE} {NAMES}")

    plan = {"warm": opts.warm, "iters": opts.iters, "big_iters": opts.big_iters}
    order: list[str] = []
    for r in range(opts.rounds):
        order += ["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]
    setup: dict[str, list[tuple[float, ...]]] = {"ours": [], "torch": []}
    per_set: list[tuple[str, float]] = []
    late = 0.0
    coll = None
    for impl in order:
        t0 = time.perf_counter()
        t0_wall = time.time()
        collect = plan if impl == "ours" and coll is None else None
        per_rank = process_set([impl] * (opts.repeats + 1), collect, opts.timeout)
        phases = {k: max(r["phases"][k] for r in per_rank) for k in per_rank[0]["phases"]}
        marks = [("spawn+start", t0_wall, phases["entered"])] + [
            (b, phases[a], phases[b]) for a, b in itertools.pairwise(phases)
        ] + [("exit", phases["destroyed"], time.time())]
        print("   " + ", ".join(f"{k} {end - begin:.1f} s" for k, begin, end in marks),
              file=sys.stderr)
        times = setup_times(per_rank)
        setup[impl] += times
        per_set.append((impl, statistics.median(t[-1] for t in times)))
        late = max(late, late_starts(per_rank))
        if collect is not None:
            coll = [r["coll"] for r in per_rank]
        print(f"  {impl} set done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    totals = {key: [phases[-1] for phases in setup[key]] for key in setup}
    ours, torch_ = statistics.median(totals["ours"]), statistics.median(totals["torch"])
    print(f"\n### (a) Set-up: init_process_group -> (2, 4) mesh, every group used once, barrier "
          f"({WORLD} gloo ranks)\n")
    print("| implementation | median | min | max | repeats |")
    print("|---|---:|---:|---:|---:|")
    for name, key in (("tensorplay", "ours"), ("PyTorch", "torch")):
        values = totals[key]
        print(f"| {name} | {fmt_time(statistics.median(values))} | {fmt_time(min(values))} | "
              f"{fmt_time(max(values))} | {len(values)} |")
    print(f"\nours/PyTorch (median): {ours / torch_:.2f}. One repeat = last rank ready - common "
          f"start (max over ranks); the latest any rank began a cycle after the common start: "
          f"{fmt_time(late)}. Median of each process set, in run order: "
          + ", ".join(f"{impl} {fmt_time(t)}" for impl, t in per_set) + ".")
    print("\nWhere the time goes (median over repeats of: last rank past the point - common "
          "start; cumulative):\n")
    print("| implementation | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for name, key in (("tensorplay", "ours"), ("PyTorch", "torch")):
        cells = [fmt_time(statistics.median(p[k] for p in setup[key]))
                 for k in range(len(PHASES))]
        print(f"| {name} | " + " | ".join(cells) + " |")

    kinds = interleaved_kinds(opts.triples)
    t0 = time.perf_counter()
    mixed = setup_times(process_set(kinds, None, opts.timeout), first=len(SETUP_KINDS))
    print(f"  interleaved set done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    by_kind: dict[str, list[float]] = {kind: [] for kind in SETUP_KINDS}
    for kind, times in zip(kinds[len(SETUP_KINDS):], mixed, strict=True):
        by_kind[kind].append(times[-1])
    pair_ratio = paired(by_kind["ours"], by_kind["torch"])
    pair_control = paired(by_kind["torch2"], by_kind["torch"])
    print(f"\n### (a2) Set-up, interleaved: ours, PyTorch and PyTorch again in turn, in the same "
          f"{WORLD} processes\n")
    print("| ours | PyTorch | PyTorch again | ours/PyTorch (paired) | "
          "A/A: PyTorch again/PyTorch (paired) | rounds |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {fmt_time(statistics.median(by_kind['ours']))} | "
          f"{fmt_time(statistics.median(by_kind['torch']))} | "
          f"{fmt_time(statistics.median(by_kind['torch2']))} | {pair_ratio:.3f} | "
          f"{pair_control:.3f} | {opts.triples} |")
    print("\nOne round: the three kinds back to back (order rotating), each a full cycle "
          "(init_process_group -> mesh -> groups used -> barrier, then destroy), timed as in "
          "(a). Paired: the median over rounds of each round's ratio, so load that drifts "
          "over seconds (which can slow a whole process set of (a)) cancels; A/A: PyTorch "
          "timed a second time, its distance from 1 the noise floor.")

    print(f"\n### (b) all_reduce along each mesh dim: ours vs direct torch.distributed on the "
          f"same group ({WORLD} gloo ranks)\n")
    print("| dim (group size) | size | ours | direct | ours/direct (paired) | paired Δ | "
          "A/A: direct again/direct (paired) | samples x calls |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    worst, noise = 0.0, 0.0
    for dim, size in zip(NAMES, SHAPE, strict=True):
        for nbytes in SIZES_B:
            samples = len(coll[0][dim, nbytes, "ours"])
            per_iter = {  # max over ranks of each sample
                kind: [max(r[dim, nbytes, kind][i] for r in coll) for i in range(samples)]
                for kind in NOISE_KINDS
            }
            o, d, d2 = (statistics.median(per_iter[k]) for k in NOISE_KINDS)
            delta = paired(per_iter["ours"], per_iter["direct"], operator.sub)
            ratio = paired(per_iter["ours"], per_iter["direct"])
            control = paired(per_iter["direct2"], per_iter["direct"])
            worst, noise = max(worst, ratio), max(noise, abs(control - 1))
            sign = "+" if delta >= 0 else "-"
            print(f"| {dim} ({size}) | {fmt_size(nbytes)} | {fmt_time(o)} | {fmt_time(d)} | "
                  f"{ratio:.3f} | {sign}{fmt_time(abs(delta))} | {control:.3f} | "
                  f"{samples} x {CALLS[nbytes]} |")
    print("\nOne sample: back-to-back calls after an untimed world barrier, divided by their "
          "number; its value is the max over the 8 ranks. ours, direct: medians over samples. "
          "Paired: median over samples of the ratio (or Δ, per call) within each sample, whose "
          "three kinds ran back to back. A/A: the same direct call timed a second time, "
          "interleaved with the other two: its distance from 1 is the noise floor.")

    pair = run(pair_calls, 2, opts.pair_rounds, timeout=opts.timeout)
    medians = {kind: statistics.mean(statistics.median(r[kind]) for r in pair)
               for kind in NOISE_KINDS}
    print(f"\n### (c) 4-byte all_reduce on 2 gloo ranks (2 processes on {os.cpu_count()} cores), "
          f"call by call\n")
    print("| ours | direct | direct again | ours/direct | A/A: direct again/direct | calls |")
    print("|---:|---:|---:|---:|---:|---:|")
    o, d, d2 = (medians[k] for k in NOISE_KINDS)
    print(f"| {fmt_time(o)} | {fmt_time(d)} | {fmt_time(d2)} | {o / d:.3f} | {d2 / d:.3f} | "
          f"{opts.pair_rounds} each |")
    print("\nEach call timed alone, the three kinds in a shuffled order per round; each rank's "
          "median per kind, averaged over the 2 ranks (a max over ranks would pick, call by call, "
          "the rank that waited for the other). With 2 processes on 2 cores the A/A noise is "
          "small enough to see a few percent, which the 8-rank table above cannot (reported, "
          "not judged by the goal).")

    guard = wrapper_cost()
    print(f"\nour all_reduce's fully checked path (argument checks and dispatch, measured in a "
          f"fake world where nothing moves): {fmt_time(guard)} per call; a member's plain "
          f"tensor on a live group takes a shorter path, straight to the c10d group.")

    ours_sets = [t for impl, t in per_set if impl == "ours"]
    torch_sets = [t for impl, t in per_set if impl == "torch"]
    faster = [o <= t for o, t in zip(ours_sets, torch_sets, strict=True)]  # one per round
    setup_noise = abs(pair_control - 1)
    setup = ("ok" if pair_ratio <= 1.0 else
             "MISSED" if pair_ratio > 1 + setup_noise else "not resolved")
    # a row's A/A is as noisy as its ratio, so the noise floor is the worst A/A of any row
    verdict = "ok" if worst <= 1.05 else ("MISSED" if noise <= 0.05 else "not resolved")
    print("\nGoal: mesh set-up no slower than PyTorch's; collectives within 5% of the direct "
          "call.")
    print(f"  set-up: paired ours/PyTorch {pair_ratio:.3f} <= 1 [{setup}] (table a2; A/A noise "
          f"floor {setup_noise:.1%}); separate process sets (a): ours {fmt_time(ours)} vs "
          f"PyTorch {fmt_time(torch_)}, ours no slower in {sum(faster)} of {len(faster)} rounds")
    print(f"  collectives: worst paired ours/direct {worst:.3f} <= 1.05 [{verdict}]; A/A noise "
          f"floor {noise:.1%} (largest paired |direct again/direct - 1|)"
          + ("; the control itself moves by more than 5%, so a 5% gap cannot be resolved here"
             if verdict == "not resolved" else ""))
    verdicts = (setup, verdict)
    met = ("NO" if "MISSED" in verdicts else
           "YES" if verdicts == ("ok", "ok") else "NOT RESOLVED (rerun on an idle machine)")
    print(f"Goal met: {met}")
    print(f"\nwall time of this run: {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
