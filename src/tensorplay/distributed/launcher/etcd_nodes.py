"""``tensorplay-run --store etcd``: the job's nodes meet and watch each other in etcd, so that
no host is special and losing node 0 is just another lost host.

Two ways to have the store (``EtcdNodes``):

- **The job's own cluster** (``--store etcd``): the launchers of nodes 0..N-1 (N =
  ``--store-replicas``, default 3, or 1 below 3 nodes) each run one etcd member on their job
  address (``etcd_members``: member k listens for clients on --master-port + 2k and for its
  peers on + 2k + 1). Node 0's makes a cluster of one on --master-addr; each other member's
  launcher reaches it there and adds its member (etcd's own reconfiguration, one at a time).
  A launcher that takes a lost member's node back on the same host starts the member again
  from the directory its predecessor left (etcd reads its membership there), elsewhere it
  replaces that member by its own. Every launcher then talks to every member's endpoint.
- **The user's cluster** (``--store etcd://h1:2379,h2:2379``): nothing is started; the job's
  keys are under ``jobs/<--job-id>/``, and the last launcher to leave marks the job ended
  (``keys.JOB_ENDED``: a later job of the same id is refused, naming --job-id).

Then it is the ordinary join (``join``) over the etcd client, with liveness from leases and a
watch (``liveness``) in place of the heartbeat's counters, and each store member's launcher
holding a link per launcher (``links``: a launcher that dies is seen at once). The ranks get
the members' endpoints in ``TENSORPLAY_RUN_STORE`` (``rank_store``): their c10d store is the
same cluster, under ``ranks/``. Worked example, three hosts, --master-port 29500::

    node 0 (198.18.0.1): member 0 at 198.18.0.1:29500 (peers 29501), a cluster of one
    node 1 (198.18.0.2): member_add http://198.18.0.2:29503, then its member at :29502
    node 2 (198.18.0.3): the same at :29504 / :29505 once member 1 has started
    every rank: TENSORPLAY_RUN_STORE=etcd://198.18.0.1:29500,198.18.0.2:29502,
                198.18.0.3:29504/ranks/
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..backends import etcd as etcd_api
from . import etcd_members, keys
from .join import JoinError, join
from .links import Links
from .liveness import Liveness
from .nodes import JobNodes
from .roster import NodeFlags
from .store import CALL_S, Client, StoreGone, bounded

MEMBER_START_S = 60.0  # at most this long for this launcher's member to be healthy


def replicas_for(nnodes: int, asked: int | None) -> int:
    """How many members the job's own cluster has: ``asked`` (odd, checked by the options),
    else 3, or 1 below 3 nodes (2 members survive no loss better than 1, and cost more)."""
    return asked if asked is not None else (3 if nnodes >= 3 else 1)


def majority_note(members: int) -> str | None:
    """What a job whose store survives no loss is told at start (None from 3 members on)."""
    if members >= 3:
        return None
    return (f"the job's store has {members} etcd member{'s' if members > 1 else ''}: losing "
            f"{'node 0' if members == 1 else 'any member node'} stops the job (a majority of "
            f"{members} is {members // 2 + 1}); 3 members (--store-replicas 3, 3 nodes or more) "
            f"survive the loss of one")


class EtcdNodes(JobNodes):
    """``JobNodes`` with the job's store on etcd (see the module)."""

    def __init__(self, flags: NodeFlags, external: tuple[str, ...] = (), job_id: str = ""):
        super().__init__(flags)
        self.external = list(external)
        self.prefix = f"jobs/{job_id}/" if external else ""
        self.endpoints = list(external)
        self.member: etcd_members.LocalMember | None = None
        self.heartbeat = Liveness(flags, self.roster, self.verdicts, self._etcd, self._fail)
        self.left_behind: str | None = None  # what close() could not remove
        self._unreachable: bool | None = None  # store_unreachable()'s answer, once asked

    @property
    def rank_store(self) -> str:
        """What the ranks get in ``TENSORPLAY_RUN_STORE``: the members (this node's first)
        and their prefix."""
        return f"etcd://{','.join(self._etcd().endpoints)}/{self.prefix}{keys.RANKS_PREFIX}"

    def _etcd(self) -> etcd_api.Etcd:
        """A client of the members, this node's own first: it is up as long as this
        launcher is (a client of a frozen member would spend a try on it each call)."""
        mine = [self.member.seat.endpoint] if self.member is not None else []
        return etcd_api.Etcd(mine + [e for e in self.endpoints if e not in mine], CALL_S,
                             self.prefix)

    def _connect(self) -> Client:
        return Client(self._etcd(), etcd_api.failure)

    def keeps_store_up(self) -> bool:
        """Whether this launcher runs a member, and so waits for the others at the end."""
        return self.member is not None

    # ---------------------------------------------------------------- the members

    def _bootstrap(self) -> list[str]:
        """Where the members listen on --master-addr (one of them is there, at start node
        0's): a launcher that is not node 0 reaches the cluster through these."""
        f = self.flags
        return [f"{f.addr}:{f.port + 2 * k}" for k in range(f.members)]

    def _start_member(self, deadline: float) -> None:
        """Node k < --store-replicas: run this launcher's member (see the module). Its
        predecessor's data on this host, with members that answer, means a restart; a new
        job's node 0 on --master-addr, where nothing answers, starts a cluster of one; any
        other joins the cluster (replacing a lost member of its name)."""
        f = self.flags
        at = etcd_members.seat(f.index, f.own_addr, f.port, f.job_id)
        timeout = max(min(deadline - time.monotonic(), MEMBER_START_S), 1.0)
        left = etcd_members.known(at)
        try:
            if left and self._answers(left, deadline, 2.0):
                self.member = etcd_members.LocalMember.restart(at, timeout)
            elif (f.index == 0 and f.own_addr == f.addr
                  and not self._answers(self._bootstrap(), deadline, 1.0, refused_ends=True)):
                self.member = etcd_members.LocalMember.start_new(at, timeout)
            else:
                via = self._reach(left + self._bootstrap(), deadline)
                self.member = etcd_members.LocalMember.join(at, via, timeout)
        except etcd_members.MembersError as err:
            raise JoinError(f"this node's etcd member could not start: {err}") from None
        except (etcd_api.EtcdFailed, StoreGone) as err:
            raise JoinError(f"the job's store (etcd at {', '.join(left + self._bootstrap())}) "
                            f"did not answer while this node's member joined it ({err}). "
                            f"Fix: start node 0 first, or give --master-addr the host of a "
                            f"member that is up") from None

    @staticmethod
    def _answers(endpoints: list[str], deadline: float, within_s: float,
                 refused_ends: bool = False) -> bool:
        """Whether a member already answers with a leader at one of ``endpoints``, asked for
        up to ``within_s`` (a member that listens may be electing a leader for a second).
        ``refused_ends``: False at once when every endpoint refuses the connection (nothing
        listens there: node 0 of a new job, which starts its cluster 1 s sooner)."""
        until = min(deadline, time.monotonic() + within_s)
        while True:
            said = []
            for endpoint in endpoints:
                if (health := etcd_api.health(endpoint, 0.5)) is None:
                    return True
                said.append(health)
            if time.monotonic() >= until or (refused_ends and all(h == etcd_api.REFUSED
                                                                   for h in said)):
                return False
            time.sleep(0.1)

    def _reach(self, endpoints: list[str], deadline: float) -> etcd_api.Etcd:
        """A client of the cluster at ``endpoints`` once one of them has a leader (probed
        until ``deadline``: the other launchers start at their own pace); StoreGone when
        none had by then."""
        said = ""
        while True:
            health = [(e, etcd_api.health(e, 0.5)) for e in endpoints]
            healthy = [e for e, h in health if h is None]
            if healthy:
                return etcd_api.Etcd(healthy + [e for e in endpoints if e not in healthy],
                                     CALL_S, self.prefix)
            said = "; ".join(f"{e}: {h}" for e, h in health)
            if time.monotonic() >= deadline:
                raise StoreGone(said)
            time.sleep(0.1)

    def _client(self, deadline: float) -> Client:
        """``join``'s connect: start this node's member if it has one, reach the cluster,
        and learn every member's endpoint."""
        if self.external:
            raw = self._reach(self.external, deadline)
        else:
            if self.flags.index < self.flags.members:
                self._start_member(deadline)
            assert self.member is None or self.member.seat.endpoint
            mine = [self.member.seat.endpoint] if self.member is not None else []
            raw = self._reach(mine + [e for e in self._bootstrap() if e not in mine], deadline)
        try:
            urls = [u for m in raw.members() for u in m.client_urls]
        except etcd_api.EtcdFailed as err:
            raise StoreGone(str(err)) from None
        self.endpoints = [u.split("://", 1)[-1] for u in urls] or raw.endpoints
        if self.member is not None:
            etcd_members.remember(self.member.seat, self.endpoints)
        return self._connect()

    # ---------------------------------------------------------------- join, watch, leave

    def join(self) -> None:
        deadline = time.monotonic() + self.flags.join_timeout_s
        liveness = self._liveness()
        joined = join(self.flags, self.roster, self.verdicts, deadline, self._open_links,
                      self._client, liveness.hold)
        self.client, self.claim, self.links, self.held = (joined.client, joined.claim,
                                                          joined.links, joined.held)
        self._learn_members()

    def _learn_members(self) -> None:
        """Once every node has joined, each member node has added its member: learn them
        all, so that the ranks and this launcher's clients fail over to any of them."""
        assert self.client is not None
        raw = self.client.raw
        assert isinstance(raw, etcd_api.Etcd)
        try:
            urls = [u for m in raw.members() for u in m.client_urls]
        except etcd_api.EtcdFailed as err:
            raise JoinError(f"the job's store did not list its members ({err})") from None
        self.endpoints = [u.split("://", 1)[-1] for u in urls] or self.endpoints
        if self.member is not None:
            etcd_members.remember(self.member.seat, self.endpoints)
        self.client = self._connect()

    def _open_links(self) -> Links:
        return Links(self.flags.own_addr, self.heartbeat.launcher_gone, self._fail)

    def _liveness(self) -> Liveness:
        assert isinstance(self.heartbeat, Liveness)
        return self.heartbeat

    def store_unreachable(self) -> bool:
        """Whether this launcher ends on its own verdict that the store lost its majority as
        seen from here (``Liveness._store_lost``) and no member answers with a leader now
        (each probed at once, 1 s at most): then every store call of its way out (its done
        mark, the wait for the others, its member's leave) could only run out its
        ``CALL_S``, about 8 s in all, so they are skipped. Asked once; False while the job
        goes on, on any other verdict, or when a member answers again."""
        if self._unreachable is None:
            stands = self.verdicts.verdict
            if stands is None or stands.kind != "store" or stands.node != self.flags.index:
                return False
            endpoints = self._etcd().endpoints
            with ThreadPoolExecutor(len(endpoints)) as pool:
                health = list(pool.map(lambda e: etcd_api.health(e, 1.0), endpoints))
            self._unreachable = all(h is not None for h in health)
        return self._unreachable

    def beat_done(self) -> None:
        """This launcher is ending: say so, drop its presence, and (the last to leave a
        user's cluster) mark the job ended; only the links' goodbye when the store is
        unreachable (``store_unreachable``)."""
        for link in self.held:
            link.bye()
        if self.client is None or self.store_unreachable():
            return
        self._liveness().done(self.client)
        if self.external:
            self._mark_ended_if_last(self.client)

    def _mark_ended_if_last(self, client: Client) -> None:
        f = self.flags
        done = [keys.NODE_DONE.format(node=i, claim=self.roster.live[i])
                for i in range(f.nnodes) if i not in self.roster.lost]
        try:
            if bounded(lambda: client.check(done), CALL_S) or self.verdict is not None:
                bounded(lambda: client.set(keys.JOB_ENDED, "1"), CALL_S)
        except StoreGone:  # the store is gone: nobody will read the mark
            return

    def await_others(self, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """``JobNodes.await_others``; at once False when the store is unreachable
        (``store_unreachable``): this node's member serves nobody."""
        if self.store_unreachable():
            return False
        return super().await_others(interrupted)

    def close(self) -> None:
        """Stop watching, then stop this node's member (out of the cluster first, unless the
        store is unreachable: ``store_unreachable``) and remove its data (``left_behind``
        says what could not be removed)."""
        super().close()
        member, self.member = self.member, None
        if member is not None:
            if not self.store_unreachable():
                member.leave(CALL_S)
            try:
                member.stop(CALL_S)
            except OSError as err:
                self.left_behind = f"this node's etcd member left {err.filename}: {err.strerror}"
