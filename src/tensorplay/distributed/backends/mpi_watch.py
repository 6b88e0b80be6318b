"""The MPI engine's watch over its waits, one per process: MPI waits forever; nothing here does.

- every blocking call runs under the watchdog, a thread of each process (``Watch.watched``).
  It reads the control messages every LOOK_S; past the call's bound (its world's timeout) it
  asks the other members what they do (each watchdog answers, also for a rank busy in its own
  code), prints the DistributedTimeoutError naming who never came and what the others wait
  in, and aborts the job (a blocking MPI call cannot be interrupted);
- a rank that ends with an uncaught exception prints it, names itself and calls
  ``Abort(1)``, which ends every rank (as ``python -m mpi4py`` does); in a job that went on
  past a failure (ULFM) it leaves at once instead, and the others see it fail;
- at the end of its script every rank meets the others at rank 0 before MPI's finalize (which
  waits for every rank, forever). A rank still waiting there after EXIT_GRACE_S tells every
  rank that it has left, so that a call waiting for it ends the job at once naming it
  (``RankFailedError``); a meeting that lasts the newest world's timeout aborts the job,
  naming the ranks that never came;
- a rank that ends its script tells the other members of its groups its final call count of
  each (``tell_ended``): a member blocked in a call on that group whose number is higher
  (``group.calls``) prints the ``CallMismatchError`` naming who made how many calls and aborts
  the job, within SETTLE_S instead of the timeout;
- a killed rank: every rank watches the processes of the ranks on its host (pids met at the
  first join, watched through pidfds, or ``procfs``) and, when one is gone, prints the
  ``RankFailedError`` naming it by rank and pid and aborts the job (under MPICH's mpiexec only
  seen with ``-disable-auto-cleanup``: by default mpiexec SIGKILLs every rank first, naming
  one by pid; rank 0 prints each rank's pid as the job starts, docs/engines.md).

These travel on the control communicator, a duplicate of COMM_WORLD that user code never sees,
made by the first world (``joined``): ``allgather_text``, leave notices, final counts, queries
and the exit meeting (nonblocking sends, read by the watchdog), so they never pair with a
user's collective. The watch is the process's: of a world it keeps only the ended notices of
the one joined now (``worlds`` numbers them) and the exit meeting's bound; each world's engine
(``mpi.MpiWorld``) hands its bound to every call it watches.
"""

from __future__ import annotations

import _thread
import atexit
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..errors import (
    FIX_FAILED,
    BackendError,
    CallMismatchError,
    DistributedError,
    DistributedTimeoutError,
    RankFailedError,
    ShrinkError,
    rank_words,
)
from ..host import knobs, launchers, procfs

LOOK_S = 0.05  # how often the watchdog reads control messages and looks at the call in progress
EXIT_GRACE_S = 1.0  # at exit, how long a rank waits for the others before saying it left
SETTLE_S = 1.0  # after a timeout, how long a rank collects the others' answers
ABORT_PAUSE_S = 0.5  # between printing why this rank aborts the job and aborting it
FINALIZE_S = 10.0  # how long MPI's finalize may take after a failure the job went on past
QUERY_LIMIT = 4096  # groups larger than this are not asked who is missing (O(size) messages)
# tags of the control communicator (Create_group's are above them: mpi.py)
_LEFT, _QUERY, _ANSWER, _EXIT, _GO, _ENDED = 1, 2, 3, 4, 5, 6
_SLOT = 64  # bytes per rank of allgather_text's first round: a length byte and 63 of text
_ONE = np.zeros(1, dtype=np.uint8)  # the body of every notice (must outlive its sends)
_OWN_CODE = "its own code"  # a query's answer from a rank in no call of the package


class MpiWaitError(Exception):
    """A wait that timed out: ``words`` say who never came and what the others do, ``ranks``
    are the ranks to blame (None when unknown)."""

    def __init__(self, words: str, ranks: list[int] | None):
        super().__init__(words)
        self.words, self.ranks = words, ranks

    def ours(self, where: str, timeout_s: float) -> DistributedTimeoutError:
        """The error a user sees for this wait of ``where``."""
        return DistributedTimeoutError(where, timeout_s, self.ranks, who=self.words)


def _pid_runs(pids: Sequence[int]) -> str:
    """Rank:pid pairs in runs: [40, 41, 42, 50] -> '0-2:40-42, 3:50'."""
    runs: list[tuple[int, int, int]] = []  # (first rank, first pid, length)
    for rank, pid in enumerate(pids):
        if runs and runs[-1][1] + runs[-1][2] == pid:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((rank, pid, 1))
    words = [f"{r}:{p}" if n == 1 else f"{r}-{r + n - 1}:{p}-{p + n - 1}" for r, p, n in runs]
    return ", ".join(words[:32]) + (f", ... ({len(words) - 32} more)" if len(words) > 32 else "")


class Watch:
    """This process's watchdog over its blocking MPI calls, and its exit meeting (see the
    module docstring): one per process, started by the first world it joins (``joined``).

    ``call`` is the blocking call in progress: (what, group, since, members, bound_s), set by
    ``watched`` (and by ``MpiGroupOps``'s all_reduce fast path) and read by the watchdog.
    """

    def __init__(self, control: Any, bound_s: float, job_ranks: Sequence[int] | None = None
                 ) -> None:
        self.control = control  # this process's control communicator
        # the job rank of each control rank: itself, until a world shrinks or grows (rebase)
        self.job_ranks = list(range(control.Get_size()) if job_ranks is None else job_ranks)
        self._place = {r: i for i, r in enumerate(self.job_ranks)}  # job rank -> control rank
        self.rank = self.job_ranks[control.Get_rank()]  # this process's job rank
        self.control_works = True  # False from a failure on it (ULFM) until the next rebase
        self.failed_over = False  # a world of this process went on past a failure (ULFM)
        self.before_finalize: list[Callable[[], None]] = []  # the worlds' destroy, at exit
        self._lock = threading.Lock()  # the watchdog's turn on the control communicator
        self.call: tuple[str, Any, float, Sequence[int] | None, float] | None = None
        self.worlds = 0  # how many worlds this process joined (ended notices carry it)
        self.exit_bound_s = bound_s  # the exit meeting's: the newest world's timeout
        self._left: set[int] = set()  # ranks that said they left (read by the watchdog)
        # group name -> {rank: its final calls on it}, from ended notices of this world
        self._ended: dict[str, dict[int, int]] = {}
        self._stray_seen: dict[str, float] = {}  # group name -> when a stray was first seen
        self._told: list[tuple[Any, Any]] = []  # ended notices in flight, with their bodies
        self._mates: dict[int, tuple[int, Any]] = {}  # host-mates: rank -> (pid, pidfd/start)
        self._doing: str | None = None  # what the main thread does outside a watched call
        self._stop, self._stopped = threading.Event(), threading.Event()  # the watchdog's

    def rebase(self, control: Any, job_ranks: Sequence[int]) -> Any:
        """Go on with ``control``, the control communicator of a world that shrank or grew,
        whose control ranks are the job ranks ``job_ranks``; returns the old one (revoked:
        the caller frees it). Notices in flight on the old one are dropped with it."""
        with self._lock:
            self.failed_over = True
            old, self.control = self.control, control
            self.job_ranks = list(job_ranks)
            self._place = {r: i for i, r in enumerate(self.job_ranks)}
            self._told, self._left = [], set()
            self.control_works = True
        return old

    def left(self) -> set[int]:
        """The job ranks that said they left the job (their script ended)."""
        return set(self._left)

    def open_world(self, bound_s: float) -> int:
        """A world joins, its waits bounded by ``bound_s``: the ended notices of the last one
        are forgotten, and the exit meeting waits that long. Returns its number (1, 2, ...)."""
        self.worlds += 1
        self._ended, self._stray_seen = {}, {}
        self.exit_bound_s = bound_s
        return self.worlds

    def _meet_mates(self, step: str, bound_s: float) -> None:
        """Every rank's pid and host, once per process. Under MPICH's mpiexec the watchdog
        watches the processes of the other ranks on this host (``_dead_mate``), and rank 0
        prints each rank's pid (mpiexec names a failed rank by pid only). Not under Open MPI:
        its ULFM mode (``--with-ft ulfm``) keeps the survivors going, and their calls fail
        naming the lost ranks."""
        launch = launchers.detect()
        if launch is None or launch.source != "mpich":  # the same on every rank
            return
        me = self.rank
        pairs = [t.split(" ", 1) for t in self.allgather_text(f"{os.getpid()} {_host_key()}",
                                                              step, bound_s)]
        pids = [int(pid) for pid, _ in pairs]
        for rank, (pid, host) in enumerate(pairs):
            if rank != me and host == pairs[me][1]:
                watch = _watch_handle(int(pid))
                if watch is not None:
                    self._mates[rank] = (int(pid), watch)
        if me == 0 and len(pids) > 1:
            print(f"tensorplay.distributed: MPI world of {len(pids)} ranks; mpiexec names a "
                  f"failed rank by its pid (rank:pid): {_pid_runs(pids)}",
                  file=sys.stderr, flush=True)

    def _dead_mate(self) -> tuple[int, int] | None:
        """(rank, pid) of a rank of this host whose process is gone, or None. A pidfd turns
        readable when its process ends (one poll for all of them); without pidfds, the process
        is looked up in /proc and its start time compared (a reused pid is another process)."""
        fds = [(rank, pid, w) for rank, (pid, w) in self._mates.items() if isinstance(w, int)]
        if fds:
            poller = select.poll()
            for _, _, fd in fds:
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(0)}
            for rank, pid, fd in fds:
                if fd in ready:
                    return rank, pid
        for rank, (pid, w) in self._mates.items():
            if isinstance(w, str) and (not procfs.alive(pid) or _start_time(pid) != w):
                return rank, pid
        return None

    def tell_ended(self, world_n: int, counts: Mapping[str, tuple[Sequence[int], int]]
                   ) -> None:
        """Send each other member of each group this rank's final count of it (nonblocking,
        on the control communicator; small enough to leave at once). Read by the members'
        watchdogs (``_stray``); ``world_n`` numbers the world (``worlds``)."""
        control, me = self.control, self.rank
        for name, (members, calls) in counts.items():
            body = np.frombuffer(f"{world_n} {calls} {name}".encode(), dtype=np.uint8)
            self._told += [(control.Isend(body, self._place[r], _ENDED), body)
                           for r in members if r != me and r in self._place]

    def allgather_text(self, text: str, step: str, bound_s: float) -> list[str]:
        """Every rank's ``text`` in rank order. One all-gather of fixed slots when every text
        fits one (digests, host names), else a second of the lengths and the bytes; each bounded
        by ``bound_s``."""
        data = text.encode()
        control = self.control
        slot = np.zeros(_SLOT, dtype=np.uint8)
        slot[0] = len(data) if len(data) < _SLOT else _SLOT  # _SLOT: "does not fit"
        if len(data) < _SLOT:
            slot[1:1 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        slots = np.zeros((control.Get_size(), _SLOT), dtype=np.uint8)
        self.watched(bound_s, step, None, None, control.Allgather, slot, slots)
        if (slots[:, 0] < _SLOT).all():
            return [row[1:1 + row[0]].tobytes().decode() for row in slots]
        lengths = np.zeros(control.Get_size(), dtype=np.int64)
        self.watched(bound_s, step, None, None, control.Allgather,
                     np.array([len(data)], dtype=np.int64), lengths)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out = np.zeros(int(lengths.sum()), dtype=np.uint8)
        self.watched(bound_s, step, None, None, control.Allgatherv,
                     np.frombuffer(data, dtype=np.uint8), [out, lengths, starts, MPI.BYTE])
        raw = out.tobytes()
        return [raw[s:s + n].decode() for s, n in zip(starts.tolist(), lengths.tolist(),
                                                       strict=True)]

    # -- waiting: blocking MPI calls, watched ---------------------------------------------
    def watched(self, bound_s: float, what: str, group: Any, members: Sequence[int] | None,
                call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a blocking MPI call, with the watchdog watching it: ``what`` (on
        ``group``, when given) names it; ``members`` (None: the world) are the ranks it
        waits for, at most ``bound_s`` (its world's timeout)."""
        self.call = (what, group, time.monotonic(), members, bound_s)
        try:
            return call(*args)
        finally:
            self.call = None

    def _asked(self, members: Sequence[int] | None) -> MpiWaitError:
        """``_who_is_missing``, unless the control communicator failed (a process of it
        failed, ULFM): then nobody can be asked, and the words say so."""
        unasked = MpiWaitError("the control messages failed, so nobody was asked", None)
        if not self.control_works:
            return unasked
        try:
            with self._lock:
                return self._who_is_missing(members)
        except MPI.Exception:  # a failed process on it (ULFM): the others cannot be asked
            self.control_works = False
            return unasked

    def _who_is_missing(self, members: Sequence[int] | None) -> MpiWaitError:
        """Ask the other members what they are doing (the watchdog of each answers, even in
        the user's own code); those in another call, or not answering, are named. Runs on
        the watchdog thread."""
        me = self.rank
        group: Sequence[int] = self.job_ranks if members is None else members
        if len(group) > QUERY_LIMIT:
            return MpiWaitError(f"the other members of a group of {len(group)} did "
                                "not answer (groups this large are not asked who is missing)",
                                None)
        others = [r for r in group if r != me and r in self._place]
        sends = [self.control.Isend(_ONE, self._place[r], _QUERY) for r in others]
        answers: dict[int, str] = {}
        status = MPI.Status()
        deadline = time.monotonic() + SETTLE_S
        answering: list[tuple[Any, Any]] = []
        while len(answers) < len(others) and time.monotonic() < deadline:
            while self.control.Iprobe(MPI.ANY_SOURCE, _ANSWER, status):
                body = bytearray(status.Get_count(MPI.BYTE))
                self.control.Recv(body, status.Get_source(), _ANSWER)
                answers[self.job_ranks[status.Get_source()]] = body.decode()
            answering = self._service(answering)  # the others ask this rank meanwhile
            time.sleep(0.01)
        MPI.Request.Testall(sends)
        by_call: dict[str, list[int]] = {}
        for rank, doing in sorted(answers.items()):
            by_call.setdefault(doing, []).append(rank)
        away = sorted(by_call.pop(_OWN_CODE, []))
        silent = [r for r in others if r not in answers]
        parts = []
        if away:
            parts.append(f"{rank_words(away)} never came: busy in its own code, in no call of "
                         "this package")
        if silent:
            parts.append(f"{rank_words(silent)} did not answer (hung with the interpreter "
                         "locked, or stopped)")
        parts += [f"{rank_words(rs)} {'wait' if len(rs) > 1 else 'waits'} in {doing}"
                  for doing, rs in by_call.items()]
        return MpiWaitError("; ".join(parts) or "every member answered",
                            (away + silent) or None)

    # -- the watchdog: a thread that bounds the blocking collectives ----------------------
    def _watch(self) -> None:
        """Every LOOK_S: read leave notices and answer queries; when the collective in
        progress (``self.call``) waits for a rank that left, or past its bound, say why
        and abort the job (a blocking MPI call cannot be interrupted)."""
        sends: list[tuple[Any, Any]] = []
        me = self.rank
        try:
            while not self._stop.wait(LOOK_S) and not MPI.Is_finalized():  # by the user, say
                with self._lock:
                    try:
                        sends = self._service(sends) if self.control_works else []
                    except MPI.Exception:  # a failed process (ULFM): the main thread's call
                        self.control_works = False  # says so; until a rebase, only the
                        sends = []  # timeout is watched
                call = self.call
                if call is None:
                    continue
                what, group, since, members, bound_s = call
                where = what if group is None else f"{what} on {group.label}"
                gone = sorted(r for r in self._left if members is None or r in members)
                dead = self._dead_mate() if self._mates else None
                stray = self._stray(group, members) if group is not None else None
                if dead is not None and (members is None or dead[0] in members):
                    err: DistributedError = RankFailedError(
                        f"{where} failed: rank {dead[0]} (pid {dead[1]}) died (no longer "
                        f"running on this host) while rank {me} waited for it. {FIX_FAILED}",
                        ranks=[dead[0]])
                elif gone:
                    err = RankFailedError(
                        f"{where} failed: {rank_words(gone)} left the job (its script ended, "
                        f"or it exited) while rank {me} waited for it. {FIX_FAILED}")
                elif stray is not None:
                    if self.call is call:
                        _abort(f"rank {me}: {type(stray).__name__}: {stray}\n(rank {me} waits "
                               f"in {where}, its call #{group.calls} there, which the others "
                               "never make: they have ended)")
                    continue
                elif time.monotonic() - since > bound_s:
                    err = self._asked(members).ours(where, bound_s)
                else:
                    continue
                if self.call is call:  # still in it
                    _abort(f"rank {me}: {type(err).__name__}: {err}")
        finally:
            self._stopped.set()

    def _stray(self, group: Any, members: Sequence[int] | None) -> CallMismatchError | None:
        """The error naming the call counts on ``group`` when this rank's call on it (a
        collective of the whole group, number ``group.calls``) is one that a member that has
        ended never made; None otherwise, or while the other members' counts may still come
        (up to SETTLE_S after the first)."""
        heard = self._ended.get(group.name)
        if not heard or (members is not None and len(members) != group.size()):
            return None  # nobody ended, or a send/recv (not counted)
        mine = group.calls
        if all(calls >= mine for calls in heard.values()):
            return None
        first = self._stray_seen.setdefault(group.name, time.monotonic())
        if len(heard) < group.size() - 1 and time.monotonic() - first < SETTLE_S:
            return None
        by_count: dict[int, list[int]] = {mine: [self.rank]}
        for rank, calls in heard.items():
            by_count.setdefault(calls, []).append(rank)
        return CallMismatchError(group.label, by_count)

    def _service(self, sends: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """Read leave and ended notices, answer queries; returns the answers still in
        flight."""
        control, status = self.control, MPI.Status()
        while control.Iprobe(MPI.ANY_SOURCE, _LEFT, status):
            control.Recv(np.zeros(1, dtype=np.uint8), status.Get_source(), _LEFT)
            self._left.add(self.job_ranks[status.Get_source()])
        while control.Iprobe(MPI.ANY_SOURCE, _ENDED, status):
            body = bytearray(status.Get_count(MPI.BYTE))
            control.Recv(body, status.Get_source(), _ENDED)
            world_n, calls, name = body.decode().split(" ", 2)
            if int(world_n) == self.worlds:  # an older world's are too late
                self._ended.setdefault(name, {})[self.job_ranks[status.Get_source()]] = int(calls)
        while control.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
            control.Recv(np.zeros(1, dtype=np.uint8), status.Get_source(), _QUERY)
            call = self.call
            doing = self._doing or (_OWN_CODE if call is None else call[0] if call[1] is None
                                    else f"{call[0]} on {call[1].label}")
            answer = np.frombuffer(doing.encode(), dtype=np.uint8)
            sends.append((control.Isend(answer, status.Get_source(), _ANSWER), answer))
        return [(s, b) for s, b in sends if not s.Test()]

    # -- never hang at the end -------------------------------------------------------------
    def _hook(self) -> None:
        """Start the watchdog; abort the job when this rank ends with an uncaught exception;
        meet the others at exit (registered after mpi4py's finalizer, so it runs before)."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise BackendError(
                "the mpi backend needs MPI started with MPI_THREAD_MULTIPLE (mpi4py's default; "
                "its watchdog thread bounds every wait). Fix: leave mpi4py.rc.thread_level at "
                "'multiple' before importing mpi4py.MPI."
            )
        _thread.start_new_thread(self._watch, ())
        previous = sys.excepthook

        def abort_on_error(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            previous(kind, value, tb)
            # nobody waits for a 1-rank world; an interactive session goes on after an error
            if MPI.Is_finalized() or self.control.Get_size() == 1 or hasattr(sys, "ps1"):
                return
            rank = self.rank
            if self.failed_over and issubclass(kind, ShrinkError):
                return  # raised on every survivor alike: they all meet at exit, exit code 1
            if self.failed_over:  # ULFM: the others see this rank fail, as any other loss
                print(f"tensorplay.distributed: rank {rank} ended with an uncaught "
                      f"{kind.__name__}; it leaves at once (exit code 1), so that the others "
                      "see it fail (an abort hung here once the job had gone on past a "
                      "failure)", file=sys.stderr, flush=True)
                time.sleep(ABORT_PAUSE_S)  # mpiexec forwards what it printed first
                os._exit(1)
            _abort(f"rank {rank} ended with an uncaught {kind.__name__} (so that no rank "
                   "waits for it)")

        sys.excepthook = abort_on_error
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if MPI.Is_finalized():
            return
        rank = self.rank
        try:
            self._exit_meeting(self.control.Get_rank())
        except MpiWaitError as err:
            _abort(f"rank {rank} at the end of its script: {err.words}")
        self._stop.set()  # no thread may call MPI while it finalizes
        self._stopped.wait(2 * LOOK_S + 1)
        self._service([])  # late notices and queries, so that none is left unread
        if self.failed_over:
            self._free_before_finalize()
            _bound_finalize(rank)

    def _free_before_finalize(self) -> None:
        """Free every communicator of this process's worlds and the control one before MPI's
        finalize, in a job that went on past a failure: Open MPI's finalize runs a barrier over
        each communicator still spanning two jobs (the spawners' and a spawned one), which
        crashed or hung here once a spawned rank's peers had finalized ("unable to reach each
        other", SIGSEGV in ompi_dpm_dyn_finalize); freed, there is none to run. Every rank is
        past the exit meeting, so nothing is in flight on them."""
        for release in self.before_finalize:
            release()
        self.control.Free()

    def _exit_meeting(self, rank: int) -> None:
        """Meet every rank at control rank 0 (``rank``: this one's) before MPI's finalize
        (which waits for all, forever).

        A rank still here after EXIT_GRACE_S tells every rank that it has left; a meeting
        that lasts the timeout names the ranks that never came.
        """
        control, size = self.control, self.control.Get_size()
        if size == 1:
            return
        self._doing = "the end of its script"
        if rank == 0:
            others = list(range(1, size))
            heard = [np.zeros(1, dtype=np.uint8) for _ in others]
            requests = [control.Irecv(b, r, _EXIT) for b, r in zip(heard, others, strict=True)]
            sends = self._meet(requests, others)
            sends += [control.Isend(_ONE, r, _GO) for r in others]
        else:
            go = np.zeros(1, dtype=np.uint8)
            sends = self._meet([control.Isend(_ONE, 0, _EXIT), control.Irecv(go, 0, _GO)], None)
        sends += [request for request, _ in self._told]
        deadline = time.monotonic() + SETTLE_S
        while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _meet(self, requests: list[Any], arrivals: list[int] | None) -> list[Any]:
        """Wait at the exit meeting, saying after EXIT_GRACE_S that this rank has left;
        returns the leave notices sent."""
        began = time.monotonic()
        told: list[Any] = []
        while not MPI.Request.Testall(requests):
            time.sleep(0.001)
            waited = time.monotonic() - began
            if not told and waited > EXIT_GRACE_S:
                me = self.control.Get_rank()
                told = [self.control.Isend(_ONE, r, _LEFT)
                        for r in range(self.control.Get_size()) if r != me]
            if waited > self.exit_bound_s + (0 if arrivals is not None else 2 * SETTLE_S):
                if arrivals is None:
                    raise MpiWaitError(f"waited {waited:.0f} s for rank 0 to see "
                                       "every rank end", None)
                missing = [self.job_ranks[r] for r, q in zip(arrivals, requests, strict=True)
                           if not q.Test()]
                raise MpiWaitError(f"waited {waited:.0f} s for {rank_words(missing)}"
                                   ", which never ended (hung, or still busy)", missing)
        return told


_WATCH: Watch | None = None  # this process's, from its first world on (MPI starts once)


def joined(step: str, bound_s: float, base: Any = None, job_ranks: Sequence[int] | None = None
           ) -> Watch:
    """This process's watch, serving a world that joins now, bounded by ``bound_s``. The
    first world starts it: the control communicator (a duplicate of ``base``, COMM_WORLD
    unless this process was spawned into a running job, whose control ranks are the job
    ranks ``job_ranks``), the watchdog thread, the abort-on-error hook, the exit meeting and
    (under MPICH) the host-mates."""
    global _WATCH
    if _WATCH is None:
        if base is None:
            control, request = MPI.COMM_WORLD.Idup()
            _poll(request, step, bound_s)
        else:  # blocking, as the spawners' Dup of it (MPI pairs no blocking call with an I-call)
            control = base.Dup()
        _WATCH = Watch(control, bound_s, job_ranks)
        _WATCH._hook()
        _WATCH._meet_mates(step, bound_s)
    _WATCH.open_world(bound_s)
    return _WATCH


def _host_key() -> str:
    """This host as far as pids go: its name and this process's pid namespace (two
    containers on one host see different pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{knobs.hostname()}/{namespace}"


def _start_time(pid: int) -> str | None:
    fields = procfs.stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _watch_handle(pid: int) -> int | str | None:
    """How the watchdog watches process ``pid``: a pidfd (readable once it ends), else its
    start time in /proc; None when it cannot be watched (gone already, or no /proc)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (macOS, Linux < 5.3), or the pid is gone
        start = _start_time(pid)
        return start if start is not None and procfs.alive(pid) else None


def _poll(request: Any, step: str, timeout_s: float) -> None:
    """Wait for ``request`` up to ``timeout_s`` (before the watchdog runs)."""
    began = time.monotonic()
    while not request.Test():
        time.sleep(0.001)
        if time.monotonic() - began > timeout_s:
            raise DistributedTimeoutError(step, timeout_s, None,
                                          who="not every rank reached init_process_group()")


_BOUND_FINALIZE = """
import os, sys, time
pid, rank, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
end = time.monotonic() + limit
while time.monotonic() < end:
    time.sleep(0.1)
    if os.getppid() != pid:
        sys.exit(0)
print(f"tensorplay.distributed: rank {rank}: MPI's finalize did not return within {limit:g} s "
      "after the failure this job went on past (Open MPI's finalize after a ULFM failure, "
      "docs/elastic.md); ending it (SIGKILL): its work was done, every rank had met at the end",
      file=sys.stderr, flush=True)
os.kill(pid, 9)
"""


def _bound_finalize(rank: int) -> None:
    """Once the exit meeting is over in a job that went on past a failure: a watcher process
    that ends this one if MPI's finalize (mpi4py's, after this; no Python thread runs then)
    has not returned within FINALIZE_S, saying so. A backstop: with the communicators freed
    (``_free_before_finalize``) and no finalize fence (``--mca async_mpi_finalize 1``) Open
    MPI 5.0.11's finalize returned in every run here; without them it waited for ever in 1
    of 4 to 8 runs after a failure, and so did the in-band failure detector's finalize."""
    subprocess.Popen([sys.executable, "-c", _BOUND_FINALIZE, str(os.getpid()), str(rank),
                      str(FINALIZE_S)], stdin=subprocess.DEVNULL, close_fds=True)


def _abort(why: str) -> None:
    """Say why, then end the whole job: MPI_Abort, and this process at once even if MPI's
    abort returns (MPICH's may), so that no atexit handler runs after it. The pause lets the
    launcher forward what this rank printed before it tears the job down."""
    print(f"tensorplay.distributed: {why.rstrip('.')}; aborting the MPI job (MPI_Abort)",
          file=sys.stderr, flush=True)
    time.sleep(ABORT_PAUSE_S)
    # COMM_WORLD (MPICH's launcher then ends every process it started), but in a job that went
    # on past a failure the control communicator, which holds every rank there is now (a
    # spawned process has a COMM_WORLD of its own)
    failed_over = _WATCH is not None and _WATCH.failed_over
    (_WATCH.control if failed_over and _WATCH is not None else MPI.COMM_WORLD).Abort(1)
    os._exit(1)


