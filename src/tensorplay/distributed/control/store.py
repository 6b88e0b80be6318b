"""The control plane over the job's key-value store (``control/plane.py`` declares the verbs).

The torch engine's TCPStore (rank 0's, or the launcher's) carries every cross-rank protocol:
rank 0 judges, every other rank makes O(1) round trips, so a check of 100,000 ranks reads
100,000 digests at rank 0 and one outcome everywhere else. Any rank may post and read marks at
any time (a ``Board``): failure marks, the survivors' vote, the chain of epochs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.protocol import StoreFailed, StoreFailure, StoreGone, StoreTimedOut
from ..errors import (
    DistributedTimeoutError,
    RankFailedError,
    compact_runs,
    format_ranks,
    parse_runs,
)
from ..geometry.topology import Hosts, hosts_from_names
from ..host import knobs, wire
from ..job.failures import FIX_FAILED, FIX_LATE, diagnose, named_failures, store_call
from ..job.watch import Dead, death_watch
from . import arrivals as _arrivals
from . import keys as _keys
from .plane import PEEK_S, Tally

if TYPE_CHECKING:
    from ..backends.protocol import Store
    from ..job.context import JobContext

T = TypeVar("T")


class JobStore:
    """The job's store as the control plane uses it: the engine's store, whose failures are
    raised as ``StoreGone`` or ``StoreTimedOut`` (the engine's error their cause).

    ``judge`` is the engine's ``store_failure``: the one place that decides what a store
    call's exception means. On rank 3 of a gloo job whose rank 0 has exited, ``set`` raises
    StoreGone("the job's store failed: Broken pipe") from torch's DistNetworkError; a
    ``multi_get`` that waited out the store's 300 s raises StoreTimedOut; a TypeError (a
    bug of ours) comes through as it is. Meets the ``Store`` Protocol itself.
    """

    def __init__(self, store: Store, judge: Callable[[BaseException], StoreFailure | None]):
        self._store = store
        self._judge = judge

    def set(self, key: str, value: str | bytes) -> None:
        self._call(lambda: self._store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self._store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda: self._store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda: self._store.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._call(lambda: self._store.multi_set(keys, values))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call(lambda: self._store.compare_set(key, expected, desired))

    def clone(self) -> JobStore:
        return JobStore(self._call(self._store.clone), self._judge)

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - judged by the engine; anything else re-raised
            kind = self._judge(err)
            if kind is None:
                raise
            failed = StoreGone if kind == "gone" else StoreTimedOut
            raise failed(f"the job's store failed: {str(err).strip()[:300]}") from err


class StoreBoard:
    """A ``Board`` over the job's store: its verbs, each bounded by the store's timeout (or
    by PEEK_S inside ``briefly()``); a store that fails raises ``StoreFailed``."""

    def __init__(self, store: JobStore):
        self._store = store

    def post(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def peek(self, keys: Sequence[str]) -> list[str | None]:
        store = self._store
        return [store.get(k).decode() if store.check([k]) else None for k in keys]

    def wait(self, keys: Sequence[str]) -> list[str]:
        return [v.decode() for v in self._store.multi_get(list(keys))]

    def decide(self, key: str, proposal: str) -> str:
        return self._store.compare_set(key, "", proposal).decode()

    def unposted(self, keys: Sequence[str]) -> list[int]:
        return _arrivals.unset(self._store, list(keys))

    @contextmanager
    def briefly(self) -> Iterator[None]:
        store = self._store
        before = store.timeout
        store.set_timeout(timedelta(seconds=PEEK_S))
        try:
            yield
        finally:
            store.set_timeout(before)

    def clone(self) -> StoreBoard:
        """The same board on a connection of its own (for a watcher thread)."""
        return StoreBoard(self._store.clone())


class StoreControl(StoreBoard):
    """The control plane over the job's store (see the module docstring): also a ``Board``.

    A tally (cross-rank check #n): each member posts its text's digest under
    ``e<k>/check/<n>/arrive/<rank>``; the first member reads them all (one multi_get that
    returns once all are posted) and posts the outcome under ``e<k>/check/<n>/outcome``; the
    others read only that. When a tally cannot finish, the error says why and who:

    - while a rank waits, a thread watches the other ranks of its host (pids from
      ``meet_hosts``); when one dies before posting, the thread posts a death notice as the
      outcome, which wakes every waiting rank on every host, and in the dead rank's place,
      which releases the first member: each raises RankFailedError naming it;
    - under tensorplay-run, the launcher's verdict (a node lost) is posted the same way;
    - a wait that expires names the ranks that never arrived (DistributedTimeoutError) and
      posts a "gave up" outcome, so a rank that arrives later fails at once;
    - a store that cannot be reached names the rank or launcher that serves it.
    """

    def __init__(self, world: JobContext, store: Store):
        super().__init__(JobStore(store, world.engine.store_failure))
        self._world = world

    # -- Control ----------------------------------------------------------------------------
    def tally(self, step: str, text: str) -> Tally:
        world = self._world
        n = world.spmd.next("check")
        step = f"{step} (cross-rank check #{n})"
        arrived_at = time.time()
        self._call(step, lambda: self.post(self._key(_keys.CHECK_ARRIVE, n, world.rank), text))
        with death_watch(world, lambda dead: self._notice(n, _death_notice(dead),
                                                          [r for r, _, _ in dead]),
                         lambda said, ranks: self._notice(
                             n, f"lost {compact_runs(ranks) if ranks else '-'} {said}", ranks)):
            if world.rank == world.members()[0]:
                outcome = self._judge(step, n)
            else:
                outcome = self._await(step, n, [self._key(_keys.CHECK_OUTCOME, n)])[0]
        kind, _, rest = outcome.partition(" ")
        if kind == "ok":
            return [world.members()]
        if kind == "differ":
            self._texts_n = n
            return [parse_runs(g) for g in rest.split(" ")]
        raise self._failed(step, n, kind, rest, arrived_at)

    def texts(self, step: str, text: str, ranks: Sequence[int]) -> list[str]:
        """The texts of ``ranks`` for the tally just made (keys of the same check #n)."""
        world, n = self._world, self._texts_n
        if world.rank in ranks:
            mine = self._key(_keys.CHECK_REQUEST, n, world.rank)
            self._call(step, lambda: self.post(mine, text))
        return self._await(step, n, [self._key(_keys.CHECK_REQUEST, n, r) for r in ranks])

    _texts_n = 0  # the check whose texts ``texts`` reads: the last tally that differed

    def exchange(self, name: str, text: str, wanted: Sequence[int], wait_s: float
                 ) -> dict[int, str]:
        world = self._world
        key = world.spmd.key
        with suppress(StoreFailed):  # the store is gone: nothing is read below either
            self.post(key(_keys.EXCHANGE, name=name, rank=world.rank), text)
        keys = [key(_keys.EXCHANGE, name=name, rank=r) for r in wanted]
        deadline = time.monotonic() + wait_s
        try:
            while True:
                unset = set(self.unposted(keys))
                if not unset or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            present = [i for i in range(len(keys)) if i not in unset]
            values = self.wait([keys[i] for i in present]) if present else []
        except StoreFailed:  # the store is gone: nothing to read
            return {}
        return {wanted[i]: v for i, v in zip(present, values, strict=True)}

    def ending(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """Nothing to tell: a member stuck in a stray call fails when this rank's connections
        close, and reads the counts posted here (``accounting.check_after_failure``)."""

    def meet_hosts(self, step: str) -> dict[int, int]:
        """rank -> pid of the ranks on this host.

        Each rank posted "<pid> <host>" as it joined (``keys.JOINED``); rank 0 reads them all
        with one multi_get and posts, with one multi_set, every host's rank:pid list and the
        list of all host names. Every other rank reads only its own host's list: 1 store
        operation and O(ranks per host) bytes per rank, O(N) in all. The full list is read
        later, only where needed (``hosts``); rank 0 keeps it.
        """
        world, store, here = self._world, self._store, knobs.hostname()
        with named_failures(world, step):
            if world.rank == 0:
                entries = [v.decode().split(" ", 1) for v in
                           store.multi_get([_keys.joined(r) for r in range(world.size)])]
                names = [host for _, host in entries]
                self._hosts = hosts_from_names(names)
                per_host: dict[str, str] = {}
                for rank, (pid, host) in enumerate(entries):
                    per_host[host] = per_host.get(host, "") + f"{rank}:{pid};"
                keys = [_keys.ON_HOST.format(host=h) for h in per_host] + [_keys.HOSTS]
                store.multi_set(keys, [*per_host.values(), "\n".join(names)])
                mine = per_host[here]
            else:
                mine = store.get(_keys.ON_HOST.format(host=here)).decode()  # waits for rank 0
        pairs = (item.split(":") for item in mine.split(";") if item)
        return {int(rank): int(pid) for rank, pid in pairs}

    _hosts: Hosts | None = None

    def hosts(self) -> Hosts:
        if self._hosts is None:
            self._hosts = hosts_from_names(self._store.get(_keys.HOSTS).decode().split("\n"))
        return self._hosts

    def known_hosts(self) -> Hosts | None:
        return self._hosts

    @contextmanager
    def arrivals(self, step: str, name: str, ranks: Sequence[int], n: int) -> Iterator[None]:
        """A blocking wait (barrier #n of the group ``name`` of ``ranks``) whose timeout names
        the members that never arrived: a wait that lasts posts this rank's mark
        (``control/arrivals.py``)."""
        world, store, group = self._world, self._store, name
        mark = world.spmd.key(_keys.BARRIER_MARK, group=group, n=n, rank=world.rank)
        _arrivals.begin(store, mark, world.rank)
        try:
            yield
        except DistributedTimeoutError as err:
            _arrivals.settle(store, mark)
            keys = [world.spmd.key(_keys.BARRIER_MARK, group=group, n=n, rank=r) for r in ranks]
            # a store that cannot be reached names the rank that serves it, not a timeout
            unset = self._call(step, lambda: self.unposted(keys))
            raise DistributedTimeoutError(step, err.timeout_s,
                                          [ranks[i] for i in unset]) from err
        finally:
            _arrivals.end()

    def leave(self, grace_s: float) -> None:
        """Mark this rank done with the store; rank 0, whose process serves it (env://,
        tcp://), lingers until every rank is done or ``grace_s`` is over, so no rank's last
        read meets a closed server."""
        world = self._world
        with suppress(StoreFailed):  # the store is gone: nobody is left to wait for
            self.post(world.spmd.key(_keys.LEFT, rank=world.rank), "1")
            if world.rank == 0:
                deadline = time.monotonic() + grace_s + 1.0
                while time.monotonic() < deadline:
                    gone = set(wire.told_lost())  # the launcher said they are gone
                    if not self.unposted([world.spmd.key(_keys.LEFT, rank=r)
                                          for r in world.members() if r not in gone]):
                        break
                    time.sleep(0.02)

    # -- the tally's parts ------------------------------------------------------------------
    def _key(self, template: str, n: int, rank: int | None = None) -> str:
        if rank is None:
            return self._world.spmd.key(template, n=n)
        return self._world.spmd.key(template, n=n, rank=rank)

    def _call(self, step: str, call: Any) -> Any:
        return store_call(self._world, step, call)

    def _judge(self, step: str, n: int) -> str:
        """The first member: read every member's text of check #n, post the outcome and return
        what was posted. A gave-up or death notice posted before ours wins, and is returned."""
        key = self._key(_keys.CHECK_OUTCOME, n)
        if self._call(step, lambda: self._store.check([key])):  # this rank is late
            return self._call(step, lambda: self._store.get(key).decode())
        members = self._world.members()
        texts = self._await(step, n, [self._key(_keys.CHECK_ARRIVE, n, r) for r in members])
        if all(t == texts[0] for t in texts):
            verdict = "ok"
        else:
            by_text: dict[str, list[int]] = {}
            for rank, t in zip(members, texts, strict=True):
                by_text.setdefault(t, []).append(rank)
            verdict = "differ " + " ".join(compact_runs(ranks) for ranks in by_text.values())
        return self._call(step, lambda: self.decide(key, verdict))

    def _await(self, step: str, n: int, keys: list[str]) -> list[str]:
        """The values of ``keys`` once every one is posted; waits up to the world's timeout."""
        try:
            return self.wait(keys)
        except StoreFailed as err:
            raise self.diagnosed(step, n, err, isinstance(err, StoreTimedOut)) from err

    def _notice(self, n: int, notice: str, ranks: Sequence[int]) -> None:
        """Post ``notice`` as check #n's outcome and in place of each of ``ranks`` that never
        posted, which wakes every waiter that can still reach the store and releases the first
        member. Runs on the watcher thread, so it goes through a clone (its own connection)."""
        with suppress(StoreFailed):  # the store died too: the wait will say so
            other = self.clone()
            other.decide(self._key(_keys.CHECK_OUTCOME, n), notice)
            for rank in ranks:
                other.decide(self._key(_keys.CHECK_ARRIVE, n, rank), notice)

    def _failed(self, step: str, n: int, kind: str, rest: str, arrived_at: float) -> Exception:
        """The error of check #n whose outcome is a death notice, the launcher's verdict or a
        rank that gave up waiting."""
        if kind == "dead":
            return self.diagnosed(step, n, None, timed_out=False, dead=_parse_dead(rest))
        if kind == "lost":  # the launchers stop the job: a node lost, or a failure elsewhere
            runs, _, said = rest.partition(" ")
            return RankFailedError(f"{step} failed: {said}. {FIX_FAILED}",
                                   ranks=parse_runs(runs) if runs != "-" else None)
        when, _, note = rest.partition(" ")  # gave_up <time> <note>
        if arrived_at > float(when):
            return DistributedTimeoutError(
                step, self._world.timeout.total_seconds(), None,
                who=f"rank {self._world.rank} arrived after the others had given up waiting "
                    f"({note})", fix=FIX_LATE)
        return self.diagnosed(step, n, None, timed_out=True)  # another waiter gave up first

    def diagnosed(self, step: str, n: int, err: BaseException | None, timed_out: bool,
                  dead: list[Dead] | None = None) -> Exception:
        """The error of check #n that failed: who died, who never arrived, or who is slow. A
        rank that gives up posts so as the outcome, so that a rank arriving later fails at
        once."""
        world = self._world
        store_gone: RankFailedError | None = None
        try:
            members = world.members()
            keys = [self._key(_keys.CHECK_ARRIVE, n, r) for r in members]
            missing = [members[i] for i in self._call(step, lambda: self.unposted(keys))]
        except RankFailedError as gone:
            store_gone, missing = gone, []
        if timed_out and store_gone is None:
            note = (f"gave_up {time.time():.6f} rank {world.rank} stopped waiting after "
                    f"{world.timeout.total_seconds():g} s; missing then: "
                    f"{format_ranks(missing)}")
            with suppress(StoreFailed):  # the store is gone: the late rank will see
                self.decide(self._key(_keys.CHECK_OUTCOME, n), note)
        return diagnose(world, step, err, timed_out, dead=dead, missing=missing,
                        store_gone=store_gone)


def _death_notice(dead: list[Dead]) -> str:
    return "dead " + " ".join(f"{rank}:{pid}@{host}" for rank, pid, host in dead)


def _parse_dead(text: str) -> list[Dead]:
    """(rank, pid, host) of each entry of a death notice."""
    out = []
    for item in text.split(" "):
        rank, _, rest = item.partition(":")
        pid, _, host = rest.partition("@")
        out.append((int(rank), int(pid), host))
    return out
