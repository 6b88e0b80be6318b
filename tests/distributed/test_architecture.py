"""The map and the seams hold: docs/architecture.md lists exactly the modules on disk, store keys
are built in ``control/keys.py`` (the ranks') and ``launcher/keys.py`` (the launchers') only,
and only the control plane's store module reads a world's store."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tensorplay.distributed.control import keys
from tensorplay.distributed.launcher import keys as launcher_keys

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "tensorplay" / "distributed"
# where a store is met: the world that holds it, the control plane over it, the engines that
# make it and the launcher that serves its own
STORE_READERS = {"job/world.py", "job/lifecycle.py", "control/store.py"}
# World is written by its own methods only
WORLD_WRITERS = {"job/world.py"}
STORE_FOLDERS = ("backends/", "launcher/")
# the two modules that name store keys: the ranks' and the launchers'
KEY_MODULES = {"control/keys.py", "launcher/keys.py"}


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def _documented() -> list[str]:
    """The modules named in the first cell of a table row of docs/architecture.md."""
    names = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([\w/]+\.py)`", line.split(" | ")[0])
    return names


def test_the_architecture_table_lists_exactly_the_modules_on_disk():
    documented = _documented()
    assert len(documented) == len(set(documented)), "a module is listed twice"
    assert sorted(documented) == _modules()


def _key_prefixes() -> set[str]:
    """The first path part of every key template in keys: 'check/', 'tensorplay-run/', ..."""
    templates = [v for module in (keys, launcher_keys) for k, v in vars(module).items()
                 if k.isupper() and isinstance(v, str)]
    return {t.split("/", 1)[0] + "/" for t in templates if "/" in t}


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant and the leading text of every f-string, docstrings left out."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                found.append((node.lineno, head.value))
            docs.update(id(v) for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs):
            found.append((node.lineno, node.value))
    return found


def test_store_keys_are_built_in_keys_only():
    prefixes = _key_prefixes()
    assert {"check/", "elastic/", "recover/", "exchange/", "tensorplay-run/"} <= prefixes
    built = [f"{name}:{line}: {text!r}" for name in _modules() if name not in KEY_MODULES
             for line, text in _strings(ast.parse((PACKAGE / name).read_text()))
             if text.startswith(tuple(prefixes))]
    assert not built, built


def test_the_key_finder_finds_a_key_built_elsewhere():
    tree = ast.parse('"""check/ in a docstring is fine"""\nk = f"recover/e{epoch}/here"\n'
                     'j = "tensorplay-run/verdict"\n')
    texts = [t for _, t in _strings(tree) if t.startswith(tuple(_key_prefixes()))]
    assert texts == ["recover/e", "tensorplay-run/verdict"]


def test_only_the_control_plane_reads_a_worlds_store():
    readers = set()
    for name in _modules():
        if name in STORE_READERS or name.startswith(STORE_FOLDERS):
            continue
        tree = ast.parse((PACKAGE / name).read_text())
        if any(isinstance(n, ast.Attribute) and n.attr == "store" for n in ast.walk(tree)):
            readers.add(name)
    assert not readers, f"read .store above the control plane: {sorted(readers)}"


def _writes_to_a_world(tree: ast.AST) -> list[int]:
    """Lines that assign to an attribute of something called ``world`` or ``_world``."""
    def is_world(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id in ("world", "_world"))
                or (isinstance(node, ast.Attribute) and node.attr in ("world", "_world")))

    lines = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        lines += [node.lineno for t in targets
                  if isinstance(t, ast.Attribute) and is_world(t.value)]
    return lines


def test_no_module_writes_the_worlds_fields_but_world():
    writers = {name: lines for name in _modules() if name not in WORLD_WRITERS
               if (lines := _writes_to_a_world(ast.parse((PACKAGE / name).read_text())))}
    assert not writers, writers


def test_the_writer_finder_finds_writes():
    tree = ast.parse("world.elastic = (2, 4)\nmesh._world.host_pids[3] = 7\n"
                     "self._world.alive = False\nx = world.rank\n")
    assert _writes_to_a_world(tree) == [1, 3]
