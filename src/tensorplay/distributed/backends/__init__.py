"""The engine registry: which engine runs which backend. The one list of backend names.

Each engine module is the only importer of its engine (torch for ``torch_c10d``, mpi4py for
``mpi``) and is loaded on first use, so naming a backend costs nothing until a world starts
on it, and an engine that is not installed costs nothing until it is asked for (then
BackendError says which extra installs it). A new engine adds one entry here and one module
beside this file; nothing above ``backends/`` changes.

    engine_for("gloo").name          # 'torch' (loads torch)
    engine_name("fake")              # 'fake' (loads nothing)
    default_backend()                # 'mpi' under mpiexec without MASTER_ADDR, else 'gloo'
    rank_array(engine, array)        # mesh.mesh: a tensor in a torch world (or a fake one)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from ..errors import BackendError
from ..host import launchers

if TYPE_CHECKING:
    from .protocol import Engine, Running

# backend -> (engine name, module under backends/)
_REGISTRY: dict[str, tuple[str, str]] = {
    "gloo": ("torch", "torch_c10d"),
    "nccl": ("torch", "torch_c10d"),
    "fake": ("fake", "fake"),
    "mpi": ("mpi", "mpi"),
}
BACKENDS: tuple[str, ...] = tuple(_REGISTRY)
# engine module -> the module whose presence in sys.modules means a world may already run
# there (started outside this package: torch.distributed by Lightning or accelerate, MPI by
# the user's own ``from mpi4py import MPI``)
_ADOPTABLE = {"torch_c10d": "torch.distributed", "mpi": "mpi4py.MPI"}
# engine module -> (the distribution it imports, the extra of ours that installs it, and what
# else it needs to load)
_NEEDS = {
    "torch_c10d": ("torch", "torch", "a torch build for this platform"),
    "mpi": ("mpi4py", "mpi", "an MPI library: pip install mpich (Linux, macOS), or Microsoft "
            "MPI on Windows"),
}
# launchers that start MPI jobs: under them, with no MASTER_ADDR for a torch rendezvous, the
# default backend is MPI's
_MPI_LAUNCHERS = ("openmpi", "mpich")
_loaded: dict[str, Engine] = {}


def engine_name(backend: str) -> str | None:
    """Name of the engine that runs ``backend``, None for an unknown backend (loads nothing)."""
    entry = _REGISTRY.get(backend)
    return None if entry is None else entry[0]


def engine_for(backend: str) -> Engine:
    """The engine that runs ``backend`` (a known name), imported on first use."""
    return _load(_REGISTRY[backend][1])


def default_backend() -> str:
    """The backend a world starts on when the user names none: MPI's under mpiexec or
    mpirun when no MASTER_ADDR asks for a torch rendezvous, else torch's (nccl with CUDA,
    else gloo); whichever of the two is installed when only one is."""
    launch = launchers.detect()
    order = ["torch_c10d", "mpi"]
    if launch is not None and launch.source in _MPI_LAUNCHERS and launch.master_addr is None:
        order.reverse()
    for module in order:
        if _installed(module):
            return _load(module).default_backend()
    raise BackendError(
        "init_process_group(): no engine is installed (neither torch nor mpi4py). Fix: pip "
        "install 'tensorplay-distributed[mpi]' (numpy users) or 'tensorplay-distributed[torch]'."
    )


def rank_array(engine: Engine, array: Any) -> Any:
    """A mesh's rank array (numpy int64) as the users of ``engine`` expect it. A simulated
    world stands in for a real one: its array is as the torch engine gives it (an int64
    tensor) where torch is installed (loading it), else the numpy array, as MPI's is."""
    if engine.capabilities.simulated and _installed("torch_c10d"):
        engine = _load("torch_c10d")
    return engine.rank_array(array)


def launcher_can_serve_store() -> bool:
    """Whether tensorplay-run can serve a job's store here: torch's TCPStore, the store the
    torch engine's ranks (and torchrun's agent) use, is installed (imports nothing)."""
    return _installed("torch_c10d")


def mpiexec_engine_installed() -> bool:
    """Whether the engine that an MPI launcher's ranks run on (mpi4py) is installed: without
    torch the one engine of a real job, started by ``mpiexec`` (imports nothing)."""
    return _installed("mpi")


def torch_engine_installed() -> bool:
    """Whether torch's engine is installed (imports nothing): what error messages may point
    at (gloo, torchrun) only where it is."""
    return _installed("torch_c10d")


# what a warm launcher process imports once for every rank it forks: the engines' libraries
WARM_MODULES = ("numpy", "torch")


def fork_unsafe() -> str | None:
    """Why forking this process is unsafe for the engines' libraries loaded in it, or None:
    an accelerator runtime (CUDA) initialised here cannot be used in a forked child."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an accelerator runtime (CUDA) is initialised in the warm process"
    return None


def reseed_forked() -> None:
    """In a forked rank: the engines' random generators as a fresh interpreter has them
    (numpy's from the OS; torch's at its start seed, a constant in every fresh interpreter)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.manual_seed(torch.initial_seed())


def running_world() -> tuple[Engine, Running] | None:
    """An engine whose world was started outside this package, and that world; None when
    there is none (imports no engine that is not loaded already)."""
    for module, marker in _ADOPTABLE.items():
        if marker in sys.modules:
            engine = _load(module)
            found = engine.running()
            if found is not None:
                return engine, found
    return None


def _installed(module: str) -> bool:
    """Whether the engine that ``module`` wraps is installed (imports nothing)."""
    need = _NEEDS.get(module)
    if need is None or need[0] in sys.modules:
        return True
    try:
        return importlib.util.find_spec(need[0]) is not None
    except ImportError:  # a finder that refuses the name: not importable here
        return False


def _load(module: str) -> Engine:
    engine = _loaded.get(module)
    if engine is None:
        names = [repr(b) for b, (_, m) in _REGISTRY.items() if m == module]
        backends = ("backends " if len(names) > 1 else "backend ") + " and ".join(names)
        if not _installed(module):
            dist, extra, _ = _NEEDS[module]
            raise BackendError(
                f"{backends} need{'' if len(names) > 1 else 's'} {dist}, which is not "
                f"installed. Fix: pip "
                f"install 'tensorplay-distributed[{extra}]' (or pip install {dist}), or use "
                f"another backend of {BACKENDS}."
            )
        try:
            engine = importlib.import_module(f"{__name__}.{module}").ENGINE
        except (ImportError, OSError, RuntimeError) as err:  # installed, but cannot load
            raise BackendError(
                f"{backends} cannot load {_NEEDS[module][0]}: {err}. Fix: install "
                f"{_NEEDS[module][2]}."
            ) from err
        _loaded[module] = engine
    return engine
