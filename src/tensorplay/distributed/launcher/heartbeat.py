"""The launchers watch each other through the job's store: a beat a second, a node silent past
--node-grace-s is lost.

Nodes 1.. add 1 to their counter about once a second (``BEAT_S``); node 0 reads every
counter. A counter that has not moved for --node-grace-s (default 10 s) means its node is lost:
node 0 posts that verdict (elastic mode: that news, and the job goes on). A node that cannot
reach the store for the grace (or is refused by it: node 0's launcher is gone,
``StoreGone.refused``) declares node 0 lost by itself. Each beat also reads the verdict and, in
elastic mode, the node news (``roster``). A node whose ranks all finished adds ``DONE`` to its
counter, so node 0 keeps the store up until every node is done or lost (``await_others``).

Cost: per second two store calls per node (its beat, a look for a verdict), and on node 0 one
per node (a counter read): at 12,500 nodes of 8 ranks, ~37,500 calls a second on node 0's
store. Every call is bounded (``store.bounded``). Worked example, grace 10 s, node 1 frozen at
t = 20.0 s just after its beat of t = 19.9 s: node 0, beating at t = 20.4, 21.4, ..., reads a
new count at 20.4 s and the same one from then on; at its beat of t = 31.4 s, 11.0 s > 10 s
after, it posts::

    node 1 (hostB, ranks 4-7) went silent: no heartbeat for 11.0 s (limit 10 s, --node-grace-s)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress

from .bugs import guarded
from .roster import NodeChange, NodeFlags, Roster
from .store import CALL_S, Client, StoreGone, bounded
from .verdicts import Verdict, Verdicts

BEAT_S = 1.0  # how often a launcher beats and looks at the others
DONE = 1 << 40  # added to a node's counter when its ranks have all finished
ACK_S = BEAT_S + CALL_S + 1.0  # node 0 keeps the store up so long for a verdict to be read

Beat = tuple[Client, dict[int, int], list[NodeChange], Verdict | None]  # what one beat read


class Heartbeat:
    """This launcher's beat thread (``start``), and the judgement of a node whose launcher's
    link closed (``launcher_gone``, node 0's link thread). ``connect()`` makes a fresh client
    (each thread has its own); a bug in the thread is reported and handed to ``on_bug``."""

    def __init__(self, flags: NodeFlags, roster: Roster, verdicts: Verdicts,
                 connect: Callable[[], Client], on_bug: Callable[[str, BaseException], None]):
        self.flags, self.roster, self.verdicts = flags, roster, verdicts
        self._connect, self._on_bug = connect, on_bug
        self.claim = 1  # this launcher's claim of its node index
        self._on_change: Callable[[NodeChange], None] = lambda c: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the beat thread's own: its client (None: connect at the next beat), when the store
        # last answered, and node -> (its counter, since when it has read so)
        self._client: Client | None = None
        self._last_ok = 0.0
        self._seen: dict[int, tuple[int, float]] = {}

    def start(self, claim: int, on_change: Callable[[NodeChange], None]) -> None:
        """Start beating; ``on_change`` (elastic mode) is called for each node lost or back."""
        self.claim, self._on_change = claim, on_change
        self._thread = threading.Thread(target=guarded("the heartbeat", self._run, self._on_bug),
                                        daemon=True, name="tensorplay-run heartbeat")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        self._last_ok = time.monotonic()
        self._seen = {i: (-1, self._last_ok) for i in range(1, self.flags.nnodes)}
        while not self._stop.wait(BEAT_S):
            stands = self.verdicts.verdict
            if stands is not None and stands.kind != "failed":
                return  # node 0's link thread decided: the job stops
            if not self._round():
                return

    def _round(self) -> bool:
        """One beat and what it read; False once a verdict is decided (the thread ends)."""
        now = time.monotonic()
        watched = [i for i in self._seen if i not in self.roster.lost]
        client = self._client
        try:  # a silent store is judged at the grace, not a whole call later
            left = self.flags.grace_s - (now - self._last_ok)
            client, counts, news, verdict = bounded(lambda: self._beat(client, watched),
                                                    min(2 * CALL_S, max(left, 0.5)))
        except StoreGone as err:
            self._client = None  # a call that timed out may still be stuck in it: never reuse
            silent = time.monotonic() - self._last_ok
            if silent >= self.flags.grace_s or err.refused:
                self.verdicts.decide(self._store_lost(silent, err))
                return False
            return True
        self._client, self._last_ok = client, now
        if verdict is not None:
            self.verdicts.decide(verdict)
            return False
        return self._read(news, now) and self._judge(counts, now, client)

    def _beat(self, client: Client | None, watched: list[int]) -> Beat:
        """On a store-call thread: beat (node 0: read the ``watched`` counters), read the news
        and the verdict; a verdict read is acknowledged (node 0 need not serve it for us)."""
        index = self.flags.index
        client = client or self._connect()
        counts = {}
        if index == 0:
            counts = {i: client.add(self.roster.beat_key(i), 0) for i in watched}
        else:
            client.add(self.roster.beat_key(index), 1)
        news = self.roster.read_news(client) if self.flags.elastic else []
        verdict = Verdicts.read(client)
        if verdict is not None and index != 0:
            client.add(self.roster.beat_key(index), DONE)
        return client, counts, news, verdict

    def _read(self, news: list[NodeChange], now: float) -> bool:
        """Note the node news; False when it says this launcher was declared lost."""
        for change in news:
            if not self.roster.take(change):
                continue
            if change.kind == "lost" and (change.node, change.claim) == (self.flags.index,
                                                                           self.claim):
                self.verdicts.decide(self._dropped(change))
                return False
            if change.kind == "back" and change.node in self._seen:
                self._seen[change.node] = (-1, now)
            if change.node != self.flags.index:
                self._on_change(change)
        return True

    def _judge(self, counts: dict[int, int], now: float, client: Client) -> bool:
        """Node 0: a counter unchanged past the grace is a node lost; False once that stops
        the job (elastic mode: it is news, and the job goes on)."""
        for i, count in counts.items():
            if count >= DONE or count != self._seen[i][0]:
                self._seen[i] = (count, now)
            elif now - self._seen[i][1] > self.flags.grace_s:
                why = (f"went silent: no heartbeat for {now - self._seen[i][1]:.1f} s (limit "
                       f"{self.flags.grace_s:g} s, --node-grace-s)")
                if self.flags.elastic:
                    try:
                        change = self.roster.lose(i, self.roster.live[i], why, client)
                    except StoreGone:  # not posted: the next beat reconnects and judges again
                        self._client = None
                        return True
                    if change is not None:
                        self._on_change(change)
                    continue
                self.verdicts.decide(self.verdicts.post(
                    client, "lost", f"{self.roster.node(i).name()} {why}", lost=i))
                return False
        return True

    def launcher_gone(self, node: int, claim: int) -> None:
        """Node 0's link thread: the launcher of ``node`` closed its connection without a
        bye (killed, crashed): it is lost at once, not after the grace."""
        if (self._stop.is_set() or self.verdicts.verdict is not None
                or self.roster.live.get(node) != claim):
            return
        why = "its launcher is gone (its connection to node 0 closed without a goodbye)"
        try:
            client = self._connect()
            if bounded(lambda: client.add(self.roster.beat_key(node), 0), CALL_S) >= DONE:
                return  # it had finished
            if self.flags.elastic:
                change = bounded(lambda: self.roster.lose(node, claim, why, client), 2 * CALL_S)
                if change is not None:
                    self._on_change(change)
                return
            self.verdicts.decide(self.verdicts.post(
                client, "lost", f"{self.roster.node(node).name()} is lost: {why}", lost=node))
        except StoreGone:  # our own store is gone: this launcher is ending anyway
            return

    def _dropped(self, change: NodeChange) -> Verdict:
        """This node was declared lost (frozen, or cut off, then back): the job went on
        without it, so it stops its ranks."""
        index = self.flags.index
        return Verdict("lost", index,
                       f"this node was declared lost by node 0 ({change.text}), and the job "
                       f"went on without its ranks. Fix: start tensorplay-run again with the "
                       f"same flags (--node-rank {index}) to rejoin as a replacement", index)

    def _store_lost(self, silent_s: float, err: StoreGone) -> Verdict:
        f = self.flags
        why = ("refused the connection: its launcher is gone" if err.refused else
               f"has not answered for {silent_s:.1f} s (limit {f.grace_s:g} s, "
               f"--node-grace-s): {err}")
        text = (f"{self.roster.node(0).name()}, which serves the job's store at "
                f"{f.addr}:{f.port}, is lost: the store {why}")
        if f.elastic:
            text = (f"this node, {self.roster.node(f.index).name()}, lost the job's store at "
                    f"{f.addr}:{f.port} (served by node 0, {self.roster.node(0).host}): the "
                    f"store {why}; its ranks cannot go on alone. Fix: if node 0 still runs "
                    f"(this machine was cut off), the job goes on without this node: once it "
                    f"reaches {f.addr} again, start tensorplay-run with the same flags "
                    f"(--node-rank {f.index}) to rejoin as a replacement; if node 0 is gone, "
                    f"restart the job from its last checkpoint")
        return self.verdicts.verdict or Verdict("lost", f.index, text, 0)

    def done(self, client: Client) -> None:
        """This launcher is ending: add DONE to its counter (node 0 then stops waiting for
        it)."""
        stands = self.verdicts.verdict
        if stands is not None and stands.lost == 0:
            return  # node 0 is lost: there is nobody to tell
        with suppress(StoreGone):  # the store is gone: there is nobody to tell
            bounded(lambda: client.add(self.roster.beat_key(self.flags.index), DONE), CALL_S)

    def await_others(self, client: Client, interrupted: Callable[[], bool]) -> bool:
        """Node 0, its ranks ended: keep serving the store until every other node is done
        (True), nodes lost in elastic mode and not taken back aside. Once a verdict stands,
        wait only ACK_S more for the others to read it, and stop at once when
        ``interrupted()`` (False). A failure of this node's own store is a verdict too."""
        until = None
        f = self.flags
        while not interrupted():
            stands = self.verdicts.verdict
            lost = stands.lost if stands is not None else None
            keys = [self.roster.beat_key(i) for i in range(1, f.nnodes)
                    if i != lost and i not in self.roster.lost]
            try:
                if all(client.add(k, 0) >= DONE for k in keys):
                    return stands is None
            except StoreGone as err:
                self.verdicts.verdict = stands or Verdict(
                    "store", f.index, f"this node's own store at {f.addr}:{f.port} failed while "
                    f"it waited for the other nodes to finish ({err})")
                return False
            if stands is not None:
                until = until or time.monotonic() + ACK_S
                if time.monotonic() >= until:
                    return False
            time.sleep(0.1)
        return False
