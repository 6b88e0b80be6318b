"""Engines are imported by their own modules only, and the package loads without any;
the folders' layers are tests/distributed/test_layers.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tensorplay" / "distributed"
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


# the torch engine: the only files that may import torch, anywhere in them (a torch tensor
# handed to the MPI engine is seen through its own methods and sys.modules)
TORCH_ENGINE = {"backends/torch_c10d.py", "backends/torch_collectives.py",
                "backends/torch_mesh.py", "backends/torch_store.py",
                "backends/torch_rendezvous.py", "backends/torch_etcd.py",
                # torch's DTensor and tensor parallelism on our mesh: adapters of torch's own
                # functions by nature (they take and return torch tensors and modules); the
                # package never imports them, so `import tensorplay.distributed` loads no torch
                "tensor/__init__.py", "tensor/parallel.py",
                # torch's FSDP2 on our mesh: the same kind of adapter
                "fsdp/__init__.py"}
# torch tensors are first-class buffers on every engine: backends/arrays.py recognises one (through
# sys.modules, never importing torch), so it may say "torch"
NAMES_ALLOWED = {"backends/arrays.py"}


def _all_imports(path: Path) -> set[str]:
    """Top-level names imported anywhere in the file, function bodies included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def _package_files() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def test_only_the_torch_engine_imports_torch():
    importers = [f for f in _package_files() if "torch" in _all_imports(PACKAGE / f)]
    assert set(importers) == TORCH_ENGINE, importers


# the MPI engine: the only files that may import mpi4py, anywhere in them
MPI_ENGINE = {"backends/mpi.py", "backends/mpi_collectives.py", "backends/mpi_watch.py",
              "backends/mpi_ulfm.py"}


def test_only_the_mpi_engine_imports_mpi4py():
    importers = [f for f in _package_files() if "mpi4py" in _all_imports(PACKAGE / f)]
    assert set(importers) == MPI_ENGINE, importers


def _string_constants(path: Path) -> set[str]:
    """String constants of the code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings}


def test_code_above_the_engines_names_no_engine_or_backend():
    """Above backends/, an engine is reached through the registry and its capabilities, never
    by testing for its name ("fake", "torch") or its backends ("gloo", "nccl")."""
    from tensorplay.distributed.backends import _REGISTRY, BACKENDS

    names = set(BACKENDS) | {engine for engine, _ in _REGISTRY.values()} | {
        module for _, module in _REGISTRY.values()}
    for f in _package_files():
        if f.startswith("backends/") or f in NAMES_ALLOWED:
            continue
        assert not _string_constants(PACKAGE / f) & names, f


def test_backends_never_import_the_mesh():
    for path in (PACKAGE / "backends").glob("*.py"):
        imported = _module_level_imports(path)
        assert not any("device_mesh" in name for name in imported), path.name


def test_the_rank_wrapper_imports_nothing_of_the_package():
    """rank_main is loaded by path in every rank: no package import, so a rank starts fast."""
    tree = ast.parse((PACKAGE / "launcher" / "rank_main.py").read_text())
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert relative == []
    assert "tensorplay" not in _all_imports(PACKAGE / "launcher" / "rank_main.py")


def test_launcher_and_package_load_without_any_engine():
    code = ("import sys, tensorplay.distributed, tensorplay.distributed.run;"
            "import tensorplay.distributed.launcher.main;"
            "import tensorplay.distributed.device_mesh;"
            "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


BLOCK_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTorch())
"""


def test_without_torch_the_torch_backends_name_the_extra_and_a_fake_mesh_is_numpy():
    code = BLOCK_TORCH + """
import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh
try:
    dist.init_process_group("gloo", rank=0, world_size=1)
except dist.BackendError as err:
    print(err)
dist.init_process_group("fake", rank=5, world_size=8)
mesh = init_device_mesh("cpu", (2, 4))
print(type(mesh.mesh).__name__, mesh.shift(1), "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items()
                                          if not k.startswith(("PMI_", "OMPI_"))})
    lines = out.stdout.strip().splitlines()
    assert lines[0] == ("backends 'gloo' and 'nccl' need torch, which is not installed. Fix: "
                        "pip install 'tensorplay-distributed[torch]' (or pip install torch), "
                        "or use another backend of ('gloo', 'nccl', 'fake', 'mpi').")
    assert lines[1] == "ndarray (4, 6) False"
