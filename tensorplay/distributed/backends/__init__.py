"""The engine registry: which engine runs which backend. The one list of backend names.

Each engine module is the only importer of its engine (torch for ``torch_c10d``) and is
loaded on first use, so naming a backend costs nothing until a world starts on it. A new
engine adds one entry here and one module beside this file; nothing above ``backends/``
changes.

    engine_for("gloo").name          # 'torch' (loads torch)
    engine_name("fake")              # 'fake' (loads nothing)
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._engine import Engine, Running

# backend -> (engine name, module under backends/)
_REGISTRY: dict[str, tuple[str, str]] = {
    "gloo": ("torch", "torch_c10d"),
    "nccl": ("torch", "torch_c10d"),
    "fake": ("fake", "fake"),
}
BACKENDS: tuple[str, ...] = tuple(_REGISTRY)
# engine module -> the module whose presence in sys.modules means a world may already run
# there (started outside this package, e.g. by Lightning or accelerate)
_ADOPTABLE = {"torch_c10d": "torch.distributed"}
DEFAULT_ENGINE_MODULE = "torch_c10d"  # asked for the default backend when none is named
_loaded: dict[str, Engine] = {}


def engine_name(backend: str) -> str | None:
    """Name of the engine that runs ``backend``, None for an unknown backend (loads nothing)."""
    entry = _REGISTRY.get(backend)
    return None if entry is None else entry[0]


def engine_for(backend: str) -> Engine:
    """The engine that runs ``backend`` (a known name), imported on first use."""
    return _load(_REGISTRY[backend][1])


def default_backend() -> str:
    """The backend a world starts on when the user names none."""
    return _load(DEFAULT_ENGINE_MODULE).default_backend()


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


def _load(module: str) -> Engine:
    engine = _loaded.get(module)
    if engine is None:
        engine = importlib.import_module(f"{__name__}.{module}").ENGINE
        _loaded[module] = engine
    return engine
