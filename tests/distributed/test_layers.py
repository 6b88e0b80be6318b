"""The tree is the architecture: each folder of the package may import only the folders below
it, checked here from the imports themselves (``test_import_graph.import_graph``: every
intra-package import, function bodies included; ``if TYPE_CHECKING:`` imports are types only
and left out), and the pure folders import nothing outside the standard library and numpy.

The layers, bottom up (docs/architecture.md draws them):

- ``geometry/`` and ``host/``: pure; each imports only itself and ``errors``;
- ``backends/``: the engines and their seam; also ``host``, ``geometry``, ``process_group``
  and two leaves of the control plane that an engine's barrier posts to (``control.keys``,
  ``control.arrivals``);
- ``control/``, ``job/``, ``mesh/``: one joined world; each other and the folders below;
- ``elastic/``: all of the above, and the public ``world`` and ``collectives``;
- ``launcher/``: ``host``, itself, and ``backends`` (torch's store, the warm process's
  preload): never the rank-side folders;
- the public doors (``world.py``, ``device_mesh.py``, ...) and ``tensor/``, ``fsdp/``: anything
  but the launcher (``run.py`` is the launcher's door).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.distributed.test_import_graph import PACKAGE, import_graph
from tests.distributed.test_imports import _all_imports

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "src" / "tensorplay" / "distributed"
FOLDERS = ("geometry", "host", "backends", "control", "job", "mesh", "elastic", "launcher",
           "tensor", "fsdp")
WORLD = {"host", "geometry", "backends", "process_group", "control", "job", "mesh"}
ALLOWED = {
    "geometry": set(),
    "host": set(),
    "backends": {"host", "geometry", "process_group", "control.keys", "control.arrivals"},
    "control": WORLD,
    "job": WORLD,
    "mesh": WORLD,
    "elastic": WORLD | {"elastic", "world", "collectives"},
    "launcher": {"host", "launcher", "backends"},
}
THIRD_PARTY = {"geometry": {"numpy"}, "host": set()}  # geometry/plot.py: matplotlib, lazily
LAZY_EXTRA = {"geometry/plot.py": {"matplotlib"}}


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE).lstrip(".")


def _folder(short: str) -> str:
    """'control.store' -> 'control'; 'world' -> 'world' (a top-level module is its own)."""
    return short.split(".")[0]


def _allowed(source: str, target: str) -> bool:
    folder = _folder(source)
    if folder not in ALLOWED or _folder(target) in (folder, "errors"):
        return True
    rules = ALLOWED[folder]
    return _folder(target) in rules or target in rules


def wrong_edges(graph: dict[str, set[str]]) -> list[str]:
    """'mesh.value -> world' for each import that points up or sideways out of its layer."""
    wrong = []
    for source, targets in sorted(graph.items()):
        s = _short(source)
        for t in sorted(_short(t) for t in targets):
            if t and not _allowed(s, t):
                wrong.append(f"{s} -> {t}")
    return wrong


def test_every_folder_imports_only_the_layers_below_it():
    assert wrong_edges(import_graph()) == []


def test_the_rule_catches_an_import_upwards():
    graph = {f"{PACKAGE}.geometry.spec": {f"{PACKAGE}.mesh.value", f"{PACKAGE}.errors"},
             f"{PACKAGE}.backends.mpi": {f"{PACKAGE}.control.keys", f"{PACKAGE}.job.failures"},
             f"{PACKAGE}.launcher.events": {f"{PACKAGE}.elastic.mesh", f"{PACKAGE}.host.wire"}}
    assert wrong_edges(graph) == ["backends.mpi -> job.failures", "geometry.spec -> mesh.value",
                                  "launcher.events -> elastic.mesh"]


def _outside_imports(path: Path) -> set[str]:
    """Top-level names imported anywhere in the file that are neither the standard library
    nor this package."""
    return {n for n in _all_imports(path)
            if n not in sys.stdlib_module_names and n != "tensorplay"}


def test_the_pure_folders_import_only_the_standard_library_and_numpy():
    wrong = {}
    for folder, allowed in THIRD_PARTY.items():
        for path in sorted((PACKAGE_DIR / folder).glob("*.py")):
            rel = f"{folder}/{path.name}"
            extra = _outside_imports(path) - allowed - LAZY_EXTRA.get(rel, set())
            if extra:
                wrong[rel] = sorted(extra)
    assert wrong == {}
