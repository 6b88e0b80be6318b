"""No import cycle in tensorplay.distributed, counting the imports inside functions too.

Every module is parsed with ast and every intra-package import anywhere in it (module level,
function bodies, ``if __name__ == "__main__":``) is an edge. ``from . import world`` in
device_mesh is an edge to the submodule tensorplay.distributed.world; ``from .errors import
bad_argument`` one to errors. Importing a submodule also runs its parent package's __init__,
but that implicit edge is left out: counted, every submodule would close a cycle with an
__init__ that imports it. Imports under ``if TYPE_CHECKING:`` never run, so they are left out
too (they name types for annotations only).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "tensorplay.distributed"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "src" / "tensorplay" / "distributed"


def _modules() -> dict[str, Path]:
    """Full module name -> file; a package is named by its __init__.py."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports, anywhere in its file (missing ones too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:  # import tensorplay.distributed.x -> x
                parts = alias.name.split(".")
                known = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
                targets.add(next((m for m in known if m in modules), alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from ..errors import e, in backends/torch_c10d.py -> errors
                base = package.rsplit(".", node.level - 1)[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:  # from . import x: the submodule x when there is one
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
    return {t for t in targets if (t == PACKAGE or t.startswith(PACKAGE + ".")) and t != name}


def _is_type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is an ``if TYPE_CHECKING:`` block."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None; depth-first, in sorted order so it is stable."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return [*stack[stack.index(node):], node]
        if node in done:
            return None
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt)
            if cycle:
                return cycle
        stack.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # __init__ loads device_mesh and collectives only inside its module __getattr__.
    assert {f"{PACKAGE}.device_mesh", f"{PACKAGE}.collectives"} <= graph[PACKAGE]
    # In a subpackage, from ..host import netif and from ..errors import ... resolve two levels up.
    assert {f"{PACKAGE}.host.netif", f"{PACKAGE}.errors"} <= graph[f"{PACKAGE}.backends.torch_c10d"]


def test_find_cycle_reports_the_modules_in_order():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_package_import_exists():
    modules = _modules()
    missing = sorted(f"{_short(m)} imports {_short(t)}" for m, targets in import_graph().items()
                     for t in targets if t not in modules)
    assert not missing, f"imports of modules that do not exist: {missing}"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(_short(m) for m in cycle)


def test_plan_needs_no_world():
    """plan reaches none of the engine modules, directly or through what it imports."""
    graph = import_graph()
    reached, todo = set(), [f"{PACKAGE}.plan"]
    while todo:
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    # the engine registry (backends/__init__) imports no engine; the engines below it do
    engine = {f"{PACKAGE}.{m}" for m in ("device_mesh", "world", "collectives")}
    bad = {m for m in reached if m in engine or m.startswith(f"{PACKAGE}.backends.")}
    assert not bad, f"plan imports {sorted(_short(m) for m in bad)}"


def test_plan_imports_only_the_standard_library_and_numpy():
    tree = ast.parse((PACKAGE_DIR / "plan.py").read_text())
    outside = {alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    outside |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and not node.level}
    assert outside - set(sys.stdlib_module_names) - {"numpy", "__future__"} == set()


def test_the_etcd_client_imports_no_torch():
    """backends/etcd.py is the launcher's too: the standard library and etcd's client only."""
    tree = ast.parse((PACKAGE_DIR / "backends" / "etcd.py").read_text())
    outside = {alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    outside |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and not node.level}
    assert outside - set(sys.stdlib_module_names) == {"etcd3gw", "requests"}


def test_the_launcher_reaches_an_engine_only_through_its_store():
    """The launcher loads torch only to serve the job's store: launcher.store is its one
    module that imports a torch engine module (backends.torch_store, inside its functions);
    the etcd store's modules import the etcd client, which imports nothing of the package
    (and no torch)."""
    graph = import_graph()
    launcher = {m for m in graph if m.startswith(f"{PACKAGE}.launcher")}
    engines = {m for m in graph if m.startswith(f"{PACKAGE}.backends.")}
    reach = {_short(m): sorted(_short(t) for t in graph[m] & engines) for m in launcher}
    reach = {m: t for m, t in reach.items() if t}
    assert reach.pop("launcher.store") == ["backends.torch_store"]
    assert {m for m, t in reach.items() if t != ["backends.etcd"]} == set(), reach
    assert set(reach) <= {"launcher.etcd_members", "launcher.etcd_nodes", "launcher.liveness",
                          "launcher.options"}  # options: is the client installed
    assert graph[f"{PACKAGE}.backends.etcd"] == set()
    assert graph[f"{PACKAGE}.launcher.rank_main"] == set()  # loaded by path in each rank
