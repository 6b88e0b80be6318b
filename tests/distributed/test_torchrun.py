"""A script written for tensorplay-run runs unchanged under torchrun (agent-served store)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
import torch
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

dist.init_process_group()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x, group=mesh.get_group("dp"))
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as out:  # stdout interleaves
    out.write(f"sum {int(x.item())} coord {mesh.get_coordinate()}")
dist.destroy_process_group()

# a second world on the same agent store: its checks must not read the first world's keys
dist.init_process_group()
try:
    init_device_mesh("cpu", (2,), mesh_dim_names=(f"r{dist.get_rank()}",))
    second = "no error"
except dist.MeshMismatchError:
    second = "MeshMismatchError"
with open(f"{sys.argv[1]}/second{dist.get_rank()}.txt", "w") as out:
    out.write(second)
dist.destroy_process_group()
"""


def test_same_script_under_torchrun(tmp_path: Path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed next to this python")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
         str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert lines == ["sum 3 coord [0]", "sum 3 coord [1]"]
    second = [(tmp_path / f"second{r}.txt").read_text() for r in range(2)]
    assert second == ["MeshMismatchError"] * 2
