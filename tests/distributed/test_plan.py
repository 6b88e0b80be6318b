"""The planning command: a mesh on paper, its report; clear usage errors (exit 2); no world."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import tensorplay.distributed as dist
from tensorplay.distributed.plan import DEVICE_MESH_PROG, main
from tests import timing

PLAN = [sys.executable, "-m", "tensorplay.distributed.plan"]
DEVICE_MESH = [sys.executable, "-m", "tensorplay.distributed.device_mesh"]
SCRIPT = Path(sys.executable).parent / "tensorplay-plan"
WORKED = ["--shape", "2,4", "--names", "dp,tp", "--hosts", "2", "--rank", "5"]


@pytest.fixture(autouse=True)
def no_world_left_behind():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "main() must not leave a world behind"


def test_worked_plan_rank_5_of_a_2x4_mesh_on_2_hosts(capsys):
    assert main(["--shape", "2,4", "--names", "dp,tp", "--hosts", "2", "--rank", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "DeviceMesh (2, 4) on cpu: 8 ranks"
    assert "  hosts  2, 4 ranks each" in out
    assert "  0    dp    2     4       4 of 4" in out
    assert "  1    tp    4     2       0 of 2" in out
    assert "  coordinate     (1, 1)  dp=1, tp=1" in out
    assert "  host           host1" in out
    assert "  0    dp    1           2      [1, 5]" in out
    assert "  1    tp    1           1      [4, 5, 6, 7]" in out


def test_defaults_rank_0_one_host(capsys):
    assert main(["--shape", "2,4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  hosts  1, 8 ranks each" in out
    assert "  coordinate     (0, 0)" in out
    assert "  1    -     0           1      [0, 1, 2, 3]" in out


def test_round_robin_hosts_get_advice_and_host_aware_fixes_it(capsys):
    argv = ["--shape", "4,4", "--names", "dp,tp", "--hosts", "2", "--round-robin", "--rank", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  1    tp    4     4       4 of 4" in out
    assert out[-2].startswith("advice: mesh dim 'tp': 4 of 4 groups cross hosts")
    assert out[-1] == "(in this command: add --host-aware)"

    assert main([*argv, "--host-aware"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "host-aware: ranks laid out host by host"
    grid = [line for line in out if " | " in line]
    assert grid == ["  0 |   0   2   4   6", "  1 |   8  10  12  14", "  2 |   1   3   5   7",
                    "  3 |   9  11  13  15"]
    assert "  1    tp    4     4       0 of 4" in out
    assert "  coordinate     (2, 2)  dp=2, tp=2" in out
    assert "  1    tp    2           1      [1, 3, 5, 7]" in out
    assert not any(line.startswith("advice") for line in out)


def test_host_aware_with_block_hosts_keeps_row_major(capsys):
    assert main(["--shape", "2,4", "--hosts", "2", "--host-aware"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host-aware: row-major order already keeps the inner dims inside")
    assert "  0 |  0  1  2  3" in out


def test_a_million_ranks_with_an_inferred_dim(capsys):
    start = time.perf_counter()
    argv = ["--shape", "-1,8,8", "--world", "1048576", "--names", "dp,x,y", "--hosts", "128",
            "--rank", "1000"]
    assert main(argv) == 0
    took = time.perf_counter() - start
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "DeviceMesh (16,384, 8, 8) on cpu: 1,048,576 ranks"
    assert "  coordinate     (15, 5, 0)  dp=15, x=5, y=0" in out
    assert "  ... (16,382 more slices)" in out
    assert took < timing.bound(0, 20), (took, timing.describe())  # O(ndim), no rank list


def test_plot_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mesh.png"
    assert main(["--shape", "2,4", "--names", "dp,tp", "--hosts", "2", "--plot", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_with_the_install_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--shape", "2,4", "--plot", str(tmp_path / "m.svg")]) == 1
    assert "mesh.plot needs matplotlib: pip install matplotlib" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --shape"),
    (["--shape", "2,x"], "'2,x' is not a comma-separated list of ints"),
    (["--shape", "-1,4"], "--shape -1,4 has a -1: give --world to infer it"),
    (["--shape", "2,0"], "--shape 2,0: sizes must be positive"),
    (["--shape", "2,4", "--hosts", "3"], "--hosts 3: must be a positive divisor of the world "
                                         "size 8"),
    (["--shape", "2,4", "--rank", "8"], "--rank 8: must be in 0..7"),
    (["--shape", "2,4", "--names", "dp"], "--names dp: 1 names for 2 dims"),
    (["--shape", "2,4", "--names", "dp,"], "'dp,' has an empty name"),
    (["--shape", "2,4", "--world", "0"], "--world 0: must be at least 1"),
    (["--shape", "2,4", "--plot", "m.gif"], "--plot m.gif: suffix '.gif' is not one of .png, "
                                            ".svg"),
    (["--shape", "2,4", "--world", "16"], "mesh_shape=(2, 4): holds 8 ranks but the world "
                                          "has 16"),
    (["--shape", "-1,3", "--world", "8"], "the other sizes (3) do not divide the world size 8"),
    (["--shape", "2,4", "--names", "dp,dp"], "repeats 'dp'"),
    (["--shape", "2,4", "--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert "error:" in captured.err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--host-aware" in capsys.readouterr().out


def test_an_existing_world_is_left_alone(capsys):
    # The plan needs no world, so one already joined neither stops it nor is touched by it.
    dist.init_process_group("fake", rank=0, world_size=4)
    try:
        assert main(["--shape", "2,4"]) == 0
        assert capsys.readouterr().out.startswith("DeviceMesh (2, 4) on cpu: 8 ranks")
        assert dist.is_initialized()
        assert dist.get_world_size() == 4
    finally:
        dist.destroy_process_group()


def test_prog_names_the_command_as_invoked(capsys):
    assert main(["--shape", "2,4", "--rank", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tensorplay-plan ")
    assert "tensorplay-plan: error: --rank 9: must be in 0..7" in err
    assert main(["--shape", "2,4", "--world", "16"], prog=DEVICE_MESH_PROG) == 2
    assert capsys.readouterr().err.startswith(
        "python -m tensorplay.distributed.device_mesh: error: mesh_shape=(2, 4): holds 8 ranks")


def test_runs_as_a_module():
    done = subprocess.run([*PLAN, "--shape", "2,4", "--names", "dp,tp", "--hosts", "2",
                           "--rank", "5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "  1    tp    1           1      [4, 5, 6, 7]" in done.stdout.splitlines()
    bad = subprocess.run([*PLAN, "--shape", "2,4", "--rank", "9"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert "--rank 9: must be in 0..7" in bad.stderr


def _check_worked_plan(command: list[str], prog: str) -> None:
    """Run ``command`` on the worked example and on a bad rank; check the report and the error."""
    done = subprocess.run([*command, *WORKED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "DeviceMesh (2, 4) on cpu: 8 ranks"
    assert "  coordinate     (1, 1)  dp=1, tp=1" in out
    assert "  0    dp    1           2      [1, 5]" in out
    assert "  1    tp    1           1      [4, 5, 6, 7]" in out
    bad = subprocess.run([*command, "--shape", "2,4", "--rank", "9"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert f"{prog}: error: --rank 9: must be in 0..7" in bad.stderr


def test_runs_as_the_console_script():
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e . installs tensorplay-plan"
    _check_worked_plan([str(SCRIPT)], "tensorplay-plan")


def test_runs_as_device_mesh_main_as_documented():
    # README: python -m tensorplay.distributed.device_mesh --shape 2,4 --names dp,tp ...
    _check_worked_plan(DEVICE_MESH, "python -m tensorplay.distributed.device_mesh")


def test_planning_loads_neither_torch_nor_matplotlib():
    code = ("import sys; from tensorplay.distributed.plan import main; "
            "assert main(['--shape', '2,4', '--hosts', '2']) == 0; "
            "print('torch' in sys.modules, 'matplotlib' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "False False"


def test_planning_needs_no_world_and_no_torch():
    code = ("import sys\n"
            "import tensorplay.distributed as dist\n"
            "assert 'torch' not in sys.modules, 'importing the package loaded torch'\n"
            "from tensorplay.distributed.plan import main\n"
            "assert main(['--shape', '4,4', '--hosts', '2', '--round-robin', '--host-aware',\n"
            "             '--rank', '5']) == 0\n"
            "print('torch' in sys.modules, dist.is_initialized(),\n"
            "      'tensorplay.distributed.device_mesh' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "host-aware: ranks laid out host by host" in done.stdout
    assert done.stderr.strip() == "False False False"


def test_elastic_shows_what_losing_each_host_costs_and_host_aware_lowers_it(capsys):
    assert main(["--shape", "2,4", "--names", "dp,tp", "--hosts", "2", "--elastic",
                      "dp"]) == 0
    out = capsys.readouterr().out
    assert ("elastic 'dp': a host lost costs the slices of 'dp' holding its ranks\n"
            "  host0: slice 0 (1 of 2 lost; 1 left)\n"
            "  host1: slice 1 (1 of 2 lost; 1 left)") in out, out
    argv = ["--shape", "4,4", "--names", "dp,tp", "--hosts", "2", "--round-robin",
            "--elastic", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  host0 .. host1 (2 hosts): slices 0-3 (4 of 4 lost; 0 left)" in out, out
    assert main([*argv, "--host-aware"]) == 0
    out = capsys.readouterr().out
    assert "  host0: slices 0-1 (2 of 4 lost; 2 left)" in out, out
    assert "  host1: slices 2-3 (2 of 4 lost; 2 left)" in out, out


def test_elastic_names_a_dim_of_the_mesh(capsys):
    assert main(["--shape", "2,4", "--names", "dp,tp", "--elastic", "pp"]) == 2
    assert ("--elastic pp: not a dim of the mesh (a name of --names, or an index in 0..1)"
            in capsys.readouterr().err)
