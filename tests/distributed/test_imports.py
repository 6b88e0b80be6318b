"""Imports go one way: pure modules need no engine, backends never import the mesh."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tensorplay" / "distributed"
PURE = ["_layout", "_mesh_spec", "_mesh_args", "_env", "errors", "run", "_topology",
        "_describe", "_plot", "_plan"]
ENGINES = {"torch", "mpi4py"}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported at module level (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_engine(module):
    assert not _module_level_imports(PACKAGE / f"{module}.py") & ENGINES


def test_device_mesh_and_world_do_not_import_torch_at_module_level():
    for module in ("device_mesh", "world", "process_group", "_consensus"):
        assert "torch" not in _module_level_imports(PACKAGE / f"{module}.py"), module


def test_backends_never_import_the_mesh():
    for path in (PACKAGE / "backends").glob("*.py"):
        imported = _module_level_imports(path)
        assert not any("device_mesh" in name for name in imported), path.name


def test_launcher_and_package_load_without_torch():
    code = ("import sys, tensorplay.distributed, tensorplay.distributed.run;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
