"""The launchers of one job meet in its store before any rank starts, and check they agree.

Each launcher claims its --node-rank (``add`` on ``keys.NODE_CLAIM``: the first claimant gets
claim 1), posts its host name, --nproc-per-node and --nnodes, and waits until every node has
(--join-timeout-s). Two launchers claiming one node index, nodes disagreeing on
--nproc-per-node or --nnodes, or a node that never arrives is a ``join`` verdict: one sentence
every launcher prints (``JoinError``), naming the node(s), before any rank starts. Node 0 then
opens its link port (``links``) and marks the job started; nodes 1.. connect to it.

In elastic mode a second claim of a node index, once the job runs, takes the node back when
the job has declared its launcher lost (within --node-grace-s + ``ACK_S`` of the claim), else
it is refused and the job goes on. Worked example, 2 nodes, --nproc-per-node 4 on hostA but 2
on hostB: both post, both read both, and both print::

    tensorplay-run: error: nodes disagree on --nproc-per-node: node 0 (hostA) 4, node 1
    (hostB) 2. Fix: pass the same --nproc-per-node on every node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from ..errors import format_ranks
from . import keys as _keys
from . import store
from .heartbeat import ACK_S
from .links import Link, Links
from .roster import Node, NodeChange, NodeFlags, Roster
from .store import CALL_S, POLL_S, Client, StoreGone, bounded
from .verdicts import Verdicts

REFUSE_S = 30.0  # how long a launcher that refused to join tries to reach node 0's store


def refuse(addr: str, port: int | None, node: int, text: str, within_s: float = REFUSE_S
           ) -> str:
    """A launcher that will not join (its command line contradicts the others') posts ``text``
    as the job's join verdict in node 0's store, waiting up to ``within_s`` for it to be
    served, so that node 0 prints it and stops waiting for this node (``launcher/
    slurm_step.py``). Returns what became of it, for this launcher's own output."""
    where = f"{addr}:{port}"
    if port is None:
        return "node 0 cannot be told (no --master-port): it waits --join-timeout-s"
    try:
        client = store.connect(addr, port, time.monotonic() + within_s, CALL_S)
        Verdicts(node).post(client, "join", text)
    except StoreGone as gone:
        return (f"node 0's store at {where} was not reached within {within_s:g} s ({gone}): "
                "node 0 waits for this node until its --join-timeout-s")
    return f"node 0 was told, through its store at {where}"


class JoinError(Exception):
    """The launchers could not start the job together; the message says why, naming nodes."""


@dataclass
class Joined:
    """What a launcher holds once it joined."""

    client: Client  # the main thread's client of the job's store
    claim: int  # this launcher's claim of its node index (2: it replaced a lost launcher)
    links: Links | None  # node 0 (under etcd: a store member): a connection per launcher
    # (None: no second port, or not a watcher)
    held: list[Link]  # the connections the watchers read (node 0's; under etcd each member's)


def join(flags: NodeFlags, roster: Roster, verdicts: Verdicts, deadline: float,
         open_links: Callable[[], Links], connect: Callable[[float], Client] | None = None,
         on_claim: Callable[[Client, int], None] = lambda client, claim: None) -> Joined:
    """Claim this node, wait for all of them and check they agree, by ``deadline``; fills
    ``roster.nodes``. JoinError when they do not (see the module). ``connect(deadline)``: a
    client of the job's store (default: node 0's TCPStore at --master-addr:--master-port);
    ``on_claim(client, claim)`` runs as soon as this launcher holds its claim (under etcd: its
    lease, so the others see it live before they see it back)."""
    where = f"{flags.addr}:{flags.port}"
    try:
        client = (connect or (lambda d: store.connect(flags.addr, flags.port, d, CALL_S)))(
            deadline)
    except StoreGone as err:
        whose = "the job's store" if flags.equal else "node 0 (the job's store"
        raise JoinError(
            f"{whose} at {where}{'' if flags.equal else ')'} never answered within "
            f"{flags.join_timeout_s:g} s ({err}). Fix: start tensorplay-run with --node-rank 0 "
            f"on the machine that has address {flags.addr}, and check that this machine reaches "
            f"it (firewall, --master-addr, --master-port)"
        ) from None
    meeting = _Meeting(flags, roster, verdicts, client, deadline, on_claim)
    try:
        return meeting.meet(open_links)
    except JoinError:
        meeting.part()
        raise
    except StoreGone as err:
        whose = "the job's store" if flags.equal else "node 0 (the job's store"
        raise JoinError(f"{whose} at {where}{'' if flags.equal else ')'} went away while the "
                        f"nodes met ({err}); its launcher says why") from None


class _Meeting:
    """One launcher's join, on the main thread's client (its calls bounded by the client's
    timeout: what is left of --join-timeout-s)."""

    def __init__(self, flags: NodeFlags, roster: Roster, verdicts: Verdicts, client: Client,
                 deadline: float, on_claim: Callable[[Client, int], None]):
        self.flags, self.roster, self.verdicts = flags, roster, verdicts
        self.client, self.deadline, self.on_claim = client, deadline, on_claim
        self.claim = 1

    def meet(self, open_links: Callable[[], Links]) -> Joined:
        f, client = self.flags, self.client
        me = Node(f.index, f.host, f.nproc, f.nnodes, f.own_addr)
        self.claim = client.add(_keys.NODE_CLAIM.format(node=f.index), 1)
        client.set(_keys.NODE_INFO.format(node=f.index, claim=self.claim), me.dumps())
        if client.check([_keys.JOB_ENDED]):
            raise JoinError("the job's store already holds a job that ended (its keys are "
                            "there). Fix: pass a --job-id of its own to every launcher of "
                            "this job (e.g. --job-id $SLURM_JOB_ID)")
        self.on_claim(client, self.claim)
        if self.claim > 1:
            first = self._read_node(f.index)
            text = (f"node {f.index} was claimed twice (--node-rank {f.index} on {first.host} "
                    f"and on {f.host}). Fix: give each machine its own --node-rank in "
                    f"0..{f.nnodes - 1}")
            if client.check([_keys.NODES_STARTED]):  # too late to stop the others
                if f.elastic and (f.index != 0 or f.equal):
                    self._take_back(me)
                    return Joined(client, self.claim, None, self._hold_links())
                raise JoinError(text + "; the job already runs without this launcher")
            raise JoinError(self.verdicts.post(client, "join", text).text)
        self._await_all()
        self._check_agree()
        links = None
        if self._watches_links(f.index):
            with suppress(OSError):  # no second port: the heartbeat alone judges the nodes
                links = open_links()
            client.set(self._links_key(f.index), str(links.port if links else ""))
        if f.index == 0:
            client.set(_keys.NODES_STARTED, "1")
        return Joined(client, self.claim, links, self._hold_links())

    def part(self) -> None:
        """The join failed: say this launcher read why; node 0 keeps the store up until every
        launcher that came has (at most ACK_S), so none meets a closed store instead."""
        client = self.client
        with suppress(StoreGone):  # the store is gone: nobody is left to wait for
            bounded(lambda: client.add(_keys.NODES_PARTED, 1), CALL_S)
            if self.flags.index != 0:
                return
            until = time.monotonic() + ACK_S
            while time.monotonic() < until:
                came = sum(client.add(_keys.NODE_CLAIM.format(node=i), 0)
                           for i in range(self.flags.nnodes))
                if client.add(_keys.NODES_PARTED, 0) >= came:
                    return
                time.sleep(POLL_S)

    def _watches_links(self, node: int) -> bool:
        """Whether ``node``'s launcher holds a connection per launcher: node 0, or under etcd
        each launcher that runs a store member."""
        return node < self.flags.members if self.flags.equal else node == 0

    def _links_key(self, node: int) -> str:
        return _keys.NODE_LINKS_OF.format(node=node) if self.flags.equal else _keys.NODE_LINKS

    def _hold_links(self) -> list[Link]:
        """Open the connections the launchers that watch links read (node 0's; under etcd
        each store member's but this one's): best effort, without one the heartbeat alone
        judges this node."""
        f = self.flags
        watchers = [k for k in range(f.nnodes) if k != f.index and self._watches_links(k)]
        links = []
        for k in watchers:
            addr = (self.roster.node(k).addr or f.addr) if f.equal else f.addr
            link = self._hold_link(k, addr)
            if link is not None:
                links.append(link)
        return links

    def _hold_link(self, node: int, addr: str) -> Link | None:
        f = self.flags
        key = self._links_key(node)
        try:
            while not self.client.check([key]):  # its launcher posts it ("": none)
                if time.monotonic() >= self.deadline or node in self.roster.lost:
                    return None
                time.sleep(POLL_S)
            port = self.client.get(key)
            if not port:
                return None
            return Link(addr, int(port), f.index, self.claim,
                        max(self.deadline - time.monotonic(), CALL_S))
        except (StoreGone, OSError):  # the store, or that launcher's link port, went away
            return None

    def _take_back(self, me: Node) -> None:
        """Elastic mode, the job running: take node ``me.index`` back when the launcher that
        holds it was declared lost (a node killed and started again at once is still held:
        wait up to the grace for the verdict); else JoinError, and the job goes on."""
        f, client = self.flags, self.client
        zero = self._read_node(0)
        for field, flag in (("nproc", "--nproc-per-node"), ("nnodes", "--nnodes")):
            if getattr(zero, field) != getattr(me, field):
                raise JoinError(
                    f"cannot take node {f.index} back: this launcher's {flag} is "
                    f"{getattr(me, field)}, the running job's is {getattr(zero, field)} (node 0, "
                    f"{zero.host}). Fix: start it with the job's flags")
        until = min(self.deadline, time.monotonic() + f.grace_s + ACK_S)
        while True:
            self._raise_on_verdict()
            for change in self.roster.read_news(client):
                self.roster.take(change)
            held = self._live_claim(f.index)
            if (f.index, held) in self.roster.lost_claims():
                key = _keys.NODE_NEXT.format(node=f.index, claim=held)
                if client.compare_set(key, "", str(self.claim)) == str(self.claim).encode():
                    break
                continue  # another launcher took it first: it holds the node now
            if time.monotonic() >= until:
                holder = self._read_node(f.index, held)
                raise JoinError(
                    f"node {f.index} was claimed twice (--node-rank {f.index} on "
                    f"{holder.host} and on {f.host}), and the launcher on {holder.host} is "
                    f"alive: the job goes on without this launcher. Fix: give each machine its "
                    f"own --node-rank in 0..{f.nnodes - 1}; a node is taken back only once "
                    f"the job has declared it lost (within --node-grace-s "
                    f"{f.grace_s:g} s of its loss)")
            time.sleep(POLL_S)
        self.roster.nodes = {i: self._read_node(i) for i in range(f.nnodes)}
        self.roster.nodes[f.index] = me
        change = NodeChange("back", f.index, self.claim, f.host, me.rank_list(),
                            f"node {f.index} is back: a new launcher on {f.host} took it "
                            f"({me.ranks()})")
        self.roster.tell(change, client)
        self.roster.take(change)

    def _live_claim(self, node: int) -> int:
        """The claim that holds ``node`` now: 1, or the last replacement in its chain."""
        claim = 1
        while self.client.check([_keys.NODE_NEXT.format(node=node, claim=claim)]):
            claim = int(self.client.get(_keys.NODE_NEXT.format(node=node, claim=claim)))
        return claim

    def _await_all(self) -> None:
        f = self.flags
        keys = [_keys.NODE_INFO.format(node=i, claim=1) for i in range(f.nnodes)]
        while True:
            self._raise_on_verdict()
            here = [i for i, key in enumerate(keys) if self.client.check([key])]
            if len(here) == f.nnodes:
                break
            if time.monotonic() >= self.deadline:
                came = [self._read_node(i) for i in here]
                never = sorted(set(range(f.nnodes)) - set(here))
                self.verdicts.post(
                    self.client, "join",
                    f"node{'s' if len(never) > 1 else ''} {format_ranks(never)} never arrived "
                    f"within {f.join_timeout_s:g} s (arrived: "
                    f"{', '.join(f'{n.index} ({n.host})' for n in came)}). Fix: start "
                    f"tensorplay-run with --node-rank {never[0]} on its machine, or pass "
                    f"--nnodes {len(here)}")
                self._raise_on_verdict()
            time.sleep(POLL_S)
        self.roster.nodes = {i: self._read_node(i) for i in range(f.nnodes)}

    def _read_node(self, i: int, claim: int = 1) -> Node:
        raw = self.client.get(_keys.NODE_INFO.format(node=i, claim=claim))
        return Node.loads(raw)

    def _check_agree(self) -> None:
        nodes = self.roster.nodes.values()
        for field, flag in (("nproc", "--nproc-per-node"), ("nnodes", "--nnodes")):
            if len({getattr(n, field) for n in nodes}) > 1:
                each = ", ".join(f"node {n.index} ({n.host}) {getattr(n, field)}" for n in nodes)
                self.verdicts.post(self.client, "join", f"nodes disagree on {flag}: {each}. "
                                   f"Fix: pass the same {flag} on every node")
        self._raise_on_verdict()

    def _raise_on_verdict(self) -> None:
        verdict = self.verdicts.note(self.client)
        if verdict is not None:
            raise JoinError(verdict.text)
