"""Several hosts on one machine: Linux network namespaces joined by a virtual switch.

``with Hosts(2) as hosts:`` makes host 1 and host 2, each a network namespace with its own
address (198.18.0.1, 198.18.0.2: the range set aside for such tests) on a veth pair to a bridge
in a third namespace, and each process started on it gets its own host name (a UTS namespace:
"hostA", "hostB"). ``hosts.start(i, argv)`` starts a process there in a new session, with a
TMPDIR of that host's own; ``hosts.cut(i)`` takes host i's link down. ``hosts.command(i, argv,
names)`` is the command line that runs ``argv`` there; with ``names``
(``hosts.write_names(path)``: every host's name and address) the hosts' names resolve there, for
programs that are given names, not addresses (Slurm's node lists): it enters only the network
namespace (``nsenter``, so /sys and its cgroups stay, which slurmd needs) and mounts that file
over /etc/hosts in a mount namespace of its own. On the way out, even after a failure, every
process started is killed by its process group, every namespace is deleted and the hosts'
TMPDIRs removed: nothing is left behind.

Needs root and iproute2 (CI runs as root); elsewhere ``require()`` skips the test and says why.
No traffic goes anywhere but these namespaces and loopback.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs

SUBNET = "198.18.0"
# a host starts with no network settings but those a test gives it
NETWORK_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")
NAMES = "ABCDEFGH"
_COUNT = itertools.count()


def require() -> None:
    """Skip the calling test, saying why, where namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("multi-host tests make network namespaces, which needs root (CI runs as "
                    "root)")
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"multi-host tests need '{tool}' (iproute2, util-linux)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """``count`` hosts on a virtual switch; use as a context manager."""

    def __init__(self, count: int):
        self.count = count
        # the worker's pid and a count: two Hosts of one process at once never share a name
        # (an interface name is at most 15 characters: 'tp12345x7h1' is 11)
        self.prefix = f"tp{os.getpid() % 100000}x{next(_COUNT) % 100}"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self.tmp: Path | None = None  # each host's TMPDIR below it: made on entry

    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    def hostname(self, i: int) -> str:
        return f"host{NAMES[i - 1]}"

    def __enter__(self) -> Hosts:
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f"tensorplay-test-{self.prefix}-"))
            switch = f"{self.prefix}sw"
            _ip("netns", "add", switch)
            self._made.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i in range(1, self.count + 1):
                host, port = self.ns(i), f"{self.prefix}s{i}"
                _ip("netns", "add", host)
                self._made.append(host)
                _ip("link", "add", host, "type", "veth", "peer", "name", port)
                _ip("link", "set", host, "netns", host)
                _ip("link", "set", port, "netns", switch)
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
                _ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", host)
                _ip("-n", host, "link", "set", host, "up")
                _ip("-n", host, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def write_names(self, path: Path) -> Path:
        """Write a hosts file naming every host (198.18.0.1 hostA, ...) and localhost."""
        lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {self.hostname(i)}"
                                           for i in range(1, self.count + 1)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def command(self, i: int, argv: list[str], names: Path | None = None) -> list[str]:
        """The command line that runs ``argv`` on host i (its own network and host name;
        with ``names``, that hosts file as its /etc/hosts: see the module)."""
        script = f'hostname {self.hostname(i)} && exec "$@"'
        if names is None:
            return ["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "sh", "-c", script,
                    "sh", *argv]
        script = f'mount --bind {names} /etc/hosts && {script}'
        return ["nsenter", f"--net=/run/netns/{self.ns(i)}", "unshare", "--uts", "--mount",
                "sh", "-c", script, "sh", *argv]

    def start(self, i: int, argv: list[str], log: Path, env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        """Run ``argv`` on host i (its own network and host name), output to ``log``. Its
        TMPDIR is the host's own, removed with the hosts: what a process killed there leaves
        (a SIGKILLed launcher's work directory) goes with them, as with a lost machine."""
        assert self.tmp is not None, "start() before entering the Hosts"
        tmpdir = self.tmp / self.hostname(i)
        tmpdir.mkdir(exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(i, argv),
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**{k: v for k, v in os.environ.items() if k not in NETWORK_VARS},
                     "TMPDIR": str(tmpdir), **(env or {})})
        self.procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Take host i's link to the switch down: its packets go nowhere."""
        _ip("-n", f"{self.prefix}sw", "link", "set", f"{self.prefix}s{i}", "down")

    def wait_all(self, timeout: float) -> list[int | None]:
        """Exit codes of every process started, waiting up to ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def close(self) -> None:
        """Kill what was started and what it started (by pid), then delete the namespaces."""
        pids = [p.pid for p in self.procs]
        for pid in pids + [d for p in pids for d in procfs.descendants(p)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def logs(tmp: Path) -> str:
    """Every ``*.log`` of ``tmp``, each under its name: what a failed test prints."""
    return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')}"
                     for p in sorted(tmp.glob("*.log")))


def await_line(log: Path, pattern: str, hosts: Hosts, limit_s: float, watched: int = 0
               ) -> float:
    """Wait until ``log`` has a line matching ``pattern``; the time.monotonic() it was seen.
    Fails naming every log when the process ``watched`` (the first started, by default)
    ended first or ``limit_s`` ran out."""
    from tests import timing

    deadline = time.monotonic() + limit_s
    while not re.search(pattern, log.read_text(errors="replace"), re.MULTILINE):
        assert hosts.procs[watched].poll() is None, f"{pattern}\n{logs(log.parent)}"
        assert time.monotonic() < deadline, \
            f"{pattern}: not within {limit_s:.0f} s ({timing.describe()})\n{logs(log.parent)}"
        time.sleep(0.1)
    return time.monotonic()
