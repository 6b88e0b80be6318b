"""An elastic mesh's geometry (pure): shrink removes the slices of the elastic dim that hold a
lost rank; grow puts back every slice of the full mesh whose ranks are all present again.

The first step of keeping a job alive when ranks die (the elastic recovery of issue "Keep
training when ranks die"): every survivor computes the same smaller mesh from the same agreed
set of lost ranks, so no rank's own view decides anything.

Worked example: a (2, 4) mesh named ("dp", "tp"), ranks 0..7 row-major, elastic dim "dp".
Rank 5 dies. Rank 5 sits in "dp" slice 1 (ranks 4..7), so that slice goes:

    shrink((2, 4), range(8), dim=0, lost={5})
    -> Shrunk(shape=(1, 4), ranks=(0, 1, 2, 3), removed=(1,), spares=(4, 6, 7), lost=(5,))

Ranks 4, 6 and 7 are healthy but their slice is gone: they become spares (their new mesh does
not hold them) until the slice can be refilled. Lost ranks outside the mesh change nothing.
Cost: O(world size) once per recovery, never per query.

Growing back, the same mesh: the full layout is (2, 4) over ranks 0..7; the mesh holds 0..3;
spares 4, 6, 7 and a replacement for 5 wait. Every rank of slice 1 is present again:

    grow((2, 4), range(8), dim=0, present={0, 1, 2, 3, 4, 5, 6, 7}) -> ((2, 4), (0, ..., 7))

With only 4, 6, 7 present (5 not replaced yet), slice 1 stays out: ((1, 4), (0, 1, 2, 3)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ShrinkError, format_ranks, rank_words


@dataclass(frozen=True)
class Shrunk:
    """The mesh left after removing every slice of ``dim`` that held a lost rank."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # row-major, as MeshSpec.from_ranks takes them
    removed: tuple[int, ...]  # indices along the elastic dim that were removed
    spares: tuple[int, ...]  # healthy ranks of the removed slices
    lost: tuple[int, ...]  # the lost ranks that were in the mesh


def shrink(shape: Sequence[int], ranks: Sequence[int], dim: int, lost: Iterable[int], *,
           minimum: int = 1, dim_name: str | None = None, hosts: Sequence[str] = (),
           alive: Iterable[int] = ()) -> Shrunk:
    """Remove the slices of ``dim`` holding a rank of ``lost`` from the row-major ``ranks``.

    Raises ShrinkError when fewer than ``minimum`` slices would remain (``dim_name`` words it,
    ``hosts``, the lost ranks' hosts, follow them: "lost ranks 4-7 (host hostB) in slice 1";
    ``alive``, lost ranks whose process still ran, are said to be: "ranks 1, 3 of them were
    alive, declared lost for reaching the recovery late").
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim {dim} is outside a mesh of {len(shape)} dims")
    inner = 1
    for size in shape[dim + 1:]:
        inner *= size
    outer_stride = shape[dim] * inner
    gone = set(lost)
    hit = sorted({(i % outer_stride) // inner for i, r in enumerate(ranks) if r in gone})
    keep = [k for k in range(shape[dim]) if k not in set(hit)]
    name = repr(dim_name) if dim_name is not None else str(dim)
    if len(keep) < minimum:
        raise ShrinkError(
            f"mesh dim {name} would keep {len(keep)} of its {shape[dim]} slices, below its "
            f"minimum of {minimum}: lost {rank_words(gone & set(ranks))}{_on(hosts)} in "
            f"slice{'s' if len(hit) > 1 else ''} {format_ranks(hit)}{_late(gone, alive)}. "
            f"Fix: restart the job from its last checkpoint, or allow a smaller minimum")
    kept, spares = [], []
    for i, r in enumerate(ranks):
        if (i % outer_stride) // inner in set(hit):
            if r not in gone:
                spares.append(r)
        else:
            kept.append(r)
    new_shape = shape[:dim] + (len(keep),) + shape[dim + 1:]
    return Shrunk(new_shape, tuple(kept), tuple(hit), tuple(spares),
                  tuple(sorted(gone & set(ranks))))


def grow(full_shape: Sequence[int], full_ranks: Sequence[int], dim: int,
         present: Iterable[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, row-major ranks) of the full mesh keeping only the slices of ``dim`` whose
    ranks are all in ``present``; slices keep their order along ``dim``."""
    shape = tuple(int(s) for s in full_shape)
    inner = 1
    for size in shape[dim + 1:]:
        inner *= size
    outer_stride = shape[dim] * inner
    have = set(present)
    broken = {(i % outer_stride) // inner for i, r in enumerate(full_ranks) if r not in have}
    kept = tuple(r for i, r in enumerate(full_ranks) if (i % outer_stride) // inner not in broken)
    return shape[:dim] + (shape[dim] - len(broken),) + shape[dim + 1:], kept


def _late(lost: set[int], alive: Iterable[int]) -> str:
    """"; ranks 1, 3 of them were alive, ..." for lost ranks that were still running, or ""."""
    late = lost & set(alive)
    if not late:
        return ""
    were = "was" if len(late) == 1 else "were"
    return (f"; {rank_words(late)} of them {were} alive, declared lost for reaching the "
            f"recovery late")


def _on(hosts: Sequence[str]) -> str:
    """" (host hostB)", " (hosts hostB, hostC)", or "" when unknown."""
    if not hosts:
        return ""
    return f" (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})"
