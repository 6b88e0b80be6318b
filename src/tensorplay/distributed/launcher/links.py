"""One open connection per launcher to node 0's launcher: a launcher that dies is seen at once.

A heartbeat can only say that a node went quiet, after --node-grace-s. But when a launcher's
process ends (killed, crashed), its kernel closes its sockets: node 0 reads end-of-file on
that launcher's connection within a round trip. So node 0 listens on one more port (an
ephemeral one on --master-addr, published in the job's store under ``keys.NODE_LINKS``);
every other launcher connects after the join and says who it is (``"<node> <claim>\\n"``);
at a clean end it says ``"bye\\n"`` first. End-of-file without a bye means the launcher is
gone. A frozen machine or a cut link closes nothing: the heartbeat judges those.

Worked example, node 1's launcher SIGKILLed at t = 20.00 s: node 0's link thread reads
end-of-file at t = 20.00 s and calls ``gone(1, 1)``; its heartbeat would only have noticed at
t = 30-31 s (grace 10 s). Cost: one socket and no traffic per launcher; one thread on node 0.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from contextlib import suppress

from ..host import netif
from .bugs import guarded

LOOK_S = 0.5  # how often node 0's link thread looks whether it should stop


class Links:
    """Node 0's side: accept one connection per launcher and watch them all. ``gone(node,
    claim)`` is called on the link thread; a bug there is reported and handed to
    ``on_bug`` (``bugs.guarded``)."""

    def __init__(self, addr: str, gone: Callable[[int, int], None],
                 on_bug: Callable[[str, BaseException], None]):
        self.sock = netif.listen(addr, 0)
        self.port = self.sock.getsockname()[1]
        self._gone = gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=guarded("node 0's link watch", self._run, on_bug),
                                        daemon=True, name="tensorplay-run links")
        self._thread.start()

    def _run(self) -> None:
        conns: dict[socket.socket, bytes] = {}  # connection -> what it said so far
        while not self._stop.is_set():
            try:
                ready = select.select([self.sock, *conns], [], [], LOOK_S)[0]
            except (OSError, ValueError):  # closed under us: we are stopping
                return
            for s in ready:
                if s is self.sock:
                    with suppress(OSError):
                        conns[self.sock.accept()[0]] = b""
                    continue
                try:
                    data = s.recv(256)
                except OSError:
                    data = b""
                if data:
                    conns[s] += data
                    continue
                said = conns.pop(s).decode(errors="replace").split()
                s.close()
                if len(said) >= 2 and said[0].isdigit() and said[1].isdigit() and \
                        "bye" not in said[2:]:
                    self._gone(int(said[0]), int(said[1]))

    def close(self) -> None:
        """Stop watching (node 0 is ending)."""
        self._stop.set()
        with suppress(OSError):
            self.sock.close()


class Link:
    """Another node's side: the connection held open to node 0 while the launcher lives."""

    def __init__(self, addr: str, port: int, node: int, claim: int, timeout_s: float):
        self.sock = socket.create_connection((addr, port), timeout=timeout_s)
        self.sock.sendall(f"{node} {claim}\n".encode())

    def bye(self) -> None:
        """A clean end: say so, then close (node 0 then reads no loss into it)."""
        with suppress(OSError):
            self.sock.sendall(b"bye\n")
        self.close()

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()
