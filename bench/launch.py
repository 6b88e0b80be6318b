"""Job start: tensorplay-run's warm start against --no-warm and torchrun, 8 gloo ranks, in turns.

    python bench/launch.py                  # 5 rounds of the three launchers (~2-3 min on 2 cores)
    python bench/launch.py --rounds 1 --nproc 2 --out /tmp/launch.json   # a quick check

The same script under each launcher: ``init_process_group`` (gloo), a (2, 4) mesh
(``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))``), one 4-byte ``all_reduce``
along each dim, ``destroy_process_group``, exit. Each rank writes the wall-clock time
(``time.time()``) just after its first collective to a file of its own. Measured, per job:

- launch -> the last rank past its first collective (the max of the ranks' stamps minus the
  time just before the launcher was started);
- the whole job (the launcher's wall time, from start to exit).

Launchers, one job of each per round in turn: ``tensorplay-run`` (warm start: ranks forked from
one process that imported torch once), ``tensorplay-run --no-warm`` (each rank a fresh
interpreter) and ``torchrun`` (``python -m torch.distributed.run``, its defaults). With
``--nproc`` other than 8 the mesh is (2, nproc // 2). Tables give medians, min and max.

Goal (issue 22): warm, launch -> last rank past its first collective, at most 0.3x torchrun's
(medians).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, fmt_time, machine, pythonpath, tree_state
from _results import add_out, recorded

GOAL = 0.3
JOB = """\
import os, sys, time
import torch
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
n = dist.get_world_size()
mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
x = torch.ones(1)
dist.all_reduce(x, group=mesh.get_group("dp"))
stamp = time.time()
with open(os.path.join(os.environ["STAMPS"], os.environ["RANK"]), "w") as f:
    f.write(repr(stamp))
print(f"rank {os.environ['RANK']} past its first collective at {stamp!r}")
dist.all_reduce(x, group=mesh.get_group("tp"))
dist.destroy_process_group()
"""
KINDS = {
    "tensorplay-run (warm)": ["-m", "tensorplay.distributed.run"],
    "tensorplay-run --no-warm": ["-m", "tensorplay.distributed.run", "--no-warm"],
    "torchrun": ["-m", "torch.distributed.run"],
}


def one_job(kind: str, nproc: int, script: str, stamps: Path, limit_s: float
            ) -> tuple[float, float]:
    """Run one job; returns (launch -> last rank past its first collective, whole job)."""
    shutil.rmtree(stamps, ignore_errors=True)
    stamps.mkdir()
    env = dict(os.environ, PYTHONPATH=pythonpath(), STAMPS=str(stamps))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, *KINDS[kind], "--nproc-per-node", str(nproc), script]
    began = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=limit_s)
    wall = time.time() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    got = [float(p.read_text()) for p in stamps.iterdir()]
    if len(got) != nproc:
        raise SystemExit(f"{kind}: {len(got)} of {nproc} ranks stamped")
    return max(got) - began, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="jobs per launcher (in turns)")
    p.add_argument("--nproc", type=int, default=8, help="ranks per job (even; mesh (2, n/2))")
    p.add_argument("--limit-s", type=float, default=300.0, help="one job's time limit")
    add_out(p, __file__)
    a = p.parse_args()
    if a.nproc < 2 or a.nproc % 2:
        p.error("--nproc must be even and at least 2")
    with recorded(__file__, a.out):
        run_benchmark(a)


def run_benchmark(a: argparse.Namespace) -> None:
    print(f"bench/launch.py: {tree_state()}, {machine()}, {a.nproc} gloo ranks, mesh "
          f"(2, {a.nproc // 2}), {a.rounds} round(s)\n", flush=True)
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        Path(script).write_text(JOB)
        for _ in range(a.rounds):
            for kind in KINDS:
                samples[kind].append(one_job(kind, a.nproc, script, Path(tmp, "stamps"),
                                             a.limit_s))
    print(f"### Launch to the last rank past its first collective ({a.nproc} ranks)\n")
    print("| launcher | launch -> last rank past first all_reduce (median) | min | max | "
          "whole job (median) | ratio to torchrun (first collective) | jobs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {k: statistics.median(s[0] for s in v) for k, v in samples.items()}
    for kind, v in samples.items():
        firsts = [s[0] for s in v]
        print(f"| {kind} | {fmt_time(med[kind])} | {fmt_time(min(firsts))} | "
              f"{fmt_time(max(firsts))} | {fmt_time(statistics.median(s[1] for s in v))} | "
              f"{med[kind] / med['torchrun']:.2f} | {len(v)} |")
    ratio = med["tensorplay-run (warm)"] / med["torchrun"]
    ok = ratio <= GOAL
    print(f"\nGoal: warm start, launch -> last rank past its first collective, at most "
          f"{GOAL}x torchrun's.")
    print(f"  warm/torchrun {ratio:.2f} <= {GOAL} [{'ok' if ok else 'MISSED'}]; "
          f"--no-warm/torchrun {med['tensorplay-run --no-warm'] / med['torchrun']:.2f}")
    print(f"Goal met: {'YES' if ok else 'NO'}")


if __name__ == "__main__":
    main()
