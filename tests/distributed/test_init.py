"""The package's front door as an IDE, help() and a type checker see it."""

from __future__ import annotations

import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

import tensorplay.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
USER_SCRIPT = '''
import torch

import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
x = torch.ones(4)
dist.all_reduce(x, group=mesh.get_group("tp"))
rank: int = dist.get_rank()
'''
# torch and numpy are not what is checked here: skip following them (mypy would take minutes)
MYPY_CONFIG = """
[mypy]
follow_imports = silent
[mypy-torch.*]
follow_imports = skip
[mypy-numpy.*]
follow_imports = skip
"""


def test_dir_and_help_list_the_whole_api():
    names = dir(dist)
    for name in ("all_reduce", "barrier", "DeviceMesh", "init_device_mesh", "new_group",
                 "CallMismatchError", "AlreadyInitializedError", "UnknownDimError"):
        assert name in names, name
    text = pydoc.render_doc(dist, renderer=pydoc.plaintext)
    assert "all_reduce(" in text and "init_device_mesh(" in text and "class DeviceMesh" in text


def test_the_package_is_marked_typed():
    assert (ROOT / "src" / "tensorplay" / "distributed" / "py.typed").exists()
    assert '"tensorplay.distributed" = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def _mypy(tmp_path: Path, scripts: dict[str, str]) -> subprocess.CompletedProcess:
    """One mypy run over several user scripts (one run: mypy's start-up is most of its cost)."""
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}  # found as installed
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
                           "--no-incremental", *scripts], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # mypy takes 5-10 s on 2 cores
def test_a_type_checker_accepts_a_user_script_and_reports_a_typo(tmp_path):
    pytest.importorskip("mypy", reason="mypy comes with the [test] extra")
    done = _mypy(tmp_path, {
        "good.py": USER_SCRIPT,
        "typo.py": USER_SCRIPT.replace("group=mesh", "groop=mesh"),
        "misspelt.py": USER_SCRIPT.replace("mesh_dim_names=", "mesh_dim_name="),
    })
    errors = sorted(line for line in done.stdout.splitlines() if ": error:" in line)
    assert done.returncode == 1 and len(errors) == 2, done.stdout + done.stderr
    assert errors[0].startswith("misspelt.py:") and \
        'Unexpected keyword argument "mesh_dim_name" for "init_device_mesh"' in errors[0], errors
    assert errors[1].startswith("typo.py:") and \
        'Unexpected keyword argument "groop" for "all_reduce"' in errors[1], errors
