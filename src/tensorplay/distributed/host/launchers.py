"""Which launcher started this process, and what its variables say: rank, size, local place,
rank 0's address.

One interface, ``Launcher``: the variables a launcher sets, as constants, and how they read
into a ``LaunchEnv``. One declaration per launcher in ``LAUNCHERS``, tried in this order; the
first whose variables are present wins:

1. torchrun / tensorplay-run / plain env:// -- RANK, WORLD_SIZE (+ LOCAL_*, MASTER_*).
2. Slurm ``srun`` -- SLURM_PROCID, SLURM_NTASKS, ... (only inside an srun step, see below).
3. Open MPI ``mpirun`` -- OMPI_COMM_WORLD_*.
4. MPICH / Intel MPI ``mpiexec`` (hydra) -- PMI_RANK, PMI_SIZE, MPI_LOCAL*.

The two MPI launchers differ in their variable names only, so each is one ``Launcher.mpi``
row; torchrun (which of three launchers set RANK) and Slurm (steps, node lists, a derived
port) each need a class of their own. Worked example: under ``mpiexec -n 12`` hydra sets
PMI_RANK=9, PMI_SIZE=12, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=3, and ``detect()`` is
``LaunchEnv(rank=9, world_size=12, local_rank=1, local_world_size=3, master_addr=None,
master_port=None, source='mpich')``.

Two rules keep Slurm honest. A batch script run without ``srun`` inherits SLURM_PROCID=0 and
the job's SLURM_NTASKS, so Slurm counts only inside an srun step (SLURM_STEP_NUM_TASKS,
SLURM_STEP_NODELIST or SLURM_STEP_NUM_NODES set). And ``mpirun`` inside an allocation starts
its remote daemons with ``srun``, so its ranks also see step variables that describe the daemons:
when an MPI launcher's rank or size disagrees with Slurm's, the MPI launcher wins.

Under Slurm without MASTER_ADDR/MASTER_PORT, the address is the first host of the step's node
list (where srun places task 0) and the port is SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN
(15000..29999, below Linux's ephemeral range), so every rank derives the same pair: job 123456
listens on 15000 + 123456 % 15000 = 18456.

What tensorplay-run alone tells its ranks (``TENSORPLAY_RUN_*``, the restart count) is
``host/wire.py``'s; the package's own settings (``TENSORPLAY_TIMEOUT``, ...) are
``host/knobs.py``'s.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LaunchEnvError
from .slurm import SLURM_JOB_ID, SLURM_PROCID, first_host

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TENSORPLAY_LAUNCHER = "TENSORPLAY_LAUNCHER"  # "tensorplay-run" in the ranks it starts

SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
SLURM_TASKS_PER_NODE_VARS = (
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
)
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_STEP_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES")
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 15000

OMPI_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"

PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"

_log = logging.getLogger("tensorplay.distributed")
_TASK_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process: its place in the world and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    source: str


def environ_of(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """The mapping to read: the given one, else os.environ."""
    return os.environ if environ is None else environ


def value(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of name; None when unset or blank: {"RANK": " 2 "} -> "2"."""
    text = env.get(name, "").strip()
    return text or None


def _first_set(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """(name, value) of the first of names that is set, else None."""
    return next(((n, v) for n in names if (v := value(env, n)) is not None), None)


def _unset(names: Sequence[str]) -> str:
    """Say that names are unset: 'X is not' for one, 'none of X, Y is' for several."""
    return f"{names[0]} is not" if len(names) == 1 else f"none of {', '.join(names)} is"


def as_int(name: str, text: str, minimum: int) -> int:
    """Parse text (the value of name) as an integer >= minimum."""
    try:
        number = int(text)
    except ValueError:
        raise LaunchEnvError(
            f"{name}={text!r}: not an integer. Fix: let the launcher set {name}, or set it to a"
            f" whole number >= {minimum}."
        ) from None
    if number < minimum:
        raise LaunchEnvError(
            f"{name}={number}: must be >= {minimum}. Fix: let the launcher set {name}, or set it"
            f" to a whole number >= {minimum}."
        )
    return number


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    """The value of name as an integer >= minimum; None when unset."""
    text = value(env, name)
    return None if text is None else as_int(name, text, minimum)


def _check_below(low_name: str, low: int | None, high: int | None, high_said: str) -> None:
    """Raise unless low < high (a rank below its world size); skip when either is unknown."""
    if low is not None and high is not None and low >= high:
        raise LaunchEnvError(
            f"{low_name}={low} is not below {high_said}: it must lie in 0..{high - 1}. Fix: these"
            " variables must come from one launch; let the launcher set them, or correct the ones"
            " set by hand."
        )


def _master_port(env: Mapping[str, str]) -> int | None:
    """MASTER_PORT as a TCP port; None when unset."""
    text = value(env, MASTER_PORT)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise LaunchEnvError(
            f"{MASTER_PORT}={text!r}: not a TCP port (an integer in 1..65535). Fix: set"
            f" {MASTER_PORT} to a free port such as 29500."
        )
    return int(text)


def _task_counts(name: str, text: str) -> list[int]:
    """Expand a Slurm tasks-per-node value: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASK_COUNT.fullmatch(item.strip())
        if match is None or int(match[1]) < 1:
            raise LaunchEnvError(
                f"{name}={text!r}: expected counts like '4' or '4(x2),3'. Fix: launch with srun,"
                f" which sets {name}, or unset it."
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


@dataclass(frozen=True)
class Launcher:
    """One launcher: the variables it sets and how they read into a LaunchEnv.

    ``size_vars`` are tried in order (Slurm's step count before its job count);
    ``local_size_var`` "" when the launcher has no such variable (then a subclass says).
    """

    name: str
    rank_var: str
    size_vars: tuple[str, ...]
    local_rank_var: str
    local_size_var: str
    fix: str

    @classmethod
    def mpi(cls, name: str, starter: str, rank_var: str, size_var: str, local_rank_var: str,
            local_size_var: str) -> Launcher:
        """An MPI launcher, read from its variables alone (no address: pass MASTER_ADDR):
        ``Launcher.mpi("openmpi", "mpirun", OMPI_RANK, ...)``."""
        return cls(name, rank_var, (size_var,), local_rank_var, local_size_var,
                   f"start the processes with {starter}, which sets {rank_var} and {size_var}.")

    def is_present(self, env: Mapping[str, str]) -> bool:
        """Whether any of this launcher's rank or size variables are set."""
        return _first_set(env, (self.rank_var, *self.size_vars)) is not None

    def source(self, env: Mapping[str, str]) -> str:
        """The LaunchEnv.source string."""
        return self.name

    def local_world_size(self, env: Mapping[str, str]) -> tuple[int | None, str]:
        """Processes on this host (None when the launcher does not say), and who said so."""
        size = _int(env, self.local_size_var, minimum=1)
        return size, f"{self.local_size_var}={size}"

    def master_addr(self, env: Mapping[str, str]) -> str | None:
        """Rank 0's host: MASTER_ADDR."""
        return value(env, MASTER_ADDR)

    def master_port(self, env: Mapping[str, str]) -> int | None:
        """Rank 0's port: MASTER_PORT."""
        return _master_port(env)

    def read(self, env: Mapping[str, str]) -> LaunchEnv:
        """Parse and check this launcher's variables."""
        rank_text = value(env, self.rank_var)
        size = _first_set(env, self.size_vars)
        if rank_text is None or size is None:
            given = f"{self.rank_var}={rank_text!r}" if size is None else f"{size[0]}={size[1]!r}"
            missing = _unset(self.size_vars if size is None else (self.rank_var,))
            raise LaunchEnvError(
                f"incomplete launcher variables: {given} is set but {missing}. Fix: {self.fix}"
            )
        size_name, size_text = size
        rank = as_int(self.rank_var, rank_text, 0)
        world_size = as_int(size_name, size_text, 1)
        _check_below(self.rank_var, rank, world_size, f"{size_name}={world_size}")
        local_rank = _int(env, self.local_rank_var)
        local_world_size, said = self.local_world_size(env)
        _check_below(self.local_rank_var, local_rank, local_world_size, said)
        return LaunchEnv(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            master_addr=self.master_addr(env),
            master_port=self.master_port(env),
            source=self.source(env),
        )


class Torchrun(Launcher):
    """torchrun, tensorplay-run, or variables set by hand for init_method='env://'."""

    def source(self, env: Mapping[str, str]) -> str:
        """'tensorplay-run', 'torchrun' or 'env'."""
        if value(env, TENSORPLAY_LAUNCHER) == "tensorplay-run":
            return "tensorplay-run"
        return "torchrun" if value(env, TORCHELASTIC_RUN_ID) is not None else "env"


class Slurm(Launcher):
    """Tasks started by srun (not a batch script run directly: see the module docstring)."""

    def is_present(self, env: Mapping[str, str]) -> bool:
        """Whether this is a task of an srun step."""
        in_step = _first_set(env, SLURM_STEP_VARS) is not None
        return in_step and value(env, SLURM_PROCID) is not None

    def local_world_size(self, env: Mapping[str, str]) -> tuple[int | None, str]:
        """Tasks on this node: from the tasks-per-node list, indexed by SLURM_NODEID if uneven:
        '3(x2),2' on node 2 -> 2."""
        found = _first_set(env, SLURM_TASKS_PER_NODE_VARS)
        if found is None:
            return None, ""
        name, text = found
        counts = _task_counts(name, text)
        if len(set(counts)) == 1:
            return counts[0], f"{name}={text!r} ({counts[0]} tasks a node)"
        node = _int(env, SLURM_NODEID)
        if node is None or node >= len(counts):
            return None, ""
        return counts[node], f"{name}={text!r} ({counts[node]} tasks on {SLURM_NODEID}={node})"

    def master_addr(self, env: Mapping[str, str]) -> str | None:
        """MASTER_ADDR, else the first host of the step's (or job's) node list."""
        addr = value(env, MASTER_ADDR)
        found = _first_set(env, SLURM_NODELIST_VARS)
        if addr is not None or found is None:
            return addr
        name, nodelist = found
        try:
            return first_host(nodelist)
        except ValueError as err:
            raise LaunchEnvError(
                f"{name}={nodelist!r}: cannot read its first host ({err}). Fix: set MASTER_ADDR"
                " to the host of task 0."
            ) from None

    def master_port(self, env: Mapping[str, str]) -> int | None:
        """MASTER_PORT, else one derived from SLURM_JOB_ID (``slurm_port``)."""
        return slurm_port(env)


def slurm_port(env: Mapping[str, str]) -> int | None:
    """MASTER_PORT, else one derived from SLURM_JOB_ID so that every task of the job agrees:
    job 123456 -> 18456; None when neither is set."""
    port = _master_port(env)
    job_id = _int(env, SLURM_JOB_ID)
    if port is not None or job_id is None:
        return port
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


LAUNCHERS: tuple[Launcher, ...] = (
    Torchrun("env", RANK, (WORLD_SIZE,), LOCAL_RANK, LOCAL_WORLD_SIZE,
             "launch with tensorplay-run or torchrun, which set both, or set RANK"
             " (0..WORLD_SIZE-1) and WORLD_SIZE in every process; unset both to run a single"
             " process."),
    Slurm("slurm", SLURM_PROCID, SLURM_SIZE_VARS, SLURM_LOCALID, "",
          "start the processes with srun, which sets SLURM_PROCID and SLURM_NTASKS for each"
          " task."),
    Launcher.mpi("openmpi", "mpirun", OMPI_RANK, OMPI_SIZE, OMPI_LOCAL_RANK, OMPI_LOCAL_SIZE),
    Launcher.mpi("mpich", "mpiexec", PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS),
)


def _try_read(launcher: Launcher, env: Mapping[str, str]) -> LaunchEnv | None:
    """launcher.read(env), or None when its variables are unusable."""
    try:
        return launcher.read(env)
    except LaunchEnvError:
        return None


def _place(launch: LaunchEnv) -> tuple[int, int]:
    """(rank, world_size): what two launchers must agree on."""
    return launch.rank, launch.world_size


def _verdict(launch: LaunchEnv, other: Launcher, env: Mapping[str, str]) -> str:
    """One line on a launcher whose variables were present but lost to launch.source."""
    try:
        seen = other.read(env)
    except LaunchEnvError as err:
        return f"{other.name} variables ignored (unusable: {err})"
    if _place(seen) == _place(launch):
        return f"{other.name} variables agree"
    return f"{other.name} says rank {seen.rank} of {seen.world_size}, ignored"


def _choose(present: list[Launcher], env: Mapping[str, str]) -> LaunchEnv:
    """Read the winning launcher; an MPI launcher overrides a Slurm step it disagrees with."""
    head, rest = present[0], present[1:]
    if isinstance(head, Slurm) and rest:
        slurm, mpi = _try_read(head, env), _try_read(rest[0], env)
        if mpi is not None and (slurm is None or _place(slurm) != _place(mpi)):
            head, rest = rest[0], [head, *rest[1:]]
    launch = head.read(env)
    _announce(launch, "; ".join(_verdict(launch, other, env) for other in rest))
    return launch


@functools.cache
def _announce(launch: LaunchEnv, shadowed: str) -> None:
    """Log the chosen launcher at debug level, once per distinct outcome."""
    _log.debug(
        "launcher: %s (rank %d of %d)%s",
        launch.source,
        launch.rank,
        launch.world_size,
        f"; {shadowed}" if shadowed else "",
    )


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Which launcher started us and what it says; None when no launcher variables are present."""
    env = environ_of(environ)
    present = [launcher for launcher in LAUNCHERS if launcher.is_present(env)]
    if present:
        return _choose(present, env)
    if value(env, SLURM_PROCID) is not None:
        _log.debug("Slurm batch environment outside an srun step: running as a single process")
    return None


def local_rank_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """LOCAL_RANK, else the detected launcher's local rank; None when neither says:
    under mpirun with OMPI_COMM_WORLD_LOCAL_RANK=2 and no LOCAL_RANK, 2."""
    env = environ_of(environ)
    local_rank = _int(env, LOCAL_RANK)
    if local_rank is not None:
        return local_rank
    launch = detect(env)
    return None if launch is None else launch.local_rank


def agent_store_attempt(environ: Mapping[str, str] | None = None) -> int | None:
    """torchrun's restart count when its agent already serves the store on MASTER_PORT.

    Then every rank, rank 0 included, connects as a client; None when we must serve it.
    TORCHELASTIC_USE_AGENT_STORE=True with TORCHELASTIC_RESTART_COUNT=2 -> 2 (the third try).
    """
    env = environ_of(environ)
    if value(env, TORCHELASTIC_USE_AGENT_STORE) != "True":
        return None
    restarts = value(env, TORCHELASTIC_RESTART_COUNT)
    return 0 if restarts is None else as_int(TORCHELASTIC_RESTART_COUNT, restarts, 0)


# what Open MPI's mpiexec needs for an elastic mesh (docs/elastic.md): its fault tolerance on,
# transports that report a lost peer, and no fence at finalize (after a failure it waited for
# ever in 1 of 4 to 8 runs here; the MPI engine's exit meeting is the barrier)
OPEN_MPI_ULFM_FLAGS = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca",
                       "async_mpi_finalize", "1")


def open_mpi_setting(name: str, environ: Mapping[str, str] | None = None) -> str:
    """An Open MPI setting its mpiexec hands every rank (``OMPI_MCA_<name>``: ``--with-ft
    ulfm`` sets ``mpi_ft_enable`` to 1, ``--mca btl tcp,self`` sets ``btl``), "" when unset."""
    return environ_of(environ).get(f"OMPI_MCA_{name}", "")
