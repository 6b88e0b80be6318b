"""Jobs started by a running Slurm (tests/slurm.py): srun, sbatch, scancel, the time limit.

On one host the cluster is this machine; on two, network-namespace hosts hostA and hostB
(tests/netns.py) each run a slurmd, and every Slurm command runs on hostA, as on a login node.
Each test starts its ranks through Slurm, as a user would, and reads what Slurm and the
launcher printed.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tensorplay.distributed.host.slurm import hostnames
from tests import netns, slurm, spawn, timing
from tests.distributed.host.test_slurm import SCONTROL_SAYS

pytestmark = pytest.mark.slow  # a cluster each (about 1 s) and jobs through it; the daily tier
# has the same logic without Slurm: host/test_slurm.py, launcher/test_slurm_step.py
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = str(ROOT / "examples" / "train_dp_tp.py")
RUN = [sys.executable, "-m", "tensorplay.distributed.run"]
MATCHES = "[rank 0] OK: matches single-process training"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One node: this machine, 8 CPUs as Slurm counts them."""
    slurm.require()
    with slurm.Cluster(tmp_path_factory.mktemp("slurm-one")) as c:
        yield c


def two_host_cluster(tmp: Path) -> Iterator[slurm.Cluster]:
    """Two nodes: hostA (slurmctld, slurmd, the commands) and hostB (slurmd), 4 CPUs each."""
    slurm.require()
    netns.require()
    with netns.Hosts(2) as hosts, slurm.Cluster(tmp, hosts, cpus=4) as c:
        yield c


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    yield from two_host_cluster(tmp_path_factory.mktemp("slurm-two"))


@pytest.fixture
def two_hosts_to_lose(tmp_path_factory):
    """Two nodes of a cluster of its own: the test kills one."""
    yield from two_host_cluster(tmp_path_factory.mktemp("slurm-lose"))


def batch(c: slurm.Cluster, tmp: Path, body: str, *flags: str) -> tuple[int, Path]:
    """Submit a batch script; its job id and output file."""
    script, out = tmp / "job.sh", tmp / "job.out"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    done = c.run(["sbatch", "--parsable", "-o", str(out), "-D", str(tmp), *flags, str(script)])
    return int(done.stdout.strip().split(";")[0]), out


def sleeping_job(c: slurm.Cluster, tmp: Path, srun_flags: str, *flags: str
                 ) -> tuple[int, Path]:
    """A batch job of one launcher per task, 2 ranks each, that say they are up (and on which
    host), then sleep for 2 minutes: a job to cancel."""
    (tmp / "job.py").write_text(textwrap.dedent("""
        import os, socket, time
        print(f"rank {os.environ['RANK']} up on {socket.gethostname()}", flush=True)
        time.sleep(120)
    """))
    return batch(c, tmp, f"srun {srun_flags} {' '.join(RUN)} --nproc-per-node 2 --no-warm "
                 "job.py\n", *flags)


def await_text(c: slurm.Cluster, out: Path, pattern: str, within_s: float) -> str:
    """Wait until the job's output matches ``pattern``; the output."""
    def seen() -> bool:
        return out.exists() and re.search(pattern, out.read_text(errors="replace")) is not None

    assert timing.wait_until(seen, within_s), \
        f"{pattern!r} not within {within_s:g} s:\n{out.read_text() if out.exists() else ''}" \
        f"\n{c.logs()}"
    return out.read_text(errors="replace")


def await_end(c: slurm.Cluster, job_id: int, within_s: float) -> dict[str, str]:
    """Wait until Slurm has finished the job; its last fields."""
    assert timing.wait_until(lambda: job_id not in c.jobs(), within_s), \
        f"job {job_id} still in the queue after {within_s:g} s:\n{c.logs()}"
    return c.job_state(job_id)


def left_by_jobs(c: slurm.Cluster) -> list[int]:
    """The cluster's processes that belong to a job (SLURM_JOB_ID in their environment: a
    batch script, a task, a rank): what a finished job left behind."""
    return [pid for pid in c.marked() if "SLURM_JOB_ID" in procfs.environ(pid)]


# --- one host -----------------------------------------------------------------------------


def test_node_lists_expand_as_scontrol_expands_them(cluster):
    for nodelist in SCONTROL_SAYS:
        said = cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert list(hostnames(nodelist)) == said, nodelist


def test_a_node_rank_that_contradicts_the_step_is_refused_on_every_task(cluster, tmp_path):
    # srun ... --node-rank $SLURM_NODEID in a batch script: every launcher gets 0
    (tmp_path / "job.py").write_text("print('ran')\n")
    start = time.monotonic()
    done = cluster.run(["srun", "-n", "2", *RUN, "--node-rank", "0", "job.py"], check=False,
                       cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode != 0
    said = (r"--node-rank=0: contradicts the Slurm step: srun started 2 launchers in step "
            r"(\d+)\.0 \(SLURM_STEP_NUM_TASKS=2\), this one task 1 \(SLURM_PROCID\); ")
    task_1 = re.search(rf"tensorplay-run: error: {said}.* Node 0 was told, through its store "
                       rf"at {cluster.nodes[0]}:\d+\.", done.stderr)
    assert task_1 is not None, done.stderr
    node_0 = re.search(rf"tensorplay-run: error: node 1 \(task 1 of Slurm step \d+\.0\) "
                       rf"refused to join: {said}", done.stderr)  # task 0 agrees, and is told
    assert node_0 is not None, done.stderr
    assert "ran" not in done.stdout
    assert took < timing.bound(0, 30)  # not node 0's --join-timeout-s (300 s)


def test_one_launcher_per_task_forms_one_job(cluster, tmp_path):
    done = cluster.run(["srun", "-n", "2", *RUN, "--nproc-per-node", "4", EXAMPLE,
                        "--steps", "2"], timeout=180, cwd=tmp_path)
    assert done.stdout.count(MATCHES) == 1, done.stdout + done.stderr


def test_scancel_reaches_every_rank_and_the_last_line_names_it(cluster, tmp_path):
    job_id, out = sleeping_job(cluster, tmp_path, "", "--ntasks", "2")
    await_text(cluster, out, r"(?s)rank \d up.*rank \d up.*rank \d up.*rank \d up", 60)
    start = time.monotonic()
    cluster.run(["scancel", str(job_id)])
    fields = await_end(cluster, job_id, slurm.KILL_WAIT_S + 20)
    took = time.monotonic() - start
    text = out.read_text()
    launcher_lines = [ln for ln in text.splitlines() if ln.startswith("tensorplay-run:")]
    assert len(launcher_lines) >= 2, text
    for line in launcher_lines[-2:]:
        assert re.fullmatch(rf"tensorplay-run: got SIGTERM \(Slurm cancelled job {job_id} "
                            r"\(scancel\), \d+ s after it started\); stopped ranks [0-3]-[0-3]\.",
                            line), text
    assert "failed" not in text, text
    assert fields["JobState"] == "CANCELLED", fields
    assert took < timing.bound(0, slurm.KILL_WAIT_S + 10)
    assert left_by_jobs(cluster) == []


def test_scancel_signal_usr1_warns_every_rank_and_the_job_goes_on(cluster, tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, signal, time
        warned = []
        signal.signal(signal.SIGUSR1, lambda *_: warned.append(1))
        print(f"rank {os.environ['RANK']} up", flush=True)
        deadline = time.monotonic() + 60
        while not warned and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"rank {os.environ['RANK']} warned: {bool(warned)}", flush=True)
    """))
    job_id, out = batch(cluster, tmp_path, f"srun -n 1 {' '.join(RUN)} --nproc-per-node 2 "
                        "--no-warm job.py\n")
    await_text(cluster, out, r"(?s)rank \d up.*rank \d up", 60)
    cluster.run(["scancel", "--signal=USR1", str(job_id)])
    fields = await_end(cluster, job_id, 60)
    text = out.read_text()
    assert "rank 0 warned: True" in text and "rank 1 warned: True" in text, text
    assert "tensorplay-run: got SIGUSR1; passed it to ranks 0-1; the job goes on." in text, text
    assert fields["JobState"] == "COMPLETED", (fields, text)


def test_the_time_limit_warns_with_signal_usr1_then_stops_naming_the_limit(cluster, tmp_path):
    # Slurm's limits are in minutes and slurmctld checks them every 30 s: 60-90 s
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, signal, time
        signal.signal(signal.SIGUSR1, lambda *_: print("warned: time is nearly up", flush=True))
        print(f"rank {os.environ['RANK']} up", flush=True)
        time.sleep(300)
    """))
    job_id, out = batch(cluster, tmp_path, f"srun -n 1 {' '.join(RUN)} --nproc-per-node 1 "
                        "--no-warm job.py\n", "--time=1", "--signal=USR1@55")
    await_text(cluster, out, "warned: time is nearly up", 90)
    fields = await_end(cluster, job_id, 150)
    text = out.read_text()
    assert re.search(rf"tensorplay-run: got SIGTERM \(job {job_id} reached its time limit "
                     r"\(00:01:00\)\); stopped rank 0\.", text), text
    assert fields["JobState"] == "TIMEOUT", fields
    assert left_by_jobs(cluster) == []


# --- the MPI engine, without torch ----------------------------------------------------------

HEAT = str(ROOT / "examples" / "heat2d.py")
HEAT_OK = "OK: matches the one-process solver"
OPEN_MPI_PYTHON = os.environ.get("TENSORPLAY_TEST_OPENMPI_PYTHON", "")


def without_torch(c: slurm.Cluster, tmp: Path) -> None:
    """The cluster's jobs from now on see no torch: the MPI engine is their one engine."""
    c.env["PYTHONPATH"] = f"{spawn.without(tmp, 'torch')}{os.pathsep}{c.env['PYTHONPATH']}"


@pytest.fixture
def numpy_only(tmp_path_factory):
    """One node whose jobs see no torch (a cluster of its own: the env is the cluster's)."""
    slurm.require()
    with slurm.Cluster(tmp_path_factory.mktemp("slurm-mpi")) as c:
        without_torch(c, tmp_path_factory.mktemp("no-torch"))
        yield c


def test_mpich_runs_under_srun_mpi_pmi2(numpy_only, tmp_path):
    done = numpy_only.run(["srun", "--mpi=pmi2", "-n", "8", sys.executable, HEAT], timeout=180,
                          cwd=tmp_path)
    assert HEAT_OK in done.stdout and "on the mpi backend" in done.stdout, done.stdout


def test_srun_without_mpi_wire_up_is_refused_naming_the_flag(numpy_only, tmp_path):
    done = numpy_only.run(["srun", "-n", "2", sys.executable, HEAT], check=False, timeout=120,
                          cwd=tmp_path)
    assert done.returncode != 0
    for rank in (0, 1):
        assert (f"LaunchEnvError: init_process_group('mpi'): srun says rank {rank} of 2 "
                "(SLURM_PROCID, SLURM_NTASKS), but MPI sees a world of 1") in done.stderr, \
            done.stderr
    assert "Fix: srun --mpi=pmi2 -n 2 python " in done.stderr, done.stderr
    assert "MPICH" in done.stderr


def test_open_mpi_runs_under_srun_mpi_pmix(numpy_only, tmp_path):
    if not OPEN_MPI_PYTHON:
        pytest.skip("needs TENSORPLAY_TEST_OPENMPI_PYTHON: a Python with the [openmpi] extra "
                    "(.ci/run makes one)")
    plugins = numpy_only.run(["srun", "--mpi=list"], check=False)
    probe = numpy_only.run(["srun", "--mpi=pmix", "-n", "1", "true"], check=False)
    if "pmix" not in plugins.stdout + plugins.stderr or probe.returncode != 0:
        pytest.skip(f"this Slurm cannot load its pmix plugin ({probe.stderr.strip()[-200:]}): "
                    "apt-get install libpmix-dev (.ci/run does)")
    done = numpy_only.run(["srun", "--mpi=pmix", "-n", "8", OPEN_MPI_PYTHON, HEAT],
                          timeout=180, cwd=tmp_path)
    assert HEAT_OK in done.stdout and "on the mpi backend" in done.stdout, done.stdout


# --- two hosts ----------------------------------------------------------------------------


def test_srun_starts_the_ranks_itself_across_two_hosts(two_hosts, tmp_path):
    done = two_hosts.run(["srun", "-N", "2", "--ntasks-per-node", "4", sys.executable, EXAMPLE,
                          "--steps", "2"], timeout=240, cwd=tmp_path)
    assert "\nOK: matches single-process training\n" in done.stdout, done.stdout + done.stderr


def test_a_two_host_batch_job_trains_and_matches_one_process(two_hosts, tmp_path):
    job_id, out = batch(two_hosts, tmp_path, f"srun --ntasks-per-node 1 {' '.join(RUN)} "
                        f"--nproc-per-node 4 {EXAMPLE} --steps 2\n", "-N", "2")
    fields = await_end(two_hosts, job_id, 240)
    text = out.read_text()
    assert text.count(MATCHES) == 1, text + two_hosts.logs()
    assert fields["JobState"] == "COMPLETED", fields
    assert fields["NodeList"] == "hostA,hostB", fields


def test_scancel_of_a_two_host_job_leaves_nothing_on_either_host(two_hosts, tmp_path):
    job_id, out = sleeping_job(two_hosts, tmp_path, "--ntasks-per-node 1", "-N", "2")
    text = await_text(two_hosts, out, r"(?s)(rank \d up on host[AB].*){4}", 90)
    assert "up on hostA" in text and "up on hostB" in text, text
    two_hosts.run(["scancel", str(job_id)])
    fields = await_end(two_hosts, job_id, slurm.KILL_WAIT_S + 20)
    text = out.read_text()
    said = f"got SIGTERM (Slurm cancelled job {job_id} (scancel)"
    lines = [ln for ln in text.splitlines() if ln.startswith("tensorplay-run:")]
    assert len([ln for ln in lines if said in ln]) >= 2, text  # each launcher, or the other
    # launcher for it: "node 1 (hostB, ranks 2-3) got SIGTERM (Slurm cancelled job ...)"
    assert said in lines[-1] and "lost" not in text, text
    assert fields["JobState"] == "CANCELLED", fields
    assert left_by_jobs(two_hosts) == []


def test_a_node_lost_under_srun_no_kill_the_other_trains_on(two_hosts_to_lose, tmp_path):
    """hostB killed whole (its slurmd, the step's processes, the ranks) at step 3 of an elastic
    job: hostA's ranks shrink to (1, 4) at once and train to the end; Slurm marks hostB DOWN
    after SlurmdTimeout and, with --no-kill, keeps the job (its batch script waits, bounded,
    until the test has seen the node DOWN and the job still RUNNING)."""
    c = two_hosts_to_lose
    elastic = str(ROOT / "examples" / "train_elastic.py")
    seen = tmp_path / "seen"  # the test saw hostB DOWN and the job RUNNING
    job_id, out = batch(c, tmp_path, f"""\
        srun --no-kill --ntasks-per-node 1 {' '.join(RUN)} --nproc-per-node 4 --max-restarts 1 \\
            {elastic} --steps 20 --step-s 0.5
        echo "the step ended: $?"
        for i in $(seq 600); do [ -e {seen} ] && break; sleep 0.2; done
    """, "-N", "2", "--no-kill")
    await_text(c, out, r"\[rank 0\] step 3/20", 240)
    killed_at = time.monotonic()
    assert c.kill_host(2), "no process of the cluster was on hostB"
    await_text(c, out, r"\[rank 0\] step \d+/20  mesh \(1, 4\)", 60)
    shrunk_s = time.monotonic() - killed_at

    def node_b_down() -> bool:
        return "DOWN" in c.run(["sinfo", "-h", "-n", "hostB", "-o", "%T"]).stdout.upper()

    assert timing.wait_until(node_b_down, timing.bound(slurm.NODE_DOWN_S, 30)), c.logs()
    running = c.job_state(job_id)["JobState"]
    seen.write_text("")
    fields = await_end(c, job_id, 120)
    text = out.read_text()
    assert shrunk_s < timing.bound(0, 10), f"{shrunk_s:.1f} s\n{text}"
    assert "tensorplay-run: node 1 (hostB, ranks 4-7) is lost: its launcher is gone" in text, text
    assert "[rank 0] OK: matches single-process training" in text, text
    assert running == "RUNNING", (running, text)  # Slurm kept the job with a node DOWN
    node = c.run(["scontrol", "show", "node", "hostB", "-o"]).stdout
    assert "Reason=Not responding" in node, node
    # what Slurm says: srun ends with the status of the task it lost (SIGKILL: 137), though
    # hostA's ranks trained on ("srun: error: Node failure on hostB" too, when the node was
    # declared DOWN while the step still ran)
    assert "the step ended: 137" in text, text
    assert fields["JobState"] == "COMPLETED", fields  # the batch script's own end
