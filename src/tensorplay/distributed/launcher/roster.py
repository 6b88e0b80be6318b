"""Who is who among the launchers of one job: this launcher's flags, the nodes as they posted
themselves at join, which launcher holds each node index now, and (elastic mode) the news of
nodes lost and taken back, posted once in the job's store and read by every launcher.

A node index may be held by several launchers in turn: its ``claim``-th launcher is the one
that claimed it ``claim``-th (1 for the first, 2 for its replacement). Worked example, elastic,
2 nodes of 4 ranks: node 1's launcher is killed; node 0 posts news item 1, NodeChange('lost',
node=1, claim=1, ranks=[4, 5, 6, 7]); a new launcher claims node 1 (claim 2), takes it and
posts news item 2, NodeChange('back', node=1, claim=2). Every launcher reads both at its next
beat: ``live == {0: 1, 1: 2}``, ``lost == set()``, and the beat key of node 1 is now
``tensorplay-run/beat/1/2``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..errors import format_ranks
from . import keys
from .store import Client, Posted


@dataclass(frozen=True)
class NodeFlags:
    """What this launcher was told about its node and the job (its command line)."""

    nnodes: int
    index: int  # --node-rank
    nproc: int  # --nproc-per-node
    host: str  # this machine's name
    addr: str  # --master-addr: where node 0 serves the job's store
    port: int  # --master-port
    grace_s: float  # --node-grace-s
    join_timeout_s: float  # --join-timeout-s
    elastic: bool  # --max-restarts: a node may be lost and replaced (node 0 too under etcd)
    store: str = "tcp"  # "tcp": node 0's launcher serves the store; "etcd": every host equal
    own_addr: str = ""  # this launcher's job address (where its etcd member and links listen)
    members: int = 0  # under etcd: the store's members the launchers run (nodes 0..members-1;
    # 0: the user's own cluster)
    job_id: str = "default"  # --job-id: names the members' data and the user's cluster's keys

    @property
    def equal(self) -> bool:
        """Every host equal (the store on etcd): node 0 may be lost and taken back too."""
        return self.store == "etcd"


@dataclass
class Node(Posted):
    """What a launcher posted about itself at join."""

    index: int
    host: str
    nproc: int
    nnodes: int
    addr: str = ""  # its job address (under etcd: where a store member's links listen)

    def rank_list(self) -> list[int]:
        """Node 1 of 4 ranks each: [4, 5, 6, 7]."""
        return list(range(self.index * self.nproc, (self.index + 1) * self.nproc))

    def ranks(self) -> str:
        return f"rank{'s' if self.nproc > 1 else ''} " + format_ranks(self.rank_list())

    def name(self) -> str:
        """'node 1 (hostB, ranks 4-7)'."""
        return f"node {self.index} ({self.host}, {self.ranks()})"


@dataclass(frozen=True)
class NodeChange(Posted):
    """Elastic mode: a node lost (``kind`` 'lost') or taken back by a new launcher ('back').
    Posted once in the job's store, read by every launcher; the job goes on either way."""

    kind: str  # 'lost' or 'back'
    node: int
    claim: int  # which launcher of that node index: 1 for the first, 2 for its replacement
    host: str
    ranks: list[int]
    text: str


class Roster:
    """The nodes as this launcher knows them; the join fills ``nodes``, the news the rest.
    The heartbeat and node 0's link thread both note losses: ``take`` and ``lose`` lock."""

    def __init__(self, nnodes: int, nproc: int):
        self.nnodes, self.nproc = nnodes, nproc
        self.nodes: dict[int, Node] = {}  # node -> what its holder posted at join
        self.live = dict.fromkeys(range(nnodes), 1)  # node -> the claim that holds it now
        self.lost: set[int] = set()  # nodes lost and not taken back (elastic mode)
        self.changes: list[NodeChange] = []  # every loss and taking back read, in order
        self._news_read = 0  # how many of the store's news items this launcher has read
        self._lock = threading.Lock()

    def node(self, i: int) -> Node:
        """Node ``i`` as posted, or as far as known before the join read it ('?' host)."""
        return self.nodes.get(i) or Node(i, "?", self.nproc, self.nnodes)

    def beat_key(self, node: int) -> str:
        """The heartbeat counter of the launcher that holds ``node`` now."""
        return keys.NODE_BEAT.format(node=node, claim=self.live[node])

    def lost_claims(self) -> set[tuple[int, int]]:
        """(node, claim) of every launcher declared lost."""
        return {(c.node, c.claim) for c in self.changes if c.kind == "lost"}

    def read_news(self, client: Client) -> list[NodeChange]:
        """The node changes posted since this launcher last looked (one call when none)."""
        total = client.add(keys.NODE_NEWS, 0)
        new = []
        while self._news_read < total:
            key = keys.NODE_NEWS_ITEM.format(n=self._news_read + 1)
            if not client.check([key]):
                break  # counted but not written yet: next beat
            new.append(NodeChange.loads(client.get(key)))
            self._news_read += 1
        return new

    def tell(self, change: NodeChange, client: Client) -> None:
        """Post ``change`` as the next news item, for every launcher to read."""
        n = client.add(keys.NODE_NEWS, 1)
        client.set(keys.NODE_NEWS_ITEM.format(n=n), change.dumps())

    def take(self, change: NodeChange) -> bool:
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

    def lose(self, node: int, claim: int, why: str, client: Client) -> NodeChange | None:
        """Elastic mode: post that ``node`` (its ``claim``-th launcher) is lost, once (node 0
        judges; under etcd any launcher that saw it, and ``compare_set`` on ``keys.NODE_LOST``
        lets one post); every launcher reads it, and the job goes on without the node's ranks.
        The change, or None when that launcher was already lost or replaced, or another
        launcher posts it."""
        with self._lock:
            if node in self.lost or self.live.get(node) != claim:
                return None
        token = f"{threading.get_ident()}.{time.monotonic_ns()}"
        if client.compare_set(keys.NODE_LOST.format(node=node, claim=claim), "", token
                              ) != token.encode():
            return None  # another launcher (or thread) posts it: its news reaches us
        name = self.node(node)
        change = NodeChange("lost", node, claim, name.host, name.rank_list(),
                            f"{name.name()} is lost: {why}")
        self.tell(change, client)
        return change if self.take(change) else None
