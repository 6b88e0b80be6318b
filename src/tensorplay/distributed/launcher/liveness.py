"""Under ``--store etcd`` the launchers watch each other through etcd itself: a launcher's
presence is a lease, and every launcher watches them all. No host is special.

- **Presence.** As soon as it holds its claim, each launcher takes a lease whose TTL is
  --node-grace-s (rounded up; etcd's shortest is 2 s) and puts ``keys.NODE_ALIVE`` under it;
  its keepalive thread renews it every ``keep_s(grace)`` (2 s for the default grace of 10 s).
  A launcher that dies, freezes or is cut off stops renewing, and etcd deletes its key once the
  TTL runs out from its last renewal: the cluster's leader decides it, not our counters.
- **Watch.** Each launcher holds one watch of ``tensorplay-run/`` (reopened every ``WATCH_S``
  from the last revision seen, so nothing in between is missed): the deletion of a live
  node's key without its ``keys.NODE_DONE`` is that node lost; a verdict or a news item is
  read as it is written. A watch that breaks, or whose start was compacted away, is followed
  by a fresh read of the keys it stands for (``_resync``).
- **Losses.** A lost node is news in elastic mode (``Roster.lose``: one launcher posts it,
  ``compare_set``), else a verdict. A store member's launcher also sees a launcher that died
  at once, by its link closing (``links``: ``launcher_gone``).
- **The store itself.** A keepalive that has not succeeded for the grace means this launcher
  reaches no majority of the members: it stops its ranks, naming each member and what it
  answered (``_store_lost``); a part of the job cut off with a minority of the members
  therefore never trains on. A keepalive answered with TTL 0 means the lease ran out while
  this launcher was frozen or cut off: the job went on without it (``_dropped``).

Cost, per node: one keepalive per ``keep_s`` (0.5 a second at the default grace) and one
watch request per ``WATCH_S`` (0.2 a second), plus a read per event that names a node:
about 0.7 store calls a second per node, 8,750 a second across the members at 12,500 nodes
(against 37,500 a second on node 0 alone for the counters of ``heartbeat``). Worked example,
grace 10 s: node 0 SIGKILLed at t = 20.0 s, its last renewal at t = 19.1 s: every member's
launcher reads its link close at t = 20.0 s; its lease would have gone at t = 29.1 s.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

from ..backends import etcd as etcd_api
from . import keys
from .bugs import guarded
from .heartbeat import ACK_S
from .roster import NodeChange, NodeFlags, Roster
from .store import CALL_S, Client, StoreGone, bounded, call
from .verdicts import Verdict, Verdicts

WATCH_S = 5.0  # a watch is reopened this often from the last revision seen
ETCD_MIN_TTL_S = 2  # etcd's shortest lease (its election timeout x 1.5, rounded up)


def keep_s(grace_s: float) -> float:
    """How often a launcher renews its lease: a fifth of the grace, within 0.5-2 s (grace
    10 s: every 2 s, so four renewals may fail before the lease runs out)."""
    return min(max(grace_s / 5, 0.5), 2.0)


def ttl_s(grace_s: float) -> int:
    """The lease's TTL: the grace, rounded up to whole seconds, at least etcd's shortest."""
    return max(math.ceil(grace_s), ETCD_MIN_TTL_S)


class Liveness:
    """This launcher's lease and watch (see the module): what ``JobNodes`` calls in place of
    ``Heartbeat`` under etcd. ``connect()`` makes a fresh etcd client for a thread; a bug in
    a thread is reported and handed to ``on_bug``."""

    def __init__(self, flags: NodeFlags, roster: Roster, verdicts: Verdicts,
                 connect: Callable[[], etcd_api.Etcd],
                 on_bug: Callable[[str, BaseException], None]):
        self.flags, self.roster, self.verdicts = flags, roster, verdicts
        self._connect, self._on_bug = connect, on_bug
        self.claim = 1
        self.lease: int | None = None
        self._on_change: Callable[[NodeChange], None] = lambda c: None
        self._stop = threading.Event()
        self._ended = threading.Event()  # done(): this launcher ended its lease
        self._threads: list[threading.Thread] = []

    def client(self) -> Client:
        """A fresh client whose failures are ``StoreGone``."""
        return Client(self._connect(), etcd_api.failure)

    # ---------------------------------------------------------------- presence

    def hold(self, client: Client, claim: int) -> None:
        """Take this launcher's lease and put its presence under it (``join``'s
        ``on_claim``: before the others can read this node as started or back)."""
        raw = self._raw(client)
        self.claim = claim
        self.lease = call(etcd_api.failure, raw.lease, ttl_s(self.flags.grace_s))
        call(etcd_api.failure, raw.put, self._alive(self.flags.index, claim), "1", self.lease)
        self._run("keepalive", self._keep)  # at once: the others may take a while to join

    def start(self, claim: int, on_change: Callable[[NodeChange], None]) -> None:
        """Start watching (the renewals began with ``hold``); ``on_change`` (elastic mode)
        hears each node lost or back."""
        self.claim, self._on_change = claim, on_change
        self._run("watch", self._watch)

    def _run(self, name: str, body: Callable[[], None]) -> None:
        thread = threading.Thread(target=guarded(f"the store {name}", body, self._on_bug),
                                  daemon=True, name=f"tensorplay-run {name}")
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()

    def done(self, client: Client) -> None:
        """This launcher is ending cleanly: say so, then end its lease (its presence goes,
        and no launcher reads a loss into it)."""
        self._ended.set()  # no renewal of a lease ended on purpose: it would answer 0 s
        with suppress(StoreGone):  # the store is gone: there is nobody to tell
            bounded(lambda: client.set(self._done(self.flags.index, self.claim), "1"), CALL_S)
            if self.lease is not None:
                lease = self.lease
                bounded(lambda: call(etcd_api.failure, self._raw(client).revoke, lease), CALL_S)

    # ---------------------------------------------------------------- the two threads

    def _keep(self) -> None:
        """Renew the lease every ``keep_s``; past the grace without a renewal the store is
        lost to this node; a renewal answered 0 s means the others went on without it."""
        last_ok = time.monotonic()
        client: Client | None = None
        while not self._stop.wait(keep_s(self.flags.grace_s)):
            if self._decided() or self._ended.is_set():
                return
            lease = self.lease
            assert lease is not None, "the keepalive started before the lease was held"
            try:
                client = client or self.client()
                left = ttl_s(self.flags.grace_s) - (time.monotonic() - last_ok)
                ttl = bounded(functools.partial(call, etcd_api.failure,
                                                self._raw(client).keepalive, lease),
                              min(2 * CALL_S, max(left, 0.5)))
            except StoreGone as err:
                client = None  # a call given up on may still be stuck in it: never reuse
                silent = time.monotonic() - last_ok
                if silent >= self.flags.grace_s:
                    self.verdicts.decide(self.verdicts.verdict or self._store_lost(silent, err))
                    return
                continue
            if ttl <= 0 and not self._ended.is_set():
                self.verdicts.decide(self.verdicts.verdict or self._dropped())
                return
            last_ok = time.monotonic()

    def _watch(self) -> None:
        """Watch the launchers' keys; on a broken watch read them afresh and watch again."""
        revision = None
        while not self._stop.is_set() and not self._decided():
            try:
                raw = self._connect()
                if revision is None:
                    revision = self._resync(raw)
                revision = self._follow(raw, revision)
            except StoreGone:  # the keepalive judges the store; read afresh when it is back
                revision = None
                self._stop.wait(keep_s(self.flags.grace_s))
                continue
            except etcd_api.EtcdFailed:
                revision = None
                self._stop.wait(keep_s(self.flags.grace_s))

    def _follow(self, raw: etcd_api.Etcd, revision: int) -> int:
        """One watch of ``WATCH_S`` from ``revision`` + 1; the last revision seen."""
        for event in raw.watch(keys.LAUNCHER_PREFIX, revision + 1, WATCH_S):
            revision = max(revision, event.revision)
            if self._stop.is_set() or self._decided():
                break
            key = event.key
            if event.kind == "DELETE" and key.startswith(keys.ALIVE_PREFIX):
                node, claim = (int(x) for x in key[len(keys.ALIVE_PREFIX):].split("/"))
                self._vanished(Client(raw, etcd_api.failure), node, claim)
            elif event.kind == "PUT" and key == keys.NODES_VERDICT:
                self.verdicts.decide(Verdict.loads(event.value))
            elif event.kind == "PUT" and key.startswith(keys.NODE_NEWS + "/"):
                self._read_news(Client(raw, etcd_api.failure))
        return revision

    def _resync(self, raw: etcd_api.Etcd) -> int:
        """Read what a watch stands for: the verdict, the news, and which live node's
        presence is gone; the revision read."""
        client = Client(raw, etcd_api.failure)
        verdict = Verdicts.read(client)
        if verdict is not None:
            self.verdicts.decide(verdict)
            return 0
        self._read_news(client)
        present, revision = call(etcd_api.failure, raw.listing, keys.ALIVE_PREFIX)
        for node, claim in sorted(self.roster.live.items()):
            if self._alive(node, claim) not in present:
                self._vanished(client, node, claim)
        return revision

    # ---------------------------------------------------------------- judgements

    def _vanished(self, client: Client, node: int, claim: int) -> None:
        """``node``'s ``claim``-th launcher's presence is gone: lost, unless it ended cleanly
        or no longer holds the node."""
        if (node == self.flags.index or self.roster.live.get(node) != claim
                or node in self.roster.lost or client.check([self._done(node, claim)])):
            return
        why = (f"went silent: its lease of {ttl_s(self.flags.grace_s)} s (--node-grace-s) ran "
               f"out without a renewal from its launcher")
        self._lose(client, node, claim, why)

    def launcher_gone(self, node: int, claim: int) -> None:
        """A store member's link thread: the launcher of ``node`` closed its connection
        without a bye (killed, crashed): lost at once, not after the grace."""
        if self._stop.is_set() or self._decided() or self.roster.live.get(node) != claim:
            return
        why = "its launcher is gone (its connection to a store member closed without a goodbye)"
        try:
            client = self.client()
            if bounded(lambda: client.check([self._done(node, claim)]), CALL_S):
                return  # it had finished
            bounded(lambda: self._lose(client, node, claim, why), 2 * CALL_S)
        except StoreGone:  # the keepalive judges the store
            return

    def _lose(self, client: Client, node: int, claim: int, why: str) -> None:
        if self.flags.elastic:
            change = self.roster.lose(node, claim, why, client)
            if change is not None:
                self._on_change(change)
            return
        self.verdicts.decide(self.verdicts.post(
            client, "lost", f"{self.roster.node(node).name()} is lost: {why}", lost=node))

    def _read_news(self, client: Client) -> None:
        for change in self.roster.read_news(client):
            if not self.roster.take(change):
                continue
            if change.kind == "lost" and (change.node, change.claim) == (self.flags.index,
                                                                           self.claim):
                self.verdicts.decide(self._dropped(change.text))
                return
            if change.node != self.flags.index:
                self._on_change(change)

    def _decided(self) -> bool:
        stands = self.verdicts.verdict
        return stands is not None and stands.kind != "failed"

    def _dropped(self, why: str = "") -> Verdict:
        """This node was declared lost (frozen, or cut off, past the grace): the job went on
        without its ranks, so it stops them."""
        index = self.flags.index
        said = f" ({why})" if why else ""
        return Verdict("lost", index,
                       f"this node's lease in the job's store ran out{said}: the job declared "
                       f"it lost and went on without its ranks. Fix: start tensorplay-run again "
                       f"with the same flags (--node-rank {index}) to rejoin as a replacement",
                       index)

    def _store_lost(self, silent_s: float, err: StoreGone) -> Verdict:
        """No renewal for the grace: say what each member answers (probed at once, 1 s
        each), and stop this node's ranks."""
        f = self.flags
        endpoints = self._connect().endpoints
        with ThreadPoolExecutor(max(len(endpoints), 1)) as pool:
            health = list(pool.map(lambda e: etcd_api.health(e, 1.0), endpoints))
        gone = [e for e, h in zip(endpoints, health, strict=True) if h is not None]
        each = "; ".join(f"{self._member(e)}: {h or 'answers, with a leader'}"
                         for e, h in zip(endpoints, health, strict=True))
        me = self.roster.node(f.index).name()
        return Verdict("store", f.index,
                       f"this node, {me}, lost the job's store: no renewal of its lease for "
                       f"{silent_s:.1f} s (limit {f.grace_s:g} s, --node-grace-s; last: {err}). "
                       f"The store lost its majority as seen from here ({len(gone)} of "
                       f"{len(endpoints)} etcd members gone or without a leader: {each}), so "
                       f"this node stops its ranks: a part of the job that cannot reach a "
                       f"majority never trains on. Fix: restore the members, or restart the job "
                       f"from its last checkpoint; the nodes that still reach a majority go on")

    def _member(self, endpoint: str) -> str:
        """'member 1 (hostB, 198.18.0.2:29502)': member k listens on --master-port + 2k."""
        f = self.flags
        port = int(endpoint.rpartition(":")[2])
        k = (port - f.port) // 2
        if f.members and 0 <= k < f.members and (port - f.port) % 2 == 0:
            return f"member {k} ({self.roster.node(k).host}, {endpoint})"
        return f"member {endpoint}"

    # ---------------------------------------------------------------- the end

    def await_others(self, client: Client, interrupted: Callable[[], bool]) -> bool:
        """A store member's launcher, its ranks ended: keep its member up until every other
        node is done (True), nodes lost in elastic mode aside. Once a verdict stands, wait
        only ACK_S more for the others to read it (False)."""
        until = None
        f = self.flags
        while not interrupted():
            stands = self.verdicts.verdict
            lost = stands.lost if stands is not None else None
            wanted = [self._done(i, self.roster.live[i]) for i in range(f.nnodes)
                      if i != f.index and i != lost and i not in self.roster.lost]
            try:
                if bounded(functools.partial(client.check, wanted), CALL_S):
                    if stands is None:
                        self._await_members(client)
                    return stands is None
                if stands is None:
                    self._read_news(client)
            except StoreGone as err:
                self.verdicts.verdict = stands or Verdict(
                    "store", f.index, f"the job's store failed while this node waited for the "
                    f"other nodes to finish ({err})")
                return False
            if stands is not None:
                until = until or time.monotonic() + ACK_S
                if time.monotonic() >= until:
                    return False
            time.sleep(0.2)
        return False

    def _await_members(self, client: Client) -> None:
        """Every node is done: say so, and keep this member up until every other live
        member's launcher has said so too (ACK_S at most): three members stopping as each
        sees the end would leave the last without a majority while it still reads the
        others' last words. Its own job is over either way: a failure here changes nothing."""
        f = self.flags
        others = [keys.NODE_SAW_ALL.format(node=i) for i in range(f.members)
                  if i != f.index and i not in self.roster.lost]
        until = time.monotonic() + ACK_S
        try:
            bounded(lambda: client.set(keys.NODE_SAW_ALL.format(node=f.index), "1"), CALL_S)
            while not bounded(functools.partial(client.check, others), CALL_S):
                if time.monotonic() >= until:
                    return
                time.sleep(0.1)
        except StoreGone:  # the others stopped their members: they had all seen the end
            return

    # ---------------------------------------------------------------- keys

    @staticmethod
    def _alive(node: int, claim: int) -> str:
        return keys.NODE_ALIVE.format(node=node, claim=claim)

    @staticmethod
    def _done(node: int, claim: int) -> str:
        return keys.NODE_DONE.format(node=node, claim=claim)

    @staticmethod
    def _raw(client: Client) -> etcd_api.Etcd:
        raw = client.raw
        assert isinstance(raw, etcd_api.Etcd), "Liveness needs a client of etcd"
        return raw
