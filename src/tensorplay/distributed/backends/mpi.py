"""The MPI engine, on mpi4py: numpy arrays and CPU torch tensors moved by the MPI library of
the environment (``pip install mpi4py mpich``: no compiler, no system MPI). With
``mpi_collectives.py`` beside it, the only place that imports mpi4py; loading this module
initialises MPI (mpi4py does at import).

A world is MPI's COMM_WORLD as ``mpiexec -n 8 python job.py`` (or srun, or mpirun) started
it; our world group is a duplicate of it. A group is a communicator made with
``Comm.Create_group`` by its members only (measured against one ``Comm.Split`` per dim in
bench/README.md). The collectives are MPI's blocking ones, called as raw mpi4py calls them.

MPI waits forever; nothing here does:

- every blocking call runs under the watchdog, a thread of each process (``watched``). It
  reads the control messages every LOOK_S; past the world's timeout it asks the other members
  what they are doing (each watchdog answers, also for a rank busy in its own code), prints
  the DistributedTimeoutError naming who never came and what the others wait in, and aborts
  the job (a blocking MPI call cannot be interrupted; the job could not go on anyway);
- a rank that ends with an uncaught exception prints it, names itself and calls
  ``COMM_WORLD.Abort(1)``, which ends every rank (as ``python -m mpi4py`` does);
- at the end of its script every rank meets the others at rank 0 before MPI's finalize (which
  waits for every rank, forever). A rank still waiting there after EXIT_GRACE_S tells every
  rank that it has left, so that a call waiting for it ends the job at once naming it
  (``RankFailedError``); a meeting that lasts the whole timeout aborts the job, naming the
  ranks that never came;
- a rank that ends its script tells the other members of each of its groups its final call
  count of that group (``tell_ended``, from the control plane at destroy_process_group): a
  member blocked in a call on that group whose number is higher (``group.calls``) knows that
  nobody will ever pair it, and prints the ``CallMismatchError`` naming who made how many
  calls, then aborts the job, within SETTLE_S instead of the timeout;
- a killed rank: every rank watches the processes of the ranks on its host (pids met at
  join, watched through pidfds, or ``_procfs`` where there are none) and, when one is gone,
  prints the ``RankFailedError`` naming it by rank and pid and aborts the job. Under MPICH's
  mpiexec this is only seen with ``mpiexec -disable-auto-cleanup``: by default mpiexec
  SIGKILLs every rank within milliseconds of the death, before a watchdog can speak, and names
  the pid of whichever rank it reaped first (often not the dead one). Rank 0 still prints each
  rank's pid as the job starts (docs/engines.md).

Under the collectives lies the control communicator, a second duplicate of COMM_WORLD that
user code never sees, made once per process: ``allgather_text`` (the store-less cross-rank
check, host names, call counts), leave notices, final counts, queries and the exit meeting
travel there (nonblocking sends, read by the watchdog), so they never pair with a user's
collective.
"""

from __future__ import annotations

import _thread
import atexit
import hashlib
import os
import select
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import _env, _procfs
from .._engine import Capabilities, Engine, FailureKind, GathersText, Running, Started
from .._failures import FIX_FAILED
from ..errors import (
    BackendError,
    CallMismatchError,
    DistributedError,
    DistributedTimeoutError,
    LaunchEnvError,
    RankFailedError,
    bad_argument,
    format_ranks,
    rank_words,
)
from . import torch_engine_installed

LOOK_S = 0.05  # how often the watchdog reads control messages and looks at the call in progress
EXIT_GRACE_S = 1.0  # at exit, how long a rank waits for the others before saying it left
SETTLE_S = 1.0  # after a timeout, how long a rank collects the others' answers
ABORT_PAUSE_S = 0.5  # between printing why this rank aborts the job and aborting it
QUERY_LIMIT = 4096  # groups larger than this are not asked who is missing (O(size) messages)
# tags of the control communicator; Create_group uses tags from _GROUP_TAGS up
_LEFT, _QUERY, _ANSWER, _EXIT, _GO, _ENDED = 1, 2, 3, 4, 5, 6
_GROUP_TAGS = 64
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


def _tag(name: str) -> int:
    """The Create_group tag of the group called ``name`` (every MPI allows tags to 32767)."""
    digest = int(hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8], 16)
    return _GROUP_TAGS + digest % (32767 - _GROUP_TAGS)


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


class MpiEngine:
    """The MPI engine (``_engine.Engine``, no capability): COMM_WORLD, communicators, polled
    waits. No mesh objects of its own (``NativeMeshes``: DTensor needs torch's groups) and no
    elastic meshes (``Severable``: they need a store, which it lacks)."""

    name = "mpi"
    capabilities = Capabilities(simulated=False, has_store=False, can_abort=False)

    def __init__(self) -> None:
        self.timeout_s = _env.DEFAULT_TIMEOUT_S
        self._control: Any = None  # this process's control communicator, once joined
        self._made: list[Any] = []  # the communicators of the current world (world first)
        self._left: set[int] = set()  # ranks that said they left (read by the watchdog)
        self._world_n = 0  # which world of this process (ended notices of older ones are old)
        # group name -> {rank: its final calls on it}, from ended notices of this world
        self._ended: dict[str, dict[int, int]] = {}
        self._stray_seen: dict[str, float] = {}  # group name -> when a stray was first seen
        self._told: list[tuple[Any, Any]] = []  # ended notices in flight, with their bodies
        self._mates: dict[int, tuple[int, Any]] = {}  # host-mates: rank -> (pid, pidfd/start)
        self._doing: str | None = None  # what the main thread does outside a watched call
        # the blocking MPI call in progress: (what, group, since, members), see watched()
        self.call: tuple[str, Any, float, Sequence[int] | None] | None = None
        self._stop, self._stopped = threading.Event(), threading.Event()  # the watchdog's

    # -- the world -------------------------------------------------------------------------
    def default_backend(self) -> str:
        return "mpi"

    def check_available(self, backend: str) -> None:
        """mpi4py imported and found an MPI library: nothing more to check."""

    def start(self, backend: str, init_method: str, *, rank: int, world_size: int,
              timeout: timedelta, master: tuple[str, int] | None) -> Started:
        """Join COMM_WORLD, once the launcher's rank and size are MPI's."""
        if not init_method.startswith("env://"):
            raise bad_argument("init_method", init_method, "the mpi backend joins the world "
                               "that mpiexec started and takes no address",
                               "leave init_method out")
        size, me = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
        if (me, size) != (rank, world_size):
            raise _size_error(me, size, rank, world_size)
        return self._join(timeout)

    def running(self) -> Running | None:
        """MPI's world when the user's ``from mpi4py import MPI`` started it, unless it is a
        1-process world under a launcher of more (torchrun starts each process alone)."""
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return None
        size = MPI.COMM_WORLD.Get_size()
        launch = _env.detect()
        if launch is not None and launch.world_size != size:
            return None
        return Running("mpi", MPI.COMM_WORLD.Get_rank(), size)

    def adopt(self, timeout: timedelta) -> Started:
        """The running MPI world: its communicators are made as for a world we started."""
        return self._join(timeout)

    def _join(self, timeout: timedelta) -> Started:
        self.timeout_s = timeout.total_seconds()
        step = "init_process_group(): joining the MPI world"
        if self._control is None:  # once per process: the control plane, then its watchdog
            control, request = MPI.COMM_WORLD.Idup()
            _poll(request, step, self.timeout_s)
            self._control = control
            self._hook()
            self._meet_mates(step)
        self._world_n += 1
        self._ended, self._stray_seen = {}, {}
        self._made = [self.watched(step, None, None, MPI.COMM_WORLD.Dup)]
        return Started(self._made[0], None)

    def _meet_mates(self, step: str) -> None:
        """Every rank's pid and host, once per process. Under MPICH's mpiexec the watchdog
        watches the processes of the other ranks on this host (``_dead_mate``), and rank 0
        prints each rank's pid (mpiexec names a failed rank by pid only). Not under Open MPI:
        its ULFM mode (``--with-ft ulfm``) keeps the survivors going, and their calls fail
        naming the lost ranks."""
        launch = _env.detect()
        if launch is None or launch.source != "mpich":  # the same on every rank
            return
        me = MPI.COMM_WORLD.Get_rank()
        pairs = [t.split(" ", 1) for t in self.allgather_text(f"{os.getpid()} {_host_key()}",
                                                              step)]
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
            if isinstance(w, str) and (not _procfs.alive(pid) or _start_time(pid) != w):
                return rank, pid
        return None

    def tell_ended(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """Send each other member of each group this rank's final count of it (nonblocking,
        on the control communicator; small enough to leave at once). Read by the members'
        watchdogs (``_stray``)."""
        control, me = self._control, MPI.COMM_WORLD.Get_rank()
        for name, (members, calls) in counts.items():
            body = np.frombuffer(f"{self._world_n} {calls} {name}".encode(), dtype=np.uint8)
            self._told += [(control.Isend(body, r, _ENDED), body) for r in members if r != me]

    def destroy(self, adopted: bool) -> None:
        """Free this world's communicators. MPI itself stays up (it cannot start twice);
        mpi4py finalizes it at exit, after the exit meeting."""
        made, self._made = self._made, []
        if MPI.Is_finalized():
            return
        for comm in made:
            comm.Free()

    # -- groups ------------------------------------------------------------------------------
    def new_group(self, name: str, ranks: Any, backend: str, timeout: timedelta,
                  desc: str, *, apart: bool = False) -> Any:
        """The communicator of ``ranks`` in this order: ``Create_group``, by its members (no
        store: ``apart`` changes nothing)."""
        members = ranks.tolist()
        step = f"creating the group [{format_ranks(members)}] ({desc})"
        world = self._made[0]
        group = world.Get_group().Incl(members)
        try:
            comm = self.watched(step, None, members, world.Create_group, group, _tag(name))
        finally:
            group.Free()
        self._made.append(comm)
        return comm

    def ops(self, engine_group: Any, group: Any, failed: Any) -> Any:
        from .mpi_collectives import MpiGroupOps

        return MpiGroupOps(self, engine_group, group, failed)

    def group_members(self, obj: object) -> tuple[list[int], str] | None:
        """(world ranks in group order, 'mpi') of an mpi4py communicator the user made."""
        if not isinstance(obj, MPI.Intracomm) or obj == MPI.COMM_NULL:
            return None
        ranks = MPI.Group.Translate_ranks(obj.Get_group(), list(range(obj.Get_size())),
                                          MPI.COMM_WORLD.Get_group())
        return [int(r) for r in ranks], "mpi"

    # -- what an error means --------------------------------------------------------------
    def classify(self, err: BaseException) -> FailureKind | None:
        """Our waits' failures, and MPI's own (ULFM's "process failed" is a lost peer)."""
        if not isinstance(err, MPI.Exception):
            return None
        lost = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_REVOKED")} - {None}
        return "peer_lost" if err.Get_error_class() in lost else "other"

    def lost_ranks(self, comm: Any, err: BaseException) -> list[int] | None:
        """The world ranks of ``comm`` that failed, when ``err`` is ULFM's "process failed"
        (Open MPI's ``mpiexec --with-ft ulfm``); None otherwise."""
        if self.classify(err) != "peer_lost":
            return None
        try:
            failed = comm.Get_failed()
            return sorted(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                                    MPI.COMM_WORLD.Get_group()))
        except (MPI.Exception, NotImplementedError):  # an MPI without ULFM's calls
            return None

    def backend_for_device(self, device_type: str, world_backend: str) -> str:
        return world_backend

    def use_device(self, device_type: str) -> None:
        """CPU memory only: the MPI wheels are not CUDA-aware."""
        if device_type != "cpu":
            raise bad_argument("device_type", device_type, "the mpi backend moves CPU memory "
                               "only (numpy arrays, CPU tensors)",
                               "use device_type='cpu', or backend='nccl' for GPUs")

    def rank_array(self, array: Any) -> Any:
        """The numpy array itself."""
        return array

    def allgather_text(self, text: str, step: str) -> list[str]:
        """Every rank's ``text`` in rank order. One all-gather of fixed slots when every text
        fits one (digests, host names), else a second of the lengths and the bytes."""
        data = text.encode()
        control = self._control
        slot = np.zeros(_SLOT, dtype=np.uint8)
        slot[0] = len(data) if len(data) < _SLOT else _SLOT  # _SLOT: "does not fit"
        if len(data) < _SLOT:
            slot[1:1 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        slots = np.zeros((control.Get_size(), _SLOT), dtype=np.uint8)
        self.watched(step, None, None, control.Allgather, slot, slots)
        if (slots[:, 0] < _SLOT).all():
            return [row[1:1 + row[0]].tobytes().decode() for row in slots]
        lengths = np.zeros(control.Get_size(), dtype=np.int64)
        self.watched(step, None, None, control.Allgather,
                     np.array([len(data)], dtype=np.int64), lengths)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out = np.zeros(int(lengths.sum()), dtype=np.uint8)
        self.watched(step, None, None, control.Allgatherv, np.frombuffer(data, dtype=np.uint8),
                     [out, lengths, starts, MPI.BYTE])
        raw = out.tobytes()
        return [raw[s:s + n].decode() for s, n in zip(starts.tolist(), lengths.tolist(),
                                                       strict=True)]

    # -- waiting: blocking MPI calls, watched ---------------------------------------------
    def watched(self, what: str, group: Any, members: Sequence[int] | None,
                call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a blocking MPI call, with the watchdog watching it: ``what`` (on
        ``group``, when given) names it; ``members`` (None: the world) are the ranks it
        waits for."""
        self.call = (what, group, time.monotonic(), members)
        try:
            return call(*args)
        finally:
            self.call = None

    def _who_is_missing(self, members: Sequence[int] | None) -> MpiWaitError:
        """Ask the other members what they are doing (the watchdog of each answers, even in
        the user's own code); those in another call, or not answering, are named. Runs on
        the watchdog thread."""
        me = MPI.COMM_WORLD.Get_rank()
        group: Sequence[int] = range(self._control.Get_size()) if members is None else members
        if len(group) > QUERY_LIMIT:
            return MpiWaitError(f"the other members of a group of {len(group)} did "
                                "not answer (groups this large are not asked who is missing)",
                                None)
        others = [r for r in group if r != me]
        sends = [self._control.Isend(_ONE, r, _QUERY) for r in others]
        answers: dict[int, str] = {}
        status = MPI.Status()
        deadline = time.monotonic() + SETTLE_S
        answering: list[tuple[Any, Any]] = []
        while len(answers) < len(others) and time.monotonic() < deadline:
            while self._control.Iprobe(MPI.ANY_SOURCE, _ANSWER, status):
                body = bytearray(status.Get_count(MPI.BYTE))
                self._control.Recv(body, status.Get_source(), _ANSWER)
                answers[status.Get_source()] = body.decode()
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
        progress (``self.call``) waits for a rank that left, or past the timeout, say why
        and abort the job (a blocking MPI call cannot be interrupted)."""
        sends: list[tuple[Any, Any]] = []
        me = MPI.COMM_WORLD.Get_rank()
        control_works = True
        try:
            while not self._stop.wait(LOOK_S) and not MPI.Is_finalized():  # by the user, say
                try:
                    sends = self._service(sends) if control_works else []
                except MPI.Exception:  # a failed process (ULFM): the main thread's call
                    control_works = False  # says so; only the timeout is watched from now
                call = self.call
                if call is None:
                    continue
                what, group, since, members = call
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
                elif time.monotonic() - since > self.timeout_s:
                    err = (self._who_is_missing(members) if control_works else MpiWaitError(
                        "the control messages failed, so nobody was asked", None)
                           ).ours(where, self.timeout_s)
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
        by_count: dict[int, list[int]] = {mine: [MPI.COMM_WORLD.Get_rank()]}
        for rank, calls in heard.items():
            by_count.setdefault(calls, []).append(rank)
        return CallMismatchError(group.label, by_count)

    def _service(self, sends: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """Read leave and ended notices, answer queries; returns the answers still in
        flight."""
        control, status = self._control, MPI.Status()
        while control.Iprobe(MPI.ANY_SOURCE, _LEFT, status):
            control.Recv(np.zeros(1, dtype=np.uint8), status.Get_source(), _LEFT)
            self._left.add(status.Get_source())
        while control.Iprobe(MPI.ANY_SOURCE, _ENDED, status):
            body = bytearray(status.Get_count(MPI.BYTE))
            control.Recv(body, status.Get_source(), _ENDED)
            world_n, calls, name = body.decode().split(" ", 2)
            if int(world_n) == self._world_n:
                self._ended.setdefault(name, {})[status.Get_source()] = int(calls)
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
            if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1 or hasattr(sys, "ps1"):
                return
            rank = MPI.COMM_WORLD.Get_rank()
            _abort(f"rank {rank} ended with an uncaught {kind.__name__} (so that no rank "
                   "waits for it)")

        sys.excepthook = abort_on_error
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if MPI.Is_finalized():
            return
        rank = MPI.COMM_WORLD.Get_rank()
        try:
            self._exit_meeting(rank)
        except MpiWaitError as err:
            _abort(f"rank {rank} at the end of its script: {err.words}")
        self._stop.set()  # no thread may call MPI while it finalizes
        self._stopped.wait(2 * LOOK_S + 1)
        self._service([])  # late notices and queries, so that none is left unread

    def _exit_meeting(self, rank: int) -> None:
        """Meet every rank at rank 0 before MPI's finalize (which waits for all, forever).

        A rank still here after EXIT_GRACE_S tells every rank that it has left; a meeting
        that lasts the timeout names the ranks that never came.
        """
        control, size = self._control, self._control.Get_size()
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
                me = MPI.COMM_WORLD.Get_rank()
                told = [self._control.Isend(_ONE, r, _LEFT)
                        for r in range(self._control.Get_size()) if r != me]
            if waited > self.timeout_s + (0 if arrivals is not None else 2 * SETTLE_S):
                if arrivals is None:
                    raise MpiWaitError(f"waited {waited:.0f} s for rank 0 to see "
                                       "every rank end", None)
                missing = [r for r, q in zip(arrivals, requests, strict=True) if not q.Test()]
                raise MpiWaitError(f"waited {waited:.0f} s for {rank_words(missing)}"
                                   ", which never ended (hung, or still busy)", missing)
        return told


def _host_key() -> str:
    """This host as far as pids go: its name and this process's pid namespace (two
    containers on one host see different pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{_env.hostname()}/{namespace}"


def _start_time(pid: int) -> str | None:
    fields = _procfs.stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _watch_handle(pid: int) -> int | str | None:
    """How the watchdog watches process ``pid``: a pidfd (readable once it ends), else its
    start time in /proc; None when it cannot be watched (gone already, or no /proc)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (macOS, Linux < 5.3), or the pid is gone
        start = _start_time(pid)
        return start if start is not None and _procfs.alive(pid) else None


def _poll(request: Any, step: str, timeout_s: float) -> None:
    """Wait for ``request`` up to ``timeout_s`` (before the watchdog runs)."""
    began = time.monotonic()
    while not request.Test():
        time.sleep(0.001)
        if time.monotonic() - began > timeout_s:
            raise DistributedTimeoutError(step, timeout_s, None,
                                          who="not every rank reached init_process_group()")


def _abort(why: str) -> None:
    """Say why, then end the whole job: MPI_Abort, and this process at once even if MPI's
    abort returns (MPICH's may), so that no atexit handler runs after it. The pause lets the
    launcher forward what this rank printed before it tears the job down."""
    print(f"tensorplay.distributed: {why.rstrip('.')}; aborting the MPI job (MPI_Abort)",
          file=sys.stderr, flush=True)
    time.sleep(ABORT_PAUSE_S)
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)


def _size_error(me: int, size: int, rank: int, world_size: int) -> DistributedError:
    """Why MPI's world is not the one the launcher's variables (or the arguments) describe."""
    launch = _env.detect()
    said = f"the launcher ({launch.source})" if launch is not None else "the arguments"
    if size == 1 and world_size > 1:
        line = f"mpiexec -n {world_size} python {_script_words()}"
        if torch_engine_installed():
            return LaunchEnvError(
                f"init_process_group('mpi'): {said} says rank {rank} of {world_size}, but MPI "
                f"sees a world of 1: this process was not started by an MPI launcher (torchrun "
                f"and tensorplay-run start each process as its own 1-process MPI world). Fix: "
                f"start the job with {line} (or srun, or mpirun), or use backend='gloo' under "
                f"torchrun."
            )
        return LaunchEnvError(
            f"init_process_group('mpi'): {said} says rank {rank} of {world_size}, but MPI "
            f"sees a world of 1: this process was not started by an MPI launcher, which the "
            f"MPI engine (the one engine here: torch is not installed) needs. Fix: start the "
            f"job with {line} (or srun, or mpirun)."
        )
    return BackendError(
        f"init_process_group('mpi'): MPI says this is rank {me} of {size}, but {said} says "
        f"rank {rank} of {world_size}. Fix: leave rank and world_size out under mpiexec, or "
        f"pass MPI's own."
    )


def _script_words() -> str:
    """This process's script and arguments as a command line shows them (``python -m`` runs
    show the module's file), or ``script.py`` when there is none (an interactive session)."""
    argv = sys.argv if sys.argv and sys.argv[0] not in ("", "-c") else ["script.py"]
    return shlex.join(argv)


ENGINE = MpiEngine()
_CLAIMS: tuple[Engine, GathersText] = (ENGINE,) * 2  # mypy: the core and 1 capability
