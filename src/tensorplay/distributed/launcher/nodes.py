"""tensorplay-run across nodes: node 0 serves the job's store; launchers meet, watch each other
and stop together.

Node 0's launcher serves the job's store (torch's TCPStore, bound to --master-addr only), as
torchrun's agent does, so rank 0's process is an ordinary rank and the store outlives any rank.
Every rank connects to it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own
switch, so plain torch.distributed scripts work too). On one node the store is served only
once a rank connects (``serve_when_asked``). Through that store the launchers

1. **join** (``join``): each claims its --node-rank and posts its host name and
   --nproc-per-node; all wait until every node has, and check they agree;
2. **beat** (``heartbeat``): a beat a second; a node silent past --node-grace-s is lost, and
   node 0 sees a launcher that died at once, by its connection closing (``links``);
3. **stop together** (``verdicts``): the first verdict posted wins; every launcher reads it at
   its next beat and stops its ranks. In elastic mode a lost node other than 0 is news
   instead (``roster``), and the job goes on.

``JobNodes`` ties them: it owns the store's server, the roster, the verdicts and the
heartbeat of this launcher. Example verdicts (each launcher prints it after
``tensorplay-run: ``)::

    node 1 (hostB, ranks 4-7) went silent: no heartbeat for 10.4 s (limit 10 s, --node-grace-s)
    nodes disagree on --nproc-per-node: node 0 (hostA) 4, node 1 (hostB) 2
    node 1 was claimed twice (--node-rank 1 on hostB and on hostC)
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from contextlib import suppress

from ..host import netif
from . import bugs, store
from .heartbeat import Heartbeat
from .join import JoinError, join
from .links import Link, Links
from .liveness import Liveness
from .roster import Node, NodeChange, NodeFlags, Roster
from .store import CALL_S, Client, LauncherStore, StoreGone
from .verdicts import Verdict, Verdicts


class JobNodes:
    """This launcher among the job's nodes: serves the store (node 0, or the one node),
    joins, watches, and stands by one verdict; what ``main`` and ``Job`` call."""

    def __init__(self, flags: NodeFlags):
        self.flags = flags
        self.index = flags.index
        self.roster = Roster(flags.nnodes, flags.nproc)
        self.verdicts = Verdicts(flags.index)
        self.heartbeat: Heartbeat | Liveness = Heartbeat(flags, self.roster, self.verdicts,
                                                         self._connect, self._fail)
        self.claim = 1  # this launcher's claim of its node index (2: it replaced a lost one)
        self.client: Client | None = None  # the main thread's client, once joined
        self.links: Links | None = None  # node 0: a connection per launcher
        self.held: list[Link] = []  # the connections node 0 (under etcd, each store member)
        # watches
        self.server: LauncherStore | None = None  # node 0: the store's server (lives as long
        # as the launcher)
        self._wake = os.pipe()  # serve_when_asked waits on it too

    @property
    def verdict(self) -> Verdict | None:
        """The verdict that stands (None while the job goes on)."""
        return self.verdicts.verdict

    def _connect(self) -> Client:
        return store.connect(self.flags.addr, self.flags.port, time.monotonic() + CALL_S, CALL_S)

    # ---------------------------------------------------------------- serving the store

    def bind(self) -> socket.socket:
        """Node 0: the socket the job's store will be served on (JoinError when it cannot)."""
        addr, port = self.flags.addr, self.flags.port
        try:
            return netif.listen(addr, port)
        except OSError as err:
            raise JoinError(
                f"cannot serve the job's store on {addr}:{port}: {err.strerror}. "
                f"Fix: pass --master-addr an address of this machine and a free --master-port"
            ) from None

    def serve(self, listener: socket.socket | None = None) -> None:
        """Node 0: serve the job's store on ``listener`` (default: bind one now)."""
        listener = listener or self.bind()
        self.server = store.serve(listener, self.flags.addr, self.flags.port,
                                  max(self.flags.join_timeout_s, 60.0))

    def serve_when_asked(self) -> None:
        """One node: bind now, but load torch and serve only once a rank connects (a script
        that never uses the store never pays for torch in the launcher). The first
        connection waits in the socket's backlog meanwhile. ``stop_asking()`` ends the wait."""
        listener = self.bind()
        try:
            ready = select.select([listener.fileno(), self._wake[0]], [], [])[0]
            if listener.fileno() in ready:
                self.serve(listener)
                return
        except OSError:  # interrupted, or the wake pipe closed: no store was asked for
            pass
        listener.close()

    def stop_asking(self) -> None:
        """End ``serve_when_asked``'s wait, if no rank has connected yet."""
        with suppress(OSError):
            os.write(self._wake[1], b"x")

    # ---------------------------------------------------------------- join, watch, leave

    def join(self) -> None:
        """Claim this node, wait for all of them and check they agree; JoinError if not."""
        deadline = time.monotonic() + self.flags.join_timeout_s
        if self.index == 0 and self.server is None:
            self.serve()
        joined = join(self.flags, self.roster, self.verdicts, deadline, self._open_links)
        self.client, self.claim, self.links, self.held = (joined.client, joined.claim,
                                                          joined.links, joined.held)

    def _open_links(self) -> Links:
        return Links(self.flags.addr, self.heartbeat.launcher_gone, self._fail)

    def watch(self, on_verdict: Callable[[Verdict], None],
              on_change: Callable[[NodeChange], None] = lambda c: None) -> None:
        """Start beating and watching; ``on_verdict`` is called once, from the heartbeat
        thread (or node 0's link thread); ``on_change`` (elastic mode) for each node lost or
        back."""
        self.verdicts.on_verdict = on_verdict
        self.heartbeat.start(self.claim, on_change)

    def post(self, kind: str, text: str) -> Verdict:
        """Post a verdict unless one was posted before; return the one that stands."""
        return self.verdicts.post(self.client, kind, text)

    def await_verdict(self, within_s: float) -> Verdict | None:
        """The verdict that stands, waiting up to ``within_s`` for another launcher's."""
        if self.client is None:
            return self.verdicts.verdict
        return self.verdicts.await_verdict(self.client, within_s)

    @property
    def rank_store(self) -> str:
        """What the ranks get in ``TENSORPLAY_RUN_STORE`` ("": they are clients of node 0's
        store, torchrun's way)."""
        return ""

    def keeps_store_up(self) -> bool:
        """Whether this launcher serves the store the others use, and so waits for them at
        the end (node 0)."""
        return self.index == 0

    def beat_done(self) -> None:
        """This launcher is ending: say so (node 0 then stops watching it and may close)."""
        for link in self.held:
            link.bye()
        if self.index != 0 and self.client is not None:
            self.heartbeat.done(self.client)

    def await_others(self, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Node 0, its ranks ended: serve the store until every other node is done (True;
        ``Heartbeat.await_others``)."""
        assert self.client is not None, "await_others() before join()"
        return self.heartbeat.await_others(self.client, interrupted)

    def close(self) -> None:
        """Stop beating; drop the clients and the server (node 0 stops serving)."""
        self.heartbeat.stop()
        if self.links is not None:
            self.links.close()
        for link in self.held:
            link.close()
        self.client = self.server = None
        for fd in self._wake:
            with suppress(OSError):
                os.close(fd)

    def own_name(self) -> str:
        """This node as the others' lines name it: 'node 1 (hostB, ranks 4-7)'."""
        f = self.flags
        return Node(f.index, f.host, f.nproc, f.nnodes).name()

    def _fail(self, where: str, err: BaseException) -> None:
        """A launcher thread hit a bug (``bugs.guarded`` printed it): the job stops on every
        node, naming it, rather than going on without that thread."""
        me = self.own_name()
        try:
            client: Client | None = self._connect()
        except StoreGone:  # this launcher's word stands
            client = None
        self.verdicts.decide(self.verdicts.post(client, "bug", f"{me}'s launcher failed: "
                                                f"{bugs.summary(where, err)}"))
