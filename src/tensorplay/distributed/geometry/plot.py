"""Draw a 1-, 2- or 3-d mesh as a PNG or SVG: one cell per rank, coloured by host, groups outlined.

plot(MeshSpec.row_major((2, 4), ("dp", "tp")), "mesh.png", hosts_simulated(8, 2)) draws a 2 x 4
grid: ranks 0-3 in one colour (host0), 4-7 in another (host1), and the two "tp" groups
[0, 1, 2, 3] and [4, 5, 6, 7] each boxed. A 3-d mesh gets one panel per index of dim 0; a 1-d
mesh is one row. matplotlib is imported only here, only when drawing, and without pyplot, so
no global backend is switched.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import bad_argument, bad_type, is_int
from .spec import MeshSpec
from .topology import HostOf, host_ids

PLOT_LIMIT = 4096
"""Largest mesh (in ranks) drawn; beyond it labels are unreadable."""

FORMATS = {".png": "png", ".svg": "svg"}
INSTALL_HINT = "mesh.plot needs matplotlib: pip install matplotlib"
_PALETTES = ("Set3", "Pastel1", "Pastel2", "tab20")
_OUTLINE, _MINE = "#1f3b73", "#d62728"


def plot(
    spec: MeshSpec,
    path: str | Path,
    host_of: HostOf | None = None,
    dim: int | str | None = None,
    rank: int | None = None,
) -> Path:
    """Write the picture to ``path`` (.png or .svg) and return it as a Path.

    ``dim`` (name or index; default the last) picks the groups to outline; ``rank`` marks one
    rank and its group in red.
    """
    target, fmt = _check_path(path)
    if spec.ndim > 3:
        raise bad_argument("spec", spec.shape, f"is a {spec.ndim}-d mesh; plot draws 1-, 2- "
                           "and 3-d meshes", "plot a sub-mesh, e.g. mesh['dp', 'tp'].plot(...)")
    if spec.size > PLOT_LIMIT:
        raise bad_argument("spec", spec.shape, f"has {spec.size:,} ranks, too many to draw "
                           f"readably (limit {PLOT_LIMIT:,})",
                           "plot a sub-mesh, or use describe() for a text summary")
    d = _check_dim(spec, dim)
    if rank is not None:
        if not is_int(rank):
            raise bad_type("rank", rank, "int or None", "pass a global rank of the mesh")
        if spec.coordinate_of(int(rank)) is None:
            raise bad_argument("rank", rank, "is not in this mesh",
                               "pass one of the mesh's ranks, or rank=None")
    if host_of is not None and not callable(host_of):
        raise bad_type("host_of", host_of, "callable rank -> host name",
                       "pass hosts_simulated(world_size, n_hosts) or a function")
    mpl = _matplotlib()
    ranks = spec.array()
    cube = ranks.reshape((1,) * (3 - spec.ndim) + spec.shape)  # (panels, rows, columns)
    axis = d + 3 - spec.ndim  # the outlined dim, as an axis of cube
    names: tuple[str, ...]
    if host_of is None:
        hosts, names = np.zeros(cube.shape, dtype=np.int32), ("",)
    else:
        hosts, names = host_ids(host_of, cube)
    palette = [c for p in _PALETTES for c in mpl.colormaps[p].colors]
    panels, n_rows, n_cols = cube.shape
    grid_cols = math.ceil(math.sqrt(panels))
    grid_rows = math.ceil(panels / grid_cols)
    wide, tall = grid_cols * n_cols, grid_rows * n_rows
    cell = min(0.6, 16 / max(wide, tall))  # inches per cell
    font = max(6.0, min(11.0, cell * 30))  # for titles and ticks
    legend = host_of is not None and len(np.unique(hosts)) <= 16
    fig = mpl.Figure(figsize=(max(5.5, wide * cell + 1.0 * grid_cols + 0.6),
                              max(2.5, tall * cell + 0.8 * grid_rows + 1.0 + 0.35 * legend)))
    mine = None if rank is None else tuple(int(c) for c in np.argwhere(cube == rank)[0])
    glyphs = _Digits(mpl, len(str(int(ranks.max()))))
    rows, cols = np.meshgrid(np.arange(n_rows), np.arange(n_cols), indexing="ij")

    for p in range(panels):
        ax = fig.add_subplot(grid_rows, grid_cols, p + 1)
        if host_of is None:
            colours = ["#dbe6f4"] * (n_rows * n_cols)
        else:
            colours = [palette[i % len(palette)] for i in hosts[p].reshape(-1).tolist()]
        boxes = [mpl.Rectangle((c - 0.5, r - 0.5), 1, 1)
                 for r, c in zip(rows.reshape(-1).tolist(), cols.reshape(-1).tolist(),
                                 strict=True)]
        ax.add_collection(mpl.PatchCollection(boxes, facecolors=colours, edgecolors="white",
                                              linewidths=1))
        ax.add_artist(mpl.PathPatch(glyphs.labels(cube[p], rows, cols), facecolor="black",
                                   edgecolor="none", zorder=2))
        _outline(ax, mpl.Rectangle, axis, p, n_rows, n_cols, mine, cell)
        if mine is not None and mine[0] == p:
            ax.add_artist(mpl.Rectangle((mine[2] - 0.5, mine[1] - 0.5), 1, 1, fill=False,
                                       edgecolor=_MINE, linewidth=2.5, zorder=4))
        _axes(ax, spec, n_rows, n_cols, p, font)

    title = f"DeviceMesh {spec.shape}"
    if spec.names:
        title += ": " + " \u00d7 ".join(spec.names)
    what = repr(spec.names[d]) if spec.names else f"dim {d}"
    note = f"boxed: {what} groups"
    if axis == 0 and panels > 1:
        note = f"{what} groups run across panels (same cell in each)"
    if rank is not None:
        note += f"; red: rank {rank}" + ("" if axis == 0 and panels > 1 else " and its group")
    fig.suptitle(f"{title}\n{note}", fontsize=max(8.0, min(12.0, font + 1)))
    if legend:
        handles = [mpl.Patch(facecolor=palette[i % len(palette)], edgecolor="grey", label=name)
                   for i, name in enumerate(names) if (hosts == i).any()]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8),
                   fontsize=8, frameon=False)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, (0.35 if legend else 0) / height, 1, 1 - 0.6 / height))
    fig.savefig(target, format=fmt, dpi=110)
    return target


def _check_path(path: str | Path) -> tuple[Path, str]:
    if not isinstance(path, str | Path):
        raise bad_type("path", path, "str or pathlib.Path", "pass e.g. 'mesh.png'")
    target = Path(path)
    fmt = FORMATS.get(target.suffix.lower())
    if fmt is None:
        raise bad_argument("path", str(path), f"has suffix {target.suffix or '(none)'!r}; "
                           f"plot writes {' or '.join(FORMATS)}", "end the name in .png or .svg")
    return target, fmt


def _check_dim(spec: MeshSpec, dim: int | str | None) -> int:
    if dim is None:
        return spec.ndim - 1
    if isinstance(dim, str):
        if spec.names and dim in spec.names:
            return spec.names.index(dim)
        raise bad_argument("dim", dim, "is not a dim name of this mesh",
                           f"use one of {spec.names}" if spec.names
                           else f"use an index 0..{spec.ndim - 1}")
    if not is_int(dim) or not 0 <= dim < spec.ndim:
        raise bad_argument("dim", dim, f"is not a dim of a {spec.ndim}-d mesh",
                           f"use an index 0..{spec.ndim - 1} or a name")
    return int(dim)


def _matplotlib() -> SimpleNamespace:
    """The few matplotlib pieces plot uses, or ImportError saying how to install them."""
    try:
        import matplotlib
        from matplotlib.collections import PatchCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, PathPatch, Rectangle
        from matplotlib.path import Path as MplPath
        from matplotlib.textpath import TextPath
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return SimpleNamespace(Figure=Figure, Patch=Patch, PathPatch=PathPatch, Rectangle=Rectangle,
                           PatchCollection=PatchCollection, Path=MplPath, TextPath=TextPath,
                           colormaps=matplotlib.colormaps)


class _Digits:
    """Cell labels as one filled path: ten digit outlines, shifted and scaled per rank.

    Thousands of text artists take minutes to lay out; one compound path draws in a moment.
    """

    def __init__(self, mpl: SimpleNamespace, digits: int):
        self._mpl = mpl
        shapes = [mpl.TextPath((0, 0), str(i), size=1) for i in range(10)]
        two = mpl.TextPath((0, 0), "00", size=1).get_extents()
        one = shapes[0].get_extents()
        self._advance = two.x1 - one.x1
        self._middle = (one.y0 + one.y1) / 2
        self._shapes = [(s.vertices.copy(), s.codes.copy()) for s in shapes]
        self._size = min(0.42, 0.78 / (digits * self._advance))  # glyph size, in cells

    def labels(self, values: np.ndarray, rows: np.ndarray, cols: np.ndarray):
        """One path writing values[r, c] centred on cell (r, c) (y grows downwards)."""
        verts, codes = [], []
        size = self._size
        for value, r, c in zip(values.reshape(-1).tolist(), rows.reshape(-1).tolist(),
                               cols.reshape(-1).tolist(), strict=True):
            text = str(value)
            left = c - len(text) * self._advance * size / 2
            for i, ch in enumerate(text):
                v, k = self._shapes[ord(ch) - 48]
                x = left + (v[:, 0] + i * self._advance) * size
                y = r - (v[:, 1] - self._middle) * size
                verts.append(np.column_stack((x, y)))
                codes.append(k)
        return self._mpl.Path(np.concatenate(verts), np.concatenate(codes))


def _outline(ax, Rectangle, axis: int, panel: int, n_rows: int, n_cols: int, mine, cell):
    """Box each group of the outlined dim inside one panel; red for the marked rank's."""
    inset = 0.42
    width = max(1.2, min(2.5, cell * 4))
    boxes: list[tuple[tuple[float, float], float, float, tuple[int, ...]]]
    if axis == 2:
        boxes = [((-inset, r - inset), n_cols - 1 + 2 * inset, 2 * inset, (r,))
                 for r in range(n_rows)]
    elif axis == 1:
        boxes = [((c - inset, -inset), 2 * inset, n_rows - 1 + 2 * inset, (c,))
                 for c in range(n_cols)]
    else:
        boxes = [((c - inset, r - inset), 2 * inset, 2 * inset, (r, c))
                 for r in range(n_rows) for c in range(n_cols)]
    for corner, w, h, where in boxes:
        if mine is None:
            ours = False
        elif axis == 2:
            ours = mine[0] == panel and where == (mine[1],)
        elif axis == 1:
            ours = mine[0] == panel and where == (mine[2],)
        else:
            ours = where == (mine[1], mine[2])
        if axis == 0 and not ours:
            continue  # cross-panel groups: only the marked rank's is boxed
        ax.add_artist(Rectangle(corner, w, h, fill=False, linewidth=width * (1.4 if ours else 1),
                               edgecolor=_MINE if ours else _OUTLINE, zorder=3))


def _axes(ax, spec: MeshSpec, n_rows: int, n_cols: int, panel: int, font: float) -> None:
    ax.set_xlim(-0.5, n_cols - 0.5)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)
    step_c = max(1, math.ceil(n_cols / 16))
    step_r = max(1, math.ceil(n_rows / 16))
    ax.set_xticks(range(0, n_cols, step_c))
    ax.tick_params(length=0, labelsize=max(6.0, min(9.0, font)))
    names = spec.names or tuple(f"dim {i}" for i in range(spec.ndim))
    ax.set_xlabel(names[-1], fontsize=9)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    if spec.ndim >= 2:
        ax.set_yticks(range(0, n_rows, step_r))
        ax.set_ylabel(names[-2], fontsize=9)
    else:
        ax.set_yticks([])
    if spec.ndim == 3:
        ax.set_title(f"{names[0]} = {panel}", fontsize=10, pad=4, loc="left")
