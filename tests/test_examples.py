"""The examples, run by the launcher on real gloo ranks: the main job, examples/train_dp_tp.py,
examples/train_fsdp_tp.py (FSDP2 + tensor parallelism on our mesh), examples/train_moe.py (a
mixture of experts on a dense view and its expert reshape; 8 ranks each) and
examples/fsdp_roles.py (FSDP or HSDP from the mesh's roles; 4 ranks); examples/heat2d.py and
examples/train_elastic_numpy.py (numpy only)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import timing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = [sys.executable, "-m", "tensorplay.distributed.run", "--nproc-per-node", "8",
       "examples/train_dp_tp.py"]
PRELOAD = ("--preload", "torch.distributed.tensor")  # as the DTensor examples' docs run them
TOLERANCE = 1e-5
RANK0 = "[rank 0] "


def run_job(*flags: str, job: list[str] = JOB) -> tuple[int, str, str]:
    """Run a job with extra script flags; (exit code, rank 0's stdout lines, stderr)."""
    done = subprocess.run([*job, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=timing.guard(300), errors="replace")
    rank0 = "\n".join(line[len(RANK0):] for line in done.stdout.splitlines()
                      if line.startswith(RANK0))
    return done.returncode, rank0, done.stderr


def losses(out: str) -> list[float]:
    """The loss of each step, in step order."""
    return [float(v) for v in re.findall(r"^step \d+/\d+  loss (\S+)$", out, re.MULTILINE)]


def max_diff(out: str) -> float:
    """The final 'max abs diff' rank 0 reports."""
    found = re.findall(r"^max abs diff: (\S+) \(tolerance", out, re.MULTILINE)
    assert len(found) == 1, out
    return float(found[0])


def test_main_job_matches_single_process_training():
    code, out, err = run_job()
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"
    assert "DeviceMesh('cpu', dp=2, tp=4; mesh=[[0, 1, 2, 3], [4, 5, 6, 7]])" in out
    rows = re.findall(r"^\s+(\d) {2}\((\d), (\d)\)\s+(\[.*?\])\s+(\[.*?\])$", out, re.MULTILINE)
    assert rows == [
        (str(r), str(r // 4), str(r % 4), f"[{r % 4}, {r % 4 + 4}]",
         str(list(range(r // 4 * 4, r // 4 * 4 + 4))))
        for r in range(8)
    ], out
    steps = losses(out)
    assert len(steps) == 5, out
    assert steps[-1] < 0.5 * steps[0], steps  # it learns, not only agrees
    assert 0 <= max_diff(out) < TOLERANCE
    assert "OK: matches single-process training" in out


def test_main_job_fails_when_dp_gradients_are_not_averaged():
    code, out, err = run_job("--skip-dp-average", "--steps", "2")
    assert code != 0, out
    assert max_diff(out) > TOLERANCE
    assert "MISMATCH: trained weights differ from single-process training" in out
    # every rank returns 1 from main(): the launcher says so, naming no rank as "first"
    assert err.splitlines()[-1] == "tensorplay-run: all 8 ranks failed alike (exit code 1).", (
        err[-3000:])


def test_fsdp_tp_example_matches_single_process_training():
    code, out, err = run_job(job=[*JOB[:-1], *PRELOAD, "examples/train_fsdp_tp.py"])
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"
    assert out.startswith("DeviceMesh('cpu', dp=2, tp=4; mesh=[[0, 1, 2, 3], [4, 5, 6, 7]])")
    steps = losses(out)
    assert len(steps) == 5 and steps[-1] < 0.8 * steps[0], steps  # it learns
    assert 0 <= max_diff(out) < TOLERANCE
    assert "OK: matches single-process training" in out


def test_fsdp_roles_example_matches_single_process_training():
    job = [*JOB[:3], "--nproc-per-node", "4", *PRELOAD, "examples/fsdp_roles.py"]
    code, out, err = run_job(job=job)
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"
    diffs = [float(v) for v in re.findall(r": max diff (\S+)$", out, re.MULTILINE)]
    assert len(diffs) == 2 and max(diffs) < 1e-12, out
    assert "the whole mesh: mesh=AbstractMesh(names=('dp_shard', 'tp')" in out
    assert "Fix: slice its data-parallel dims first: mesh['dp_shard'] (FSDP)." in out
    assert out.splitlines()[-1] == "OK: both match one process", out


# -- examples/train_moe.py: a mixture of experts on a dense view and its expert reshape ----------
MOE = [*JOB[:-1], "examples/train_moe.py"]
MOE_TOLERANCE = 1e-6


def moe_diff(out: str) -> float:
    found = re.findall(r"^max abs diff: (\S+) \(tolerance 1e-06;", out, re.MULTILINE)
    assert len(found) == 1, out
    return float(found[0])


def test_moe_example_shares_groups_and_matches_single_process_training():
    code, out, err = run_job(job=MOE)
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"
    assert "expert DeviceMesh('cpu', dp_replicate=2, efsdp=2, ep=2; mesh=[[[0, 1], [2, 3]], " \
           "[[4, 5], [6, 7]]])" in out
    views = re.findall(r"^\s+(dp_replicate|efsdp|ep|efsdp x ep)\s+(\[.*?\])\s+(.*)$", out,
                       re.MULTILINE)
    assert views == [("dp_replicate", "[0, 4]", "dense 'dp_replicate' (the same group)"),
                     ("efsdp", "[0, 2]", "new"), ("ep", "[0, 1]", "new"),
                     ("efsdp x ep", "[0, 1, 2, 3]", "dense 'dp_shard' (the same group)")], out
    # 8 tokens x 2 choices: rows to both ep ranks, unevenly (the split sizes are exchanged)
    assert "step 1: rank 0 sends [9, 7] (token, expert) rows to ep ranks [0, 1] and receives " \
           "[9, 9]" in out
    steps = losses(out)
    assert len(steps) == 5 and steps[-1] < 0.5 * steps[0], steps  # it learns
    assert f"one process: loss {steps[0]:.6f} -> {steps[-1]:.6f}" in out
    assert 0 <= moe_diff(out) < MOE_TOLERANCE
    assert "OK: matches single-process training" in out


def test_moe_example_fails_when_expert_gradients_are_averaged_like_dense_ones():
    code, out, err = run_job("--average-expert-grads", "--steps", "2", job=MOE)
    assert code != 0, out
    assert moe_diff(out) > MOE_TOLERANCE
    assert "MISMATCH: trained weights differ from single-process training" in out
    assert err.splitlines()[-1] == "tensorplay-run: all 8 ranks failed alike (exit code 1).", (
        err[-3000:])


# -- examples/heat2d.py: numpy only, the same script on the MPI engine and on gloo -------------
HEAT = "examples/heat2d.py"


def heat_diff(out: str) -> float:
    found = re.findall(r"max abs diff vs one process: (\S+) \(tolerance", out)
    assert len(found) == 1, out
    return float(found[0])


def test_heat2d_on_gloo_matches_one_process():
    done = subprocess.run([sys.executable, "-m", "tensorplay.distributed.run",
                           "--nproc-per-node", "8", HEAT, "--steps", "60"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timing.guard(300),
                          errors="replace")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "on the gloo backend" in done.stdout
    assert heat_diff(done.stdout) <= 1e-12


def test_heat2d_on_the_mpi_engine_matches_one_process():
    from tests.distributed.backends import test_mpi

    if importlib.util.find_spec("mpi4py") is None or test_mpi.MPIEXEC is None:
        pytest.skip("the MPI engine needs mpi4py and mpiexec: pip install -e '.[mpi]'")
    with test_mpi.one_job():
        done = subprocess.run([test_mpi.MPIEXEC, "-n", "8", sys.executable, HEAT, "--steps",
                               "60"], cwd=ROOT, env=test_mpi.job_env(), capture_output=True,
                              text=True, timeout=timing.guard(300), errors="replace",
                              start_new_session=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "on the mpi backend" in done.stdout
    assert heat_diff(done.stdout) <= 1e-12


# -- examples/train_elastic_numpy.py: the elastic loop on numpy arrays ------------------------
def test_the_numpy_elastic_example_survives_a_kill_on_gloo_and_matches_one_process():
    """Rank 5 SIGKILLs itself at step 5: the survivors shrink to (1, 4), tensorplay-run restarts
    it, the mesh grows back to (2, 4) and the weights equal one process's (numpy, float64)."""
    code, out, err = run_job("--kill", "5@4", job=[
        sys.executable, "-m", "tensorplay.distributed.run", "--nproc-per-node", "8",
        "--max-restarts", "1", "examples/train_elastic_numpy.py"])
    assert code == 0, out[-2000:] + err[-3000:]
    assert "recovered: mesh (1, 4) at epoch 1, lost [5]" in out, out
    assert "mesh grew back to (2, 4) at epoch 2; fresh ranks [4, 5, 6, 7]" in out, out
    assert "OK: matches single-process training" in out, out
