"""A readable text report of a mesh: shape, the rank grid, per-dim groups, one rank's groups.

On a (2, 4) mesh named ("dp", "tp") with hosts_simulated(8, 2), describe(spec, 5, hosts) says:
rank 5 is at (1, 1) on host1; its "dp" group is [1, 5] and its "tp" group [4, 5, 6, 7]; "dp"
has 8 // 2 = 4 groups, all crossing hosts (4 of 4); "tp" has 8 // 4 = 2 groups, none crossing
(0 of 2); rank 5 holds 3 communicators (one per dim, plus the world). Meshes over 64 ranks get
a summary grid (first and last rows, columns and slices); crossing groups are counted up to
CROSSING_LIMIT ranks (O(N) numpy work, about a second for a million ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import bad_argument, bad_type, is_int
from .spec import MeshSpec, Ranks
from .topology import CROSSING_LIMIT, HostOf, _advice, _crossing, host_ids

FULL_GRID_LIMIT = 64
"""Meshes up to this many ranks show every rank; larger ones a summary."""


def describe(
    spec: MeshSpec,
    rank: int | None,
    host_of: HostOf | None = None,
    device_type: str = "cpu",
    backends: Sequence[str] | None = None,
    roles: Sequence[str | None] | None = None,
) -> str:
    """The report as text (several lines, no trailing newline); see the module docstring."""
    if rank is not None and not is_int(rank):
        raise bad_type("rank", rank, "int or None", "pass a global rank, e.g. rank=0")
    if host_of is not None and not callable(host_of):
        raise bad_type("host_of", host_of, "callable rank -> host name",
                       "pass hosts_simulated(world_size, n_hosts) or a function")
    if backends is not None and len(backends) != spec.ndim:
        raise bad_argument("backends", backends, f"has {len(backends)} entries for "
                           f"{spec.ndim} dims", "give one backend name per dim")
    array: np.ndarray | None = None
    ids: np.ndarray | None = None
    if host_of is not None and spec.size <= CROSSING_LIMIT:
        array = spec.array()
        ids = host_ids(host_of, array)[0]
    out = _header(spec, device_type, host_of, ids, rank is None)
    out += ["", *_grid(spec)]
    if roles is not None and len(roles) != spec.ndim:
        raise bad_argument("roles", roles, f"has {len(roles)} entries for {spec.ndim} dims",
                           "give one role (or None) per dim")
    out += ["", *_dims(spec, host_of, ids, backends, roles)]
    if rank is not None:
        out += ["", *_rank(spec, int(rank), host_of)]
    if ids is not None:
        assert array is not None  # set together with ids above
        hint = _advice(spec, array, ids)
        if hint is not None:
            out += ["", f"advice: {hint}"]
    return "\n".join(out)


# -- sections ----------------------------------------------------------------------------------
def _header(spec: MeshSpec, device_type: str, host_of, ids, per_rank: bool) -> list[str]:
    rows = [("names", ", ".join(spec.names) if spec.names else "(unnamed dims)")]
    if host_of is not None:
        if ids is None:
            rows.append(("hosts", f"not counted (mesh over {CROSSING_LIMIT:,} ranks)"))
        else:
            per = np.unique(ids, return_counts=True)[1]
            low, high = int(per.min()), int(per.max())
            each = f"{low:,} ranks each" if low == high else f"{low:,} to {high:,} ranks each"
            rows.append(("hosts", f"{len(per):,}, {each}"))
    if per_rank:
        rows.append(("communicators", f"{spec.ndim + 1} per rank ({_comms(spec.ndim)})"))
    shape = "(" + ", ".join(f"{s:,}" for s in spec.shape) + ("," if spec.ndim == 1 else "") + ")"
    head = f"DeviceMesh {shape} on {device_type}: {spec.size:,} ranks"
    return [head, *_pairs(rows)]


def _dims(spec: MeshSpec, host_of, ids, backends, roles=None) -> list[str]:
    headers = ["dim", "name", "size", "groups"]
    if roles is not None:
        headers.insert(2, "role")
    crossing = None
    if host_of is not None:
        headers.append("crossing hosts")
        if ids is not None:
            crossing = _crossing(ids, range(spec.ndim))
    if backends is not None:
        headers.append("backend")
    rows = []
    for d, size in enumerate(spec.shape):
        groups = spec.size // size
        row = [str(d), spec.names[d] if spec.names else "-", f"{size:,}", f"{groups:,}"]
        if roles is not None:
            row.insert(2, roles[d] or "-")
        if host_of is not None:
            row.append("not computed" if crossing is None else f"{crossing[d]:,} of {groups:,}")
        if backends is not None:
            row.append(str(backends[d]))
        rows.append(row)
    return ["dims", *_table(headers, rows)]


def _rank(spec: MeshSpec, rank: int, host_of) -> list[str]:
    coordinate = spec.coordinate_of(rank)
    if coordinate is None:
        return [f"rank {rank}", *_pairs([
            ("coordinate", "none: this rank is not in the mesh"),
            ("communicators", "1 (the world only)"),
        ])]
    named = ", ".join(f"{_name(spec, d)}={c:,}" for d, c in enumerate(coordinate))
    text = "(" + ", ".join(str(c) for c in coordinate) + ("," if spec.ndim == 1 else "") + ")"
    pairs = [("coordinate", f"{text}  {named}" if spec.names else text)]
    if host_of is not None:
        pairs.append(("host", str(host_of(rank))))
    pairs.append(("communicators", f"{spec.ndim + 1} ({_comms(spec.ndim)})"))
    headers = ["dim", "name", "local rank", "group"]
    if host_of is not None:
        headers.insert(3, "hosts")
    rows = []
    for d in range(spec.ndim):
        group = spec.line(rank, d)
        row = [str(d), spec.names[d] if spec.names else "-", f"{coordinate[d]:,}",
               _group_text(group)]
        if host_of is not None:
            row.insert(3, _group_hosts(spec, rank, d, host_of))
        rows.append(row)
    return [f"rank {rank}", *_pairs(pairs), *_table(headers, rows)]


def communicators(rank: int, made: Sequence[tuple[Ranks, str, Sequence[str]]],
                  waiting: Sequence[tuple[str, Ranks]]) -> str:
    """The communicators ``rank`` holds in its world (``made``: ranks, backend, the mesh dims
    that share it) and the dims of a mesh whose group it has not made yet (``waiting``: dim
    name, ranks). On the torchtitan expert view of 128 ranks, rank 5 after one all_reduce on
    "ep": [0-127] for the world, [5, 69] shared by the dense and expert 'pp' dims, and so on;
    'efsdp' [5, 13, 21, 29] not made yet."""
    rows = [[_group_text(ranks), backend, "; ".join(uses) or "-"]
            for ranks, backend, uses in made]
    out = [f"communicators of rank {rank} ({len(made)} made in this world)",
           *_table(["group", "backend", "shared by"], rows)]
    if waiting:
        dims = ", ".join(f"{name} {_group_text(ranks)}" for name, ranks in waiting)
        out.append(f"  not made yet (made at first use): {dims}")
    else:
        out.append("  every dim of this mesh has its communicator")
    return "\n".join(out)


def _grid(spec: MeshSpec) -> list[str]:
    full = spec.size <= FULL_GRID_LIMIT
    if spec.ndim == 1:
        return [f"ranks (along {_name(spec, 0)})", *_blocks(spec, [()], full)]
    rows, cols = _name(spec, spec.ndim - 2), _name(spec, spec.ndim - 1)
    title = f"ranks (rows: {rows}, columns: {cols}"
    if spec.ndim == 2:
        return [title + ")", *_blocks(spec, [()], full)]
    lead = spec.shape[:-2]
    title += f"; one slice per {', '.join(_name(spec, d) for d in range(len(lead)))})"
    if full:
        prefixes = [tuple(int(i) for i in p) for p in np.ndindex(*lead)]
    else:
        prefixes = list(dict.fromkeys([tuple(0 for _ in lead), tuple(s - 1 for s in lead)]))
    return [title, *_blocks(spec, prefixes, full)]


def _blocks(spec: MeshSpec, prefixes: list[tuple[int, ...]], full: bool) -> list[str]:
    """The 2-d grids of the last two dims (one row for a 1-d mesh) at each prefix.

    Every grid shares one column width, so slices line up.
    """
    if spec.ndim == 1:
        row_ids: list[int | None] = [None]
        n_cols = spec.shape[0]
    else:
        row_ids = _pick(spec.shape[-2], full, 2, 2)
        n_cols = spec.shape[-1]
    col_ids = _pick(n_cols, full, 6, 3)
    real_rows = [r for r in row_ids if r is not None] or [0]
    real_cols = [c for c in col_ids if c is not None]
    cells = {
        (p, r, c): str(spec.rank_at((c,) if spec.ndim == 1 else (*p, r, c)))
        for p in prefixes for r in real_rows for c in real_cols
    }
    width = max(3 if None in col_ids else 1, *(len(v) for v in cells.values()),
                *(len(str(c)) for c in real_cols))
    label = max(3 if None in row_ids else 1, *(len(str(r)) for r in real_rows))
    margin = " " * (label + 6)

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(width) for v in values)

    def row_text(p: tuple[int, ...], r: int) -> str:
        return line(["..." if c is None else cells[(p, r, c)] for c in col_ids])

    out: list[str] = []
    count = int(np.prod(spec.shape[:-2])) if spec.ndim > 2 else 1
    for i, p in enumerate(prefixes):
        if spec.ndim > 2:
            if i and not full and count > 2:
                out.append(f"  ... ({count - 2:,} more slices)")
            names = ", ".join(f"{spec.names[d]}={c:,}" if spec.names else f"{c:,}"
                              for d, c in enumerate(p))
            out.append(f"  [{names}, :, :]")
        if spec.ndim == 1:
            out.append("  index  " + line(["..." if c is None else str(c) for c in col_ids]))
            out.append("  rank   " + row_text(p, 0))
            continue
        out.append(margin + line(["..." if c is None else str(c) for c in col_ids]))
        for r in row_ids:
            if r is None:
                out.append("  " + "...".rjust(label) + " |")
            else:
                out.append("  " + str(r).rjust(label) + " |  " + row_text(p, r))
    return out


def _pick(n: int, full: bool, head: int, tail: int) -> list[int | None]:
    """Indices 0..n-1, or the first ``head``, None (for '...') and the last ``tail``."""
    if full or n <= head + tail + 1:
        return list(range(n))
    return [*range(head), None, *range(n - tail, n)]


def _group_text(group) -> str:
    """[4, 5, 6, 7]; long groups: first 4, '...', last 2 and the size."""
    n = len(group)
    if n <= 8:
        return "[" + ", ".join(str(r) for r in group) + "]"
    shown = [str(group[i]) for i in range(4)] + ["..."] + [str(group[n - 2]), str(group[n - 1])]
    return "[" + ", ".join(shown) + f"] (size {n:,})"


def _group_hosts(spec: MeshSpec, rank: int, dim: int, host_of) -> str:
    """How many hosts the group of ``rank`` along ``dim`` spans."""
    if spec.shape[dim] > CROSSING_LIMIT:
        return "not computed"
    ids, _ = host_ids(host_of, spec.select((dim,), rank).array())
    return f"{len(np.unique(ids)):,}"


def _comms(ndim: int) -> str:
    return f"{'one per dim' if ndim > 1 else 'one for the dim'} + the world"


def _name(spec: MeshSpec, dim: int) -> str:
    return spec.names[dim] if spec.names else f"dim {dim}"


def _pairs(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return ("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), *(line(r) for r in rows)]
