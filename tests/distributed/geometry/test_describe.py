"""describe(): exact worked reports and summaries of huge meshes; plot(): files and errors."""

from __future__ import annotations

import sys
import time

import pytest

from tensorplay.distributed.errors import ArgumentError, ArgumentTypeError
from tensorplay.distributed.geometry.describe import describe
from tensorplay.distributed.geometry.plot import INSTALL_HINT, plot
from tensorplay.distributed.geometry.spec import MeshSpec
from tensorplay.distributed.geometry.topology import (
    CROSSING_LIMIT,
    hosts_round_robin,
    hosts_simulated,
)
from tests import timing

DP_TP = MeshSpec.row_major((2, 4), ("dp", "tp"))

WORKED = """\
DeviceMesh (2, 4) on cpu: 8 ranks
  names  dp, tp
  hosts  2, 4 ranks each

ranks (rows: dp, columns: tp)
       0  1  2  3
  0 |  0  1  2  3
  1 |  4  5  6  7

dims
  dim  name  size  groups  crossing hosts
  0    dp    2     4       4 of 4
  1    tp    4     2       0 of 2

rank 5
  coordinate     (1, 1)  dp=1, tp=1
  host           host1
  communicators  3 (one per dim + the world)
  dim  name  local rank  hosts  group
  0    dp    1           2      [1, 5]
  1    tp    1           1      [4, 5, 6, 7]"""


def test_worked_report_for_rank_5_on_2_hosts():
    assert describe(DP_TP, 5, hosts_simulated(8, 2)) == WORKED


def test_report_without_hosts_or_rank():
    assert describe(MeshSpec.row_major((2, 2, 2)), None) == """\
DeviceMesh (2, 2, 2) on cpu: 8 ranks
  names          (unnamed dims)
  communicators  4 per rank (one per dim + the world)

ranks (rows: dim 1, columns: dim 2; one slice per dim 0)
  [0, :, :]
       0  1
  0 |  0  1
  1 |  2  3
  [1, :, :]
       0  1
  0 |  4  5
  1 |  6  7

dims
  dim  name  size  groups
  0    -     2     4
  1    -     2     4
  2    -     2     4"""


def test_report_of_an_explicit_mesh_for_a_rank_outside_it():
    spec = MeshSpec.from_ranks((2, 2), [3, 1, 2, 0], ("a", "b"))
    text = describe(spec, 7, backends=("gloo", "nccl"), device_type="cuda")
    assert text.splitlines()[0] == "DeviceMesh (2, 2) on cuda: 4 ranks"
    assert "  0 |  3  1\n  1 |  2  0" in text
    assert "  0    a     2     2       gloo" in text
    assert text.endswith("rank 7\n"
                         "  coordinate     none: this rank is not in the mesh\n"
                         "  communicators  1 (the world only)")


def test_report_of_a_1d_mesh_truncates_the_row_and_the_group():
    text = describe(MeshSpec.row_major((100,), ("dp",)), 3)
    assert "  index    0    1    2    3    4    5  ...   97   98   99" in text
    assert "  rank     0    1    2    3    4    5  ...   97   98   99" in text
    assert "  coordinate     (3,)  dp=3" in text
    assert "  communicators  2 (one for the dim + the world)" in text
    assert "  0    dp    3           [0, 1, 2, 3, ..., 98, 99] (size 100)" in text


def test_advice_closes_the_report_when_hosts_are_dealt_round_robin():
    text = describe(MeshSpec.row_major((4, 4), ("dp", "tp")), 5, hosts_round_robin(16, 2))
    assert "  1    tp    4     4       4 of 4" in text
    assert "  1    tp    1           2      [4, 5, 6, 7]" in text
    assert text.splitlines()[-1].startswith("advice: mesh dim 'tp': 4 of 4 groups cross hosts")


def test_a_plain_function_works_as_host_map():
    text = describe(DP_TP, 5, lambda r: "left" if r < 4 else "right")
    assert "  host           right" in text
    assert "  hosts  2, 4 ranks each" in text


def test_summary_of_a_2d_mesh():
    text = describe(MeshSpec.row_major((32, 32), ("dp", "tp")), 1000, hosts_simulated(1024, 4))
    lines = text.splitlines()
    assert "            0     1     2     3     4     5   ...    29    30    31" in lines
    assert "    1 |    32    33    34    35    36    37   ...    61    62    63" in lines
    assert "  ... |" in lines
    assert "   31 |   992   993   994   995   996   997   ...  1021  1022  1023" in lines
    assert "  0    dp    31          4      [8, 40, 72, 104, ..., 968, 1000] (size 32)" in lines
    assert "  0    dp    32    32      32 of 32" in lines


def test_a_million_ranks_summarised_quickly():
    spec = MeshSpec.row_major((1 << 14, 8, 8), ("dp", "x", "y"))
    start = time.perf_counter()
    text = describe(spec, 5, hosts_simulated(1 << 20, 128))
    took = time.perf_counter() - start
    lines = text.splitlines()
    assert lines[0] == "DeviceMesh (16,384, 8, 8) on cpu: 1,048,576 ranks"
    assert "  hosts  128, 8,192 ranks each" in lines
    assert "  [dp=0, :, :]" in lines
    assert "  ... (16,382 more slices)" in lines
    assert "  [dp=16,383, :, :]" in lines
    assert "    7 |  1048568  1048569  1048570  1048571  1048572  1048573  1048574  1048575" \
        in lines
    assert "  0    dp    16,384  64       64 of 64" in lines
    assert "  1    x     8       131,072  0 of 131,072" in lines
    assert "  0    dp    0           128    [5, 69, 133, 197, ..., 1048453, 1048517] " \
        "(size 16,384)" in lines
    assert len(lines) < 60
    assert took < timing.bound(0, 15), (took, timing.describe())


def test_beyond_the_limit_hosts_are_not_counted_and_nothing_is_materialised():
    size = CROSSING_LIMIT * 2
    spec = MeshSpec.row_major((size // 8, 8), ("dp", "tp"))
    start = time.perf_counter()
    text = describe(spec, 9, hosts_simulated(size, 8))
    assert time.perf_counter() - start < timing.bound(0, 2), timing.describe()
    assert f"  hosts  not counted (mesh over {CROSSING_LIMIT:,} ranks)" in text
    assert "  0    dp    1,048,576  8          not computed" in text
    assert "  host           host0" in text
    assert "advice" not in text


def test_describe_refuses_bad_arguments():
    with pytest.raises(ArgumentTypeError, match="rank=True"):
        describe(DP_TP, True)
    with pytest.raises(ArgumentTypeError, match="host_of='host0'"):
        describe(DP_TP, 0, "host0")
    with pytest.raises(ArgumentError, match=r"backends=\('gloo',\): has 1 entries for 2 dims"):
        describe(DP_TP, 0, backends=("gloo",))


# -- plot ----------------------------------------------------------------------------------------
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # draws with matplotlib (about 0.5 s, 1 s with its import)
def test_plot_png_of_the_worked_mesh(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot(DP_TP, tmp_path / "mesh.png", hosts_simulated(8, 2), rank=5)
    data = path.read_bytes()
    assert data[:8] == PNG
    assert 5_000 < len(data) < 500_000


@pytest.mark.parametrize("shape, names, dim, rank", [
    ((8,), ("dp",), None, 3),
    ((4, 4), ("dp", "tp"), "dp", 5),
    ((2, 4, 4), ("pp", "dp", "tp"), 1, 21),
    ((2, 4, 4), ("pp", "dp", "tp"), "pp", 21),
    ((3, 2, 2), None, 0, None),
])
def test_plot_svg_and_png_of_1d_2d_3d(tmp_path, shape, names, dim, rank):
    pytest.importorskip("matplotlib")
    spec = MeshSpec.row_major(shape, names)
    svg = plot(spec, tmp_path / "mesh.svg", hosts_round_robin(spec.size, 2), dim=dim, rank=rank)
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text and text.rstrip().endswith("</svg>")
    assert 5_000 < len(text) < 2_000_000
    png = plot(spec, tmp_path / "MESH.PNG", dim=dim, rank=rank)
    assert png.read_bytes()[:8] == PNG


@pytest.mark.slow  # draws 4,096 ranks with matplotlib
def test_plot_the_largest_mesh_it_draws(tmp_path):
    pytest.importorskip("matplotlib")
    spec = MeshSpec.row_major((64, 64), ("dp", "tp"))
    start = time.perf_counter()
    data = plot(spec, tmp_path / "big.png", hosts_simulated(4096, 8), rank=1000).read_bytes()
    assert data[:8] == PNG and 100_000 < len(data) < 5_000_000
    assert time.perf_counter() - start < timing.bound(0, 60), timing.describe()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"path": "mesh.gif"}, ArgumentError, r"path='mesh.gif': has suffix '.gif'; plot writes "
                                          r"\.png or \.svg"),
    ({"path": "mesh"}, ArgumentError, r"has suffix '\(none\)'"),
    ({"path": 3}, ArgumentTypeError, "path=3"),
    ({"dim": "pp"}, ArgumentError, r"dim='pp': is not a dim name of this mesh. Fix: use one of "
                                   r"\('dp', 'tp'\)"),
    ({"dim": 2}, ArgumentError, "dim=2: is not a dim of a 2-d mesh"),
    ({"rank": 8}, ArgumentError, "rank=8: is not in this mesh"),
    ({"host_of": "x"}, ArgumentTypeError, "host_of='x'"),
])
def test_plot_refuses_bad_arguments_before_importing_matplotlib(monkeypatch, kwargs, error,
                                                                message):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = {"spec": DP_TP, "path": "mesh.png", **kwargs}
    with pytest.raises(error, match=message):
        plot(**args)


def test_plot_refuses_4d_and_huge_meshes(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ArgumentError, match=r"is a 4-d mesh; plot draws 1-, 2- and 3-d meshes"):
        plot(MeshSpec.row_major((2, 2, 2, 2)), "mesh.png")
    with pytest.raises(ArgumentError, match=r"has 4,160 ranks, too many to draw readably "
                                            r"\(limit 4,096\)"):
        plot(MeshSpec.row_major((65, 64)), "mesh.png")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError) as info:
        plot(DP_TP, tmp_path / "mesh.png")
    assert str(info.value) == "mesh.plot needs matplotlib: pip install matplotlib"
    assert str(info.value) == INSTALL_HINT
    assert not (tmp_path / "mesh.png").exists()


def test_plot_leaves_the_global_matplotlib_backend_alone(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    plot(DP_TP, tmp_path / "mesh.png")
    assert matplotlib.get_backend() == before
