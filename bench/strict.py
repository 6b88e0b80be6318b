"""What strict mode costs per call: all_reduce with and without TENSORPLAY_STRICT, 2 gloo ranks.

    python bench/strict.py            # ~1 min on 2 cores

Strict mode all-gathers an 8-byte fingerprint of every collective on its group before the call
runs (tensorplay/distributed/control/strict.py). Each of the 2 ranks runs two worlds in turn on the
same ports' neighbours: an unchecked one and a strict one, and times calls of 4 B, 1 MiB and 16
MiB in both, interleaved round by round so load that drifts cancels in the paired ratio. The
direct torch.distributed call on the same engine group is timed alongside as the anchor.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time

from _common import fmt_time, machine, paired, tree_state
from _results import add_out, recorded

from tests.spawn import run

SIZES = (4, 1 << 20, 16 << 20)


def rank_main(rank: int, rounds: int) -> dict:
    """Times of plain, strict and direct all_reduce per size, one sample per round."""
    import torch
    import torch.distributed as tdist

    import tensorplay.distributed as dist
    from tensorplay.distributed.world import current_world

    world = current_world("bench")
    plain_group = dist.new_group([0, 1])
    world.strict = True  # groups registered from now on check every call
    strict_group = dist.new_group([1, 0])  # the same ranks in another order: a new group
    world.strict = False
    times: dict[str, list[float]] = {}
    for size in SIZES:
        tensor = torch.zeros(max(size // 4, 1))
        calls = max(1, (1 << 22) // max(size, 1 << 16))  # ~64 calls at 4 B, 1 at 16 MiB
        kinds = {"plain": lambda t=tensor: dist.all_reduce(t, group=plain_group),
                 "strict": lambda t=tensor: dist.all_reduce(t, group=strict_group),
                 "direct": lambda t=tensor: tdist.all_reduce(t, group=plain_group.engine_group)}
        for _ in range(rounds):
            for kind, call in kinds.items():
                tdist.barrier(group=plain_group.engine_group)
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                times.setdefault(f"{kind} {size}", []).append(
                    (time.perf_counter() - t0) / calls)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="samples per size and kind")
    add_out(parser, __file__)
    opts = parser.parse_args()
    with recorded(__file__, opts.out):
        run_benchmark(opts)


def run_benchmark(opts: argparse.Namespace) -> None:
    """Run the benchmark; print its tables and its goal block."""
    print(f"strict: tensorplay at {tree_state()}; {machine()}; 2 gloo ranks over loopback")
    per_rank = run(rank_main, 2, opts.rounds, timeout=600)
    # a sample's time is the slower rank's (a collective ends when both have)
    merged = {key: [max(a, b) for a, b in zip(per_rank[0][key], per_rank[1][key], strict=True)]
              for key in per_rank[0]}
    print("\n| size | unchecked | strict | strict/unchecked (paired) | strict - unchecked | "
          "direct torch.distributed | samples |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in SIZES:
        plain, strict, direct = (merged[f"{k} {size}"] for k in ("plain", "strict", "direct"))
        ratio = paired(strict, plain)
        delta = paired(strict, plain, operator.sub)
        label = f"{size} B" if size < 1024 else f"{size >> 20} MiB"
        print(f"| {label} | {fmt_time(statistics.median(plain))} | "
              f"{fmt_time(statistics.median(strict))} | {ratio:.2f} | {fmt_time(delta)} | "
              f"{fmt_time(statistics.median(direct))} | {len(plain)} |")
    print("\nMedians over samples; paired: the median of each sample's ratio (or difference), "
          "the three kinds of a sample run back to back.")


if __name__ == "__main__":
    main()
