"""A Slurm cluster of the tests' own: munged, slurmctld and slurmd, started and stopped by pid.

``with Cluster(tmp) as c:`` starts, in the directory ``tmp``, a munge daemon with a key of its
own, a slurmctld and one slurmd for a node named after this machine (its name resolves here),
on free ports of 127.0.0.1, and waits until ``sinfo`` calls the node idle (about 3 s).
``with Cluster(tmp, hosts) as c:`` does the same across network-namespace hosts
(``netns.Hosts(n)``): one slurmd per host (hostA, hostB, ... at 198.18.0.x),
slurmctld beside hostA's, and every client command on hostA. ``c.run(argv)`` runs srun,
sbatch, scancel, squeue or scontrol there with ``SLURM_CONF`` set; ``c.start(argv, log)`` starts
one in the background. Jobs get a TMPDIR of the cluster's (Open MPI's session directories,
a killed launcher's work directory: gone with the cluster).

Nothing touches /etc/slurm or the machine's munge: the daemons read the files written here.
On the way out, even after a failure, every job is cancelled (and waited for, bounded), then
every process the cluster started is killed by pid: the daemons, and whatever still carries the
cluster's mark in its environment (slurmstepd inherits slurmd's, a task srun's ``SLURM_CONF``);
then the directory goes. ``require()`` skips the calling test, saying why, where Slurm or munge
is missing or the test is not root (slurmd runs jobs as their user; CI installs both and runs
as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tests import netns, spawn, timing

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "squeue", "sinfo",
         "scontrol")
MARK = "TENSORPLAY_TEST_SLURM"  # every process of one cluster carries MARK=<its directory>
IDLE_S = 30.0  # from start to every node idle: about 3 s here
KILL_WAIT_S = 5  # Slurm's KillWait: SIGTERM, then SIGKILL this much later (default 30)
NODE_DOWN_S = 6  # Slurm's SlurmdTimeout: a silent slurmd's node is DOWN after this (300)

CONF = """\
ClusterName=tp{tag}
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/socket
CredType=cred/munge
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/ctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/ctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait={kill_wait}
SlurmdTimeout={node_down}
InactiveLimit=0
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def require() -> None:
    """Skip the calling test, saying why, where a Slurm cluster cannot run here."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} not on PATH): apt-get install "
                    "slurm-wlm munge (.ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of the tests' own runs slurmd, which starts jobs as "
                    "their user: it needs root (CI runs as root)")


class Cluster:
    """munged + slurmctld + one slurmd per node; use as a context manager."""

    def __init__(self, tmp: Path, hosts: netns.Hosts | None = None, cpus: int = 8):
        self.dir = Path(tmp) / "slurm"
        self.hosts = hosts
        self.cpus = cpus
        self.conf = self.dir / "slurm.conf"
        self.names = self.dir / "hosts"  # the hosts' /etc/hosts: hostA, hostB resolve
        self.daemons: list[subprocess.Popen] = []
        self.nodes = ([socket.gethostname()] if hosts is None else
                      [hosts.hostname(i) for i in range(1, hosts.count + 1)])
        self.env = {k: v for k, v in os.environ.items()  # as a login shell has it: no
                    if not k.startswith("SLURM") and k not in netns.NETWORK_VARS}  # job's
        self.env |= {"SLURM_CONF": str(self.conf), MARK: str(self.dir),
                     "PYTHONPATH": spawn.pythonpath(), "TMPDIR": str(self.dir / "tmp")}

    # --- start -----------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        require()
        try:
            self.dir.mkdir(parents=True)
            if self.hosts is not None:
                self.hosts.write_names(self.names)
            self._write_conf()
            self._start_munge()
            self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "ctld", 1)
            for i, node in enumerate(self.nodes, 1):
                self._daemon(["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                             f"slurmd-{node}", i)
            self._await_idle()
        except BaseException:
            self.close()
            raise
        return self

    def _write_conf(self) -> None:
        if self.hosts is None:
            addrs = ["127.0.0.1"]
            ctld_port, slurmd_port = spawn.free_port(), spawn.free_port()
        else:
            addrs = [self.hosts.address(i) for i in range(1, self.hosts.count + 1)]
            ctld_port, slurmd_port = 6817, 6818  # the namespaces' own ports
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                          for n, a in zip(self.nodes, addrs, strict=True))
        self.conf.write_text(CONF.format(
            tag=os.getpid() % 100000, ctld_host=self.nodes[0], ctld_addr=addrs[0],
            ctld_port=ctld_port, slurmd_port=slurmd_port, dir=self.dir, nodes=nodes,
            kill_wait=KILL_WAIT_S, node_down=NODE_DOWN_S))
        for sub in ("ctld", "munge", "tmp", *(f"spool/{n}" for n in self.nodes)):
            (self.dir / sub).mkdir(parents=True)

    def _start_munge(self) -> None:
        """munged with a key of its own, on a socket of its own (AuthInfo names it)."""
        munge = self.dir / "munge"
        munge.chmod(0o711)  # clients reach the socket; the key stays 0400
        (munge / "key").write_bytes(os.urandom(1024))
        (munge / "key").chmod(0o400)
        log = open(munge / "munged.log", "wb")  # noqa: SIM115 - closed with the cluster
        self.daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={munge}/key",
             f"--socket={munge}/socket", f"--pid-file={munge}/pid",
             f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True))
        log.close()
        if not timing.wait_until(lambda: (munge / "socket").exists(), 10):
            raise RuntimeError(f"munged made no socket within 10 s:\n{self.logs()}")

    def _daemon(self, argv: list[str], name: str, host: int) -> None:
        """Start a Slurm daemon in the foreground (-D) on host ``host``; its output to a log."""
        argv = argv if self.hosts is None else self.hosts.command(host, argv, self.names)
        with open(self.dir / f"{name}.out", "wb") as out:
            self.daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                 env=self.env, start_new_session=True))

    def _await_idle(self) -> None:
        deadline = time.monotonic() + timing.bound(0, IDLE_S)
        states: list[str] = []
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{self.logs()}")
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = done.stdout.split()[1::2]
            if done.returncode == 0 and len(states) == len(self.nodes) \
                    and all(s == "idle" for s in states):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle within {IDLE_S:g} s (states {states}):\n"
                           f"{self.logs()}")

    # --- use -------------------------------------------------------------------------------

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on the submit host (hostA, or this machine)."""
        return argv if self.hosts is None else self.hosts.command(1, argv, self.names)

    def run(self, argv: list[str], check: bool = True, timeout: float = 60,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sbatch, ...) on the submit host to its end."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True, env=self.env,
                              timeout=timing.bound(0, timeout), cwd=cwd)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n"
                                 f"{done.stderr}\n{self.logs()}")
        return done

    def start(self, argv: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
        """Start a client command (an interactive srun) on the submit host, output to ``log``."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=cwd, start_new_session=True)
        self.daemons.append(proc)  # stopped with the cluster, should the test not end it
        return proc

    def job_state(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields of one job."""
        line = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    def jobs(self) -> list[int]:
        """The ids of the jobs Slurm still knows as pending, running or completing."""
        done = self.run(["squeue", "-h", "-o", "%i"], check=False)
        return [int(j) for j in done.stdout.split() if j.isdigit()]

    def await_gone(self, within_s: float) -> bool:
        """Wait until no job is left in the queue (True), at most ``within_s``."""
        return timing.wait_until(lambda: not self.jobs(), within_s)

    def marked(self) -> list[int]:
        """Every live process that carries this cluster's mark (``MARK``): daemons, steps,
        tasks. Found by pid through /proc, so another cluster's are never touched."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid() \
                    and procfs.environ(int(entry.name)).get(MARK) == str(self.dir):
                found.append(int(entry.name))
        return found

    def on_host(self, i: int) -> list[int]:
        """The cluster's processes on host i (its network namespace): its slurmd, the steps,
        tasks and ranks there."""
        assert self.hosts is not None, "one host: every process is on it"
        ns = os.stat(f"/run/netns/{self.hosts.ns(i)}").st_ino
        found = []
        for pid in self.marked():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}/ns/net").st_ino == ns:
                    found.append(pid)
        return found

    def kill_host(self, i: int) -> list[int]:
        """Host i lost whole, as a kernel panic leaves it: SIGKILL to every process of the
        cluster there, its slurmd too (by pid); the pids killed."""
        pids = self.on_host(i)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def logs(self) -> str:
        """Every log of the cluster, each under its name: what a failed test prints."""
        paths = sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")) + \
            sorted(self.dir.glob("munge/*.log"))
        return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in paths)

    # --- stop ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job (bounded), kill every process of the cluster by pid, remove its
        directory."""
        alive = all(p.poll() is None for p in self.daemons[:2])
        if alive and self.conf.exists():
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                jobs = self.jobs()
                if jobs:
                    self.run(["scancel", *map(str, jobs)], check=False)
                    self.await_gone(KILL_WAIT_S + 10)
        for proc in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for _ in range(3):  # whatever is left: steps, tasks, their children
            left = self.marked() + [p.pid for p in self.daemons if p.poll() is None]
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            timing.wait_until(lambda: not self.marked(), 5)
        for proc in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()
