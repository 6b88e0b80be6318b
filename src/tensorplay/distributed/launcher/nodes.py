"""tensorplay-run across nodes: node 0 serves the job's store; launchers check and watch each other.

Node 0's launcher serves the job's store (torch's TCPStore, bound to --master-addr only), as
torchrun's agent does, so rank 0's process is an ordinary rank and the store outlives any rank.
Every rank connects to it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own
switch, so plain torch.distributed scripts work too).

Through that store the launchers

1. **join**: each claims its --node-rank and posts its host name and --nproc-per-node; all wait
   until every node has (``join_timeout_s``). Two launchers claiming one node index, nodes
   disagreeing on --nproc-per-node or --nnodes, or a node that never arrives is a *verdict*:
   one sentence every launcher prints, naming the node(s), before any rank starts;
2. **beat**: nodes 1.. add 1 to their counter about once a second (``BEAT_S``); node 0 reads
   every counter. A counter that has not moved for ``grace_s`` (default 10 s) means its node
   is lost; node 0 posts that verdict. A node that cannot reach the store for ``grace_s`` (or
   is refused by it: node 0's launcher is gone) declares node 0 lost by itself. Cost: per
   second two store calls per node (its beat, a look for a verdict), and on node 0 one per
   node (a counter read): at 12,500 nodes of 8 ranks, ~37,500 calls a second on node 0's
   store. Every call is bounded (``store.bounded``): torch's client can block for ever on a
   link that went silent;
3. **stop together**: the first verdict posted wins (compare_set); every launcher reads it at
   its next beat and stops its ranks. A node whose ranks all finished adds ``DONE`` to its
   counter, so node 0 keeps the store up until every node is done or lost.

Example verdicts (each launcher prints it after ``tensorplay-run: ``)::

    node 1 (hostB, ranks 4-7) went silent: no heartbeat for 10.4 s (limit 10 s, --node-grace-s)
    nodes disagree on --nproc-per-node: node 0 (hostA) 4, node 1 (hostB) 2
    node 1 was claimed twice (--node-rank 1 on hostB and on hostC)
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from .. import _keys, _netif
from ..errors import format_ranks
from . import bugs, store
from .links import Link, Links
from .store import CALL_S, POLL_S, Client, LauncherStore, StoreGone, bounded

BEAT_S = 1.0  # how often a launcher beats and looks at the others
DONE = 1 << 40  # added to a node's counter when its ranks have all finished
ACK_S = BEAT_S + CALL_S + 1.0  # node 0 keeps the store up so long for a verdict to be read


@dataclass(frozen=True)
class Verdict:
    """Why the job stops: posted once by one launcher, printed by every one."""

    kind: str  # 'join', 'lost', 'failed', 'store', 'bug' (a launcher's own internal error)
    node: int  # the node that posted it
    text: str
    lost: int | None = None  # the node declared lost, which will not read this

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def loads(raw: bytes | str) -> Verdict:
        return Verdict(**json.loads(raw))


@dataclass(frozen=True)
class NodeChange:
    """Elastic mode: a node lost (``kind`` 'lost') or taken back by a new launcher ('back').
    Posted once in the job's store, read by every launcher; the job goes on either way."""

    kind: str  # 'lost' or 'back'
    node: int
    claim: int  # which launcher of that node index: 1 for the first, 2 for its replacement
    host: str
    ranks: list[int]
    text: str

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def loads(raw: bytes | str) -> NodeChange:
        return NodeChange(**json.loads(raw))


class JoinError(Exception):
    """The launchers could not start the job together; the message says why, naming nodes."""


@dataclass
class Node:
    """What a launcher posted about itself at join."""

    index: int
    host: str
    nproc: int
    nnodes: int

    def rank_list(self) -> list[int]:
        """Node 1 of 4 ranks each: [4, 5, 6, 7]."""
        return list(range(self.index * self.nproc, (self.index + 1) * self.nproc))

    def ranks(self) -> str:
        return f"rank{'s' if self.nproc > 1 else ''} " + format_ranks(self.rank_list())

    def name(self) -> str:
        """'node 1 (hostB, ranks 4-7)'."""
        return f"node {self.index} ({self.host}, {self.ranks()})"


class Board:
    """This launcher's view of the other nodes, through the job's store."""

    def __init__(self, *, nnodes: int, node_rank: int, nproc: int, host: str, addr: str,
                 port: int, grace_s: float, join_timeout_s: float, elastic: bool = False):
        self.nnodes, self.index, self.nproc = nnodes, node_rank, nproc
        self.elastic = elastic  # --max-restarts: a node other than 0 may be lost and replaced
        self.claim = 1  # this launcher's claim of its node index (2: it replaced a lost one)
        self.live = dict.fromkeys(range(nnodes), 1)  # node -> the claim that holds it now
        self.lost: set[int] = set()  # nodes lost and not replaced (elastic mode)
        self.changes: list[NodeChange] = []  # every loss and replacement read, in order
        self._news_read = 0  # how many of the store's node changes this launcher has read
        self._on_change: Callable[[NodeChange], None] = lambda c: None
        self._lock = threading.Lock()  # the link thread and the beat thread both post losses
        self.links: Links | None = None  # node 0: a connection per launcher
        self.link: Link | None = None  # other nodes: the connection to node 0
        self.host, self.addr, self.port = host, addr, port
        self.grace_s, self.join_timeout_s = grace_s, join_timeout_s
        self.server: LauncherStore | None = None  # node 0: the store's server (lives as long
        # as the launcher)
        self.client: Client | None = None  # the main thread's client, once joined
        self.nodes: dict[int, Node] = {}
        self.verdict: Verdict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_verdict: Callable[[Verdict], None] = lambda v: None
        self._wake = os.pipe()  # serve_when_asked waits on it too

    # ---------------------------------------------------------------- store

    def _connect(self) -> Client:
        return store.connect(self.addr, self.port, time.monotonic() + CALL_S, CALL_S)

    def bind(self) -> socket.socket:
        """Node 0: the socket the job's store will be served on (JoinError when it cannot)."""
        try:
            return _netif.listen(self.addr, self.port)
        except OSError as err:
            raise JoinError(
                f"cannot serve the job's store on {self.addr}:{self.port}: {err.strerror}. "
                f"Fix: pass --master-addr an address of this machine and a free --master-port"
            ) from None

    def serve(self, listener: socket.socket | None = None) -> None:
        """Node 0: serve the job's store on ``listener`` (default: bind one now)."""
        listener = listener or self.bind()
        self.server = store.serve(listener, self.addr, self.port,
                                  max(self.join_timeout_s, 60.0))

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

    # ---------------------------------------------------------------- join

    def join(self) -> None:
        """Claim this node, wait for all of them and check they agree; JoinError if not."""
        deadline = time.monotonic() + self.join_timeout_s
        if self.index == 0 and self.server is None:
            self.serve()
        try:
            self.client = store.connect(self.addr, self.port, deadline, CALL_S)
        except StoreGone as err:
            raise JoinError(
                f"node 0 (the job's store at {self.addr}:{self.port}) never answered within "
                f"{self.join_timeout_s:g} s ({err}). Fix: start tensorplay-run with "
                f"--node-rank 0 on the machine that has address {self.addr}, and check that "
                f"this machine reaches it (firewall, --master-addr, --master-port)"
            ) from None
        try:
            self._join(deadline)
        except JoinError:
            self._part()
            raise
        except StoreGone as err:
            raise JoinError(f"node 0 (the job's store at {self.addr}:{self.port}) went away "
                            f"while the nodes met ({err}); its launcher says why"
                            ) from None

    def _part(self) -> None:
        """The join failed: say this launcher read why; node 0 keeps the store up until every
        launcher that came has (at most ACK_S), so none meets a closed store instead."""
        client = self.client
        assert client is not None
        with suppress(StoreGone):  # the store is gone: nobody is left to wait for
            bounded(lambda: client.add(_keys.NODES_PARTED, 1), CALL_S)
            if self.index != 0:
                return
            until = time.monotonic() + ACK_S
            while time.monotonic() < until:
                came = sum(client.add(_keys.NODE_CLAIM.format(node=i), 0)
                           for i in range(self.nnodes))
                if client.add(_keys.NODES_PARTED, 0) >= came:
                    return
                time.sleep(POLL_S)

    def _join(self, deadline: float) -> None:
        assert self.client is not None
        me = Node(self.index, self.host, self.nproc, self.nnodes)
        claim = int(self.client.add(_keys.NODE_CLAIM.format(node=self.index), 1))
        self.claim = claim
        info = _keys.NODE_INFO.format(node=self.index, claim=claim)
        self.client.set(info, json.dumps(me.__dict__))
        if claim > 1:
            first_info = _keys.NODE_INFO.format(node=self.index, claim=1)
            first = Node(**json.loads(self.client.get(first_info)))
            text = (f"node {self.index} was claimed twice (--node-rank {self.index} on "
                    f"{first.host} and on {self.host}). Fix: give each machine its own "
                    f"--node-rank in 0..{self.nnodes - 1}")
            if self.client.check([_keys.NODES_STARTED]):  # too late to stop the others
                if self.elastic and self.index != 0:
                    self._replace(me, deadline)
                    self._hold_link(deadline)
                    return
                raise JoinError(text + "; the job already runs without this launcher")
            raise JoinError(self.post("join", text).text)
        self._await_all(deadline)
        self._check_agree()
        if self.index == 0:
            with suppress(OSError):  # no second port: the heartbeat alone judges the nodes
                self.links = Links(self.addr, self._link_gone, self._fail)
            self.client.set(_keys.NODE_LINKS, str(self.links.port if self.links else ""))
        self.client.set(_keys.NODES_STARTED, "1")
        self._hold_link(deadline)

    def _hold_link(self, deadline: float) -> None:
        """Nodes 1..: open the connection node 0 watches (best effort: without it the
        heartbeat alone judges this node)."""
        if self.index == 0 or self.client is None:
            return
        try:
            while not self.client.check([_keys.NODE_LINKS]):  # node 0 posts it ("": none)
                if time.monotonic() >= deadline:
                    return
                time.sleep(POLL_S)
            port = self.client.get(_keys.NODE_LINKS)
            if port:
                self.link = Link(self.addr, int(port), self.index, self.claim,
                                 max(deadline - time.monotonic(), CALL_S))
        except (StoreGone, OSError):  # the store, or node 0's link port, went away meanwhile
            return

    def _replace(self, me: Node, deadline: float) -> None:
        """Elastic mode, the job running: take node ``self.index`` back when the launcher that
        holds it was declared lost (a node killed and started again at once is still held:
        wait up to the grace for the verdict); else JoinError, and the job goes on."""
        assert self.client is not None
        zero = self._read_node(0)
        for field, flag in (("nproc", "--nproc-per-node"), ("nnodes", "--nnodes")):
            if getattr(zero, field) != getattr(me, field):
                raise JoinError(
                    f"cannot take node {self.index} back: this launcher's {flag} is "
                    f"{getattr(me, field)}, the running job's is {getattr(zero, field)} (node 0, "
                    f"{zero.host}). Fix: start it with the job's flags")
        until = min(deadline, time.monotonic() + self.grace_s + ACK_S)
        while True:
            self._raise_on_verdict()
            for change in self._read_news(self.client):
                self._take(change)
            held = self._live_claim(self.index)
            if (self.index, held) in self._lost_claims():
                key = _keys.NODE_NEXT.format(node=self.index, claim=held)
                if self.client.compare_set(key, "", str(self.claim)) == str(self.claim).encode():
                    break
                continue  # another launcher took it first: it holds the node now
            if time.monotonic() >= until:
                holder = Node(**json.loads(self.client.get(
                    _keys.NODE_INFO.format(node=self.index, claim=held))))
                raise JoinError(
                    f"node {self.index} was claimed twice (--node-rank {self.index} on "
                    f"{holder.host} and on {self.host}), and the launcher on {holder.host} is "
                    f"alive: the job goes on without this launcher. Fix: give each machine its "
                    f"own --node-rank in 0..{self.nnodes - 1}; a node is taken back only once "
                    f"the job has declared it lost (within --node-grace-s "
                    f"{self.grace_s:g} s of its loss)")
            time.sleep(POLL_S)
        self.nodes = {i: self._read_node(i) for i in range(self.nnodes)}
        self.nodes[self.index] = me
        change = NodeChange("back", self.index, self.claim, self.host, me.rank_list(),
                            f"node {self.index} is back: a new launcher on {self.host} took it "
                            f"({me.ranks()})")
        self._post_change(change, self.client)
        self._take(change)

    def _live_claim(self, node: int) -> int:
        """The claim that holds ``node`` now: 1, or the last replacement in its chain."""
        assert self.client is not None
        claim = 1
        while self.client.check([_keys.NODE_NEXT.format(node=node, claim=claim)]):
            claim = int(self.client.get(_keys.NODE_NEXT.format(node=node, claim=claim)))
        return claim

    def _lost_claims(self) -> set[tuple[int, int]]:
        return {(c.node, c.claim) for c in self.changes if c.kind == "lost"}

    def _await_all(self, deadline: float) -> None:
        assert self.client is not None
        keys = [_keys.NODE_INFO.format(node=i, claim=1) for i in range(self.nnodes)]
        while True:
            self._raise_on_verdict()
            here = [i for i, key in enumerate(keys) if self.client.check([key])]
            if len(here) == self.nnodes:
                break
            if time.monotonic() >= deadline:
                came = [self._read_node(i) for i in here]
                never = sorted(set(range(self.nnodes)) - set(here))
                self.post("join", f"node{'s' if len(never) > 1 else ''} "
                                  f"{format_ranks(never)} never arrived within "
                                  f"{self.join_timeout_s:g} s (arrived: "
                                  f"{', '.join(f'{n.index} ({n.host})' for n in came)}). Fix: "
                                  f"start tensorplay-run with --node-rank {never[0]} on its "
                                  f"machine, or pass --nnodes {len(here)}")
                self._raise_on_verdict()
            time.sleep(POLL_S)
        self.nodes = {i: self._read_node(i) for i in range(self.nnodes)}

    def _read_node(self, i: int) -> Node:
        assert self.client is not None
        return Node(**json.loads(self.client.get(_keys.NODE_INFO.format(node=i, claim=1))))

    def _check_agree(self) -> None:
        for field, flag in (("nproc", "--nproc-per-node"), ("nnodes", "--nnodes")):
            values = {getattr(n, field) for n in self.nodes.values()}
            if len(values) > 1:
                each = ", ".join(f"node {n.index} ({n.host}) {getattr(n, field)}"
                                 for n in self.nodes.values())
                self.post("join", f"nodes disagree on {flag}: {each}. Fix: pass the same "
                                  f"{flag} on every node")
        self._raise_on_verdict()

    def _raise_on_verdict(self) -> None:
        assert self.client is not None
        self.verdict = self.verdict or _posted(self.client)
        if self.verdict is not None:
            raise JoinError(self.verdict.text)

    # ---------------------------------------------------------------- verdicts

    def post(self, kind: str, text: str, client: Client | None = None,
             lost: int | None = None) -> Verdict:
        """Post a verdict unless one was posted before; return the one that stands (ours when
        the store cannot be reached, or there is no client: none could be made)."""
        mine = Verdict(kind, self.index, text, lost)
        target = client or self.client
        if target is None:
            self.verdict = self.verdict or mine
            return self.verdict
        try:
            won = bounded(lambda: target.compare_set(_keys.NODES_VERDICT, "", mine.dumps()),
                          CALL_S)
            self.verdict = Verdict.loads(won)
        except StoreGone:  # this launcher's word stands
            self.verdict = self.verdict or mine
        return self.verdict

    def await_verdict(self, within_s: float) -> Verdict | None:
        """The verdict that stands, waiting up to ``within_s`` for another launcher to post
        one (None: none came, or the store cannot be reached)."""
        deadline = time.monotonic() + within_s
        client = self.client
        while self.verdict is None and client is not None:
            try:
                self.verdict = self.verdict or bounded(lambda: _posted(client), CALL_S)
            except StoreGone:  # nobody else will say
                break
            if self.verdict is not None or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return self.verdict

    def node(self, i: int) -> Node:
        return self.nodes.get(i) or Node(i, "?", self.nproc, self.nnodes)

    # ---------------------------------------------------------------- beats

    def watch(self, on_verdict: Callable[[Verdict], None],
              on_change: Callable[[NodeChange], None] = lambda c: None) -> None:
        """Start beating and watching; ``on_verdict`` is called once, from the watch thread
        (or node 0's link thread); ``on_change`` (elastic mode) for each node lost or back."""
        self._on_verdict, self._on_change = on_verdict, on_change
        self._thread = threading.Thread(target=bugs.guarded("the heartbeat", self._beat_loop,
                                                            self._fail),
                                        daemon=True, name="tensorplay-run heartbeat")
        self._thread.start()

    def _beat_loop(self) -> None:
        client: Client | None = None
        last_ok = time.monotonic()
        seen = {i: (-1, last_ok) for i in range(1, self.nnodes)}  # node -> (count, since)

        def beat() -> tuple[dict[int, int], list[NodeChange], Verdict | None]:
            nonlocal client
            if client is None:
                client = self._connect()
            counts = {}
            if self.index == 0:
                counts = {i: client.add(self._beat_key(i), 0) for i in seen
                          if i not in self.lost}
            else:
                client.add(self._beat_key(self.index), 1)
            news = self._read_news(client) if self.elastic else []
            verdict = _posted(client)
            if verdict is None:
                return counts, news, None
            if self.index != 0:  # read: node 0 need not serve the store for us
                client.add(self._beat_key(self.index), DONE)
            return counts, news, verdict

        while not self._stop.wait(BEAT_S):
            if self.verdict is not None and self.verdict.kind != "failed":
                return  # node 0's link thread decided: the job stops
            now = time.monotonic()
            try:  # a silent store is judged at the grace, not a whole call later
                left = self.grace_s - (now - last_ok)
                counts, news, verdict = bounded(beat, min(2 * CALL_S, max(left, 0.5)))
            except StoreGone as err:
                client = None  # a call that timed out may still be stuck in it: never reuse
                silent = time.monotonic() - last_ok
                if silent >= self.grace_s or err.refused:
                    self._decide(self._store_lost(silent, err))
                    return
                continue
            assert client is not None
            last_ok = now
            if verdict is not None:
                self._decide(verdict)
                return
            for change in news:
                if not self._take(change):
                    continue
                if change.kind == "lost" and (change.node, change.claim) == (self.index,
                                                                               self.claim):
                    self._decide(self._dropped(change))
                    return
                if change.kind == "back" and change.node in seen:
                    seen[change.node] = (-1, now)
                if change.node != self.index:
                    self._on_change(change)
            for i, count in counts.items():
                if count >= DONE or count != seen[i][0]:
                    seen[i] = (count, now)
                elif now - seen[i][1] > self.grace_s:
                    why = (f"went silent: no heartbeat for {now - seen[i][1]:.1f} s (limit "
                           f"{self.grace_s:g} s, --node-grace-s)")
                    if self.elastic:
                        try:
                            self._lose(i, self.live[i], why, client)
                        except StoreGone:  # not posted: the next beat reconnects, judges again
                            client = None
                            break
                        continue
                    self._decide(self.post("lost", f"{self.node(i).name()} {why}", client,
                                           lost=i))
                    return

    def _beat_key(self, node: int) -> str:
        return _keys.NODE_BEAT.format(node=node, claim=self.live[node])

    # ---------------------------------------------------------------- elastic: nodes lost, back

    def _post_change(self, change: NodeChange, client: Client) -> None:
        n = client.add(_keys.NODE_NEWS, 1)
        client.set(_keys.NODE_NEWS_ITEM.format(n=n), change.dumps())

    def _read_news(self, client: Client) -> list[NodeChange]:
        """The node changes posted since this launcher last looked (one call when none)."""
        total = client.add(_keys.NODE_NEWS, 0)
        new = []
        while self._news_read < total:
            key = _keys.NODE_NEWS_ITEM.format(n=self._news_read + 1)
            if not client.check([key]):
                break  # counted but not written yet: next beat
            new.append(NodeChange.loads(client.get(key)))
            self._news_read += 1
        return new

    def _take(self, change: NodeChange) -> bool:
        """Note a node change (False: already noted): who holds which node, who is lost."""
        with self._lock:
            if any((c.kind, c.node, c.claim) == (change.kind, change.node, change.claim)
                   for c in self.changes):
                return False
            self.changes.append(change)
            if change.kind == "lost" and self.live.get(change.node) == change.claim:
                self.lost.add(change.node)
            elif change.kind == "back":
                self.live[change.node] = change.claim
                self.lost.discard(change.node)
                self.nodes[change.node] = Node(change.node, change.host, self.nproc,
                                               self.nnodes)
            return True

    def _lose(self, node: int, claim: int, why: str, client: Client) -> None:
        """Node 0, elastic mode: post that ``node`` (its ``claim``-th launcher) is lost, once;
        every launcher reads it, and the job goes on without the node's ranks."""
        with self._lock:
            if node in self.lost or self.live.get(node) != claim:
                return
        name = self.node(node)
        change = NodeChange("lost", node, claim, name.host, name.rank_list(),
                            f"{name.name()} is lost: {why}")
        self._post_change(change, client)
        if self._take(change):
            self._on_change(change)

    def _link_gone(self, node: int, claim: int) -> None:
        """Node 0's link thread: the launcher of ``node`` closed its connection without a
        bye (killed, crashed): it is lost at once, not after the grace."""
        if self._stop.is_set() or self.verdict is not None or self.live.get(node) != claim:
            return
        why = "its launcher is gone (its connection to node 0 closed without a goodbye)"
        try:
            client = self._connect()
            if bounded(lambda: client.add(self._beat_key(node), 0), CALL_S) >= DONE:
                return  # it had finished
            if self.elastic:
                bounded(lambda: self._lose(node, claim, why, client), 2 * CALL_S)
            else:
                self._decide(self.post("lost", f"{self.node(node).name()} is lost: {why}",
                                       client, lost=node))
        except StoreGone:  # our own store is gone: this launcher is ending anyway
            return

    def _dropped(self, change: NodeChange) -> Verdict:
        """This node was declared lost (frozen, or cut off, then back): the job went on
        without it, so it stops its ranks."""
        return Verdict("lost", self.index,
                       f"this node was declared lost by node 0 ({change.text}), and the job "
                       f"went on without its ranks. Fix: start tensorplay-run again with the "
                       f"same flags (--node-rank {self.index}) to rejoin as a replacement",
                       self.index)

    # ---------------------------------------------------------------- the end

    def _store_lost(self, silent_s: float, err: StoreGone) -> Verdict:
        why = ("refused the connection: its launcher is gone" if err.refused else
               f"has not answered for {silent_s:.1f} s (limit {self.grace_s:g} s, "
               f"--node-grace-s): {err}")
        text = (f"{self.node(0).name()}, which serves the job's store at "
                f"{self.addr}:{self.port}, is lost: the store {why}")
        if self.elastic:
            text = (f"this node, {self.node(self.index).name()}, lost the job's store at "
                    f"{self.addr}:{self.port} (served by node 0, {self.node(0).host}): the store "
                    f"{why}; its ranks cannot go on alone. Fix: if node 0 still runs (this "
                    f"machine was cut off), the job goes on without this node: once it reaches "
                    f"{self.addr} again, start tensorplay-run with the same flags (--node-rank "
                    f"{self.index}) to rejoin as a replacement; if node 0 is gone, restart the "
                    f"job from its last checkpoint")
        self.verdict = self.verdict or Verdict("lost", self.index, text, 0)
        return self.verdict

    def _decide(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self._on_verdict(verdict)

    def _fail(self, where: str, err: BaseException) -> None:
        """A launcher thread hit a bug (``bugs.guarded`` printed it): the job stops on every
        node, naming it, rather than going on without that thread."""
        me = Node(self.index, self.host, self.nproc, self.nnodes).name()
        try:
            client: Client | None = self._connect()
        except StoreGone:  # this launcher's word stands
            client = None
        self._decide(self.post("bug", f"{me}'s launcher failed: {bugs.summary(where, err)}",
                               client))

    def beat_done(self) -> None:
        """This launcher is ending: say so (node 0 then stops watching it and may close)."""
        if self.link is not None:
            self.link.bye()
        client = self.client
        if self.index == 0 or client is None:
            return
        if self.verdict is not None and self.verdict.lost == 0:
            return  # node 0 is lost: there is nobody to tell
        with suppress(StoreGone):  # the store is gone: there is nobody to tell
            bounded(lambda: client.add(self._beat_key(self.index), DONE), CALL_S)

    def await_others(self, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Node 0, its ranks ended: keep serving the store until every other node is done
        (True), nodes lost in elastic mode and not taken back aside. Once a verdict stands,
        wait only ACK_S more for the others to read it, and stop at once when
        ``interrupted()`` (False). A failure of this node's own store is a verdict too.
        """
        assert self.client is not None, "await_others() before join()"
        until = None
        while not interrupted():
            lost = self.verdict.lost if self.verdict is not None else None
            keys = [self._beat_key(i) for i in range(1, self.nnodes)
                    if i != lost and i not in self.lost]
            try:
                if all(self.client.add(k, 0) >= DONE for k in keys):
                    return self.verdict is None
            except StoreGone as err:
                self.verdict = self.verdict or Verdict(
                    "store", self.index, f"this node's own store at {self.addr}:{self.port} "
                    f"failed while it waited for the other nodes to finish ({err})")
                return False
            if self.verdict is not None:
                until = until or time.monotonic() + ACK_S
                if time.monotonic() >= until:
                    return False
            time.sleep(0.1)
        return False

    def close(self) -> None:
        """Stop beating; drop the clients and the server (node 0 stops serving)."""
        self._stop.set()
        if self.links is not None:
            self.links.close()
        if self.link is not None:
            self.link.close()
        self.client = self.server = None
        for fd in self._wake:
            with suppress(OSError):
                os.close(fd)


def _posted(client: Client) -> Verdict | None:
    """The verdict posted in the job's store (None: none yet)."""
    if not client.check([_keys.NODES_VERDICT]):
        return None
    return Verdict.loads(client.get(_keys.NODES_VERDICT))

