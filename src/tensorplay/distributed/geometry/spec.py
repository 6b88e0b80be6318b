"""Pure mesh description: a layout of positions, an optional position -> rank table, dim names.

A mesh from init_device_mesh has no table (position == rank) and costs O(ndim) whatever the
world size. An explicit rank array that no ordered layout enumerates, such as [[3, 1], [2, 0]],
keeps a table. On a (2, 4) mesh named ("dp", "tp"), rank 5 is at (1, 1); its "tp" line is
[4, 5, 6, 7] and its "dp" line is [1, 5].
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .layout import Layout, fit


class RankTable:
    """An immutable position -> rank map with its inverse, compared by content."""

    __slots__ = ("_ranks", "_index", "_digest")

    def __init__(self, ranks: Sequence[int]):
        self._ranks = tuple(int(r) for r in ranks)
        self._index = {r: i for i, r in enumerate(self._ranks)}
        self._digest = hashlib.sha256(repr(self._ranks).encode()).hexdigest()

    def rank(self, position: int) -> int:
        """Rank stored at a position."""
        return self._ranks[position]

    def position(self, rank: int) -> int | None:
        """Position of a rank, None when absent."""
        return self._index.get(rank)

    def __len__(self) -> int:
        return len(self._ranks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankTable) and self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __reduce__(self):
        return RankTable, (self._ranks,)


class Ranks:
    """The ordered global ranks of a group: a 1-d layout in rank space, or an explicit tuple.

    Length, indexing and index() cost O(modes) for a layout, so a group of a million ranks
    costs nothing until listed.
    """

    __slots__ = ("_layout", "_explicit")

    def __init__(self, layout: Layout | None = None, explicit: Sequence[int] | None = None):
        # An explicit list that a layout enumerates is kept as that layout, so that key()
        # is the same however the sequence was given.
        if layout is None and explicit is not None:
            layout = fit(list(explicit))
        self._layout = layout
        self._explicit = None if layout is not None or explicit is None else tuple(explicit)

    @classmethod
    def of(cls, values: Sequence[int]) -> Ranks:
        """Ranks of an explicit list, kept as a layout when one enumerates it."""
        return cls(explicit=values)

    def __len__(self) -> int:
        if self._layout is not None:
            return self._layout.numel
        assert self._explicit is not None  # __init__ keeps one of the two
        return len(self._explicit)

    def __getitem__(self, index: int) -> int:
        if self._layout is not None:
            n = len(self)
            if not -n <= index < n:
                raise IndexError(index)
            return self._layout.position((index % n,))
        assert self._explicit is not None  # __init__ keeps one of the two
        return self._explicit[index]

    def __iter__(self) -> Iterator[int]:
        for i in range(len(self)):
            yield self[i]

    def __contains__(self, rank: object) -> bool:
        return (
            isinstance(rank, numbers.Integral)
            and not isinstance(rank, bool)
            and self.index(int(rank)) is not None
        )

    def index(self, rank: int) -> int | None:
        """Position of ``rank`` in the group, None when it is not a member."""
        if self._layout is not None:
            found = self._layout.coordinate(rank)
            return None if found is None else found[0]
        assert self._explicit is not None  # __init__ keeps one of the two
        try:
            return self._explicit.index(rank)
        except ValueError:
            return None

    def key(self) -> tuple:
        """Identity of the ordered rank sequence, equal for equal sequences however built."""
        if self._layout is not None:
            return ("layout", *self._layout.canonical())
        return ("ranks", self._explicit)

    def tolist(self) -> list[int]:
        """All ranks as a list (materialises them)."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ranks) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        n = len(self)
        if n <= 8:
            return f"Ranks({self.tolist()})"
        return f"Ranks([{self[0]}, {self[1]}, ..., {self[n - 1]}], size={n})"


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """Layout + optional rank table + dim names: everything a mesh is, without processes."""

    layout: Layout
    names: tuple[str, ...] | None = None
    table: RankTable | None = None

    @classmethod
    def row_major(cls, shape: Sequence[int], names: Sequence[str] | None = None) -> MeshSpec:
        """Ranks 0..N-1 filling ``shape`` row-major: the mesh of init_device_mesh."""
        return cls(Layout.row_major(shape), None if names is None else tuple(names))

    @classmethod
    def from_ranks(
        cls, shape: Sequence[int], ranks: Sequence[int], names: Sequence[str] | None = None
    ) -> MeshSpec:
        """A mesh of ``shape`` holding ``ranks`` (row-major list); tableless when possible."""
        named = None if names is None else tuple(names)
        found = fit(list(ranks))
        if found is not None:
            try:
                layout = found.unflatten(0, shape)
            except ValueError:  # the fitted modes cut across the requested dims
                layout = None
            if layout is not None and layout.is_ordered():
                return cls(layout, named)
        return cls(Layout.row_major(shape), named, RankTable(ranks))

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension."""
        return self.layout.shape

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self.layout.ndim

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return self.layout.numel

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """Global rank at an in-range coordinate."""
        position = self.layout.position(coordinate)
        return position if self.table is None else self.table.rank(position)

    def _position_of(self, rank: int) -> int | None:
        return rank if self.table is None else self.table.position(rank)

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank``, None when the mesh does not hold it."""
        position = self._position_of(rank)
        return None if position is None else self.layout.coordinate(position)

    def shift(self, rank: int, dim: int, disp: int, periodic: bool
              ) -> tuple[int | None, int | None]:
        """(source, dest) of ``rank`` along ``dim``, as MPI's ``Cart_shift``: dest is the rank
        ``disp`` steps further along the dim, source the rank ``disp`` steps back; None past
        an open end, wrapped around when ``periodic``. O(ndim).

        On the (2, 4) row-major mesh, rank 5 = (1, 1): shift(5, 1, 1, False) = (4, 6);
        shift(5, 1, 3, False) = (None, None); shift(5, 1, 3, True) = (6, 4).
        """
        coord = self.coordinate_of(rank)
        if coord is None:
            raise ValueError(f"rank {rank} is not in the mesh")
        size = self.shape[dim]

        def at(step: int) -> int | None:
            i = coord[dim] + step
            if periodic:
                i %= size
            elif not 0 <= i < size:
                return None
            return self.rank_at(coord[:dim] + (i,) + coord[dim + 1:])

        return at(-disp), at(disp)

    def line(self, rank: int, dim: int) -> Ranks:
        """Ranks on the line through ``rank`` along ``dim``, in mesh order."""
        return self.select((dim,), rank).ranks()

    def ranks(self) -> Ranks:
        """All ranks of the mesh in row-major order."""
        if self.table is None:
            return Ranks(layout=Layout((self.layout.modes(),), self.layout.offset))
        return Ranks.of(self.array().reshape(-1).tolist())

    def select(self, dims: Sequence[int], rank: int) -> MeshSpec:
        """Sub-mesh of ``dims`` through ``rank`` (the other coordinates fixed at its own)."""
        position = self._position_of(rank)
        if position is None:
            raise ValueError(f"rank {rank} is not in the mesh")
        layout = self.layout.select(dims, position)
        names = None if self.names is None else tuple(self.names[d] for d in dims)
        return self._with(layout, names)

    def flatten(self, name: str | None, dims: Sequence[int] | None = None) -> MeshSpec:
        """Merge ``dims`` (default all) into one dim called ``name``; a 1-d result if all."""
        chosen = list(range(self.ndim)) if dims is None else list(dims)
        layout = self.layout.flatten(chosen)
        names: tuple[str, ...] | None
        if self.names is None:
            names = (name,) if name is not None and layout.ndim == 1 else None
        else:
            merged = name if name is not None else "_".join(self.names[d] for d in chosen)
            # Same placement as Layout.flatten: the merged dim goes where chosen[0] was.
            names = tuple(
                merged if d == chosen[0] else n
                for d, n in enumerate(self.names)
                if d == chosen[0] or d not in chosen
            )
        return self._with(layout, names)

    def unflatten(self, dim: int, sizes: Sequence[int], names: Sequence[str] | None) -> MeshSpec:
        """Split ``dim`` into dims of ``sizes`` called ``names`` (a reshape of that axis).

        Raises ValueError only when the sizes do not multiply to the dim's size.
        """
        if self.names is None:  # names can only name every dim of an unnamed 1-d mesh
            new_names = tuple(names) if names is not None and self.ndim == 1 else None
        else:
            new_names = self.names[:dim] + tuple(names or ()) + self.names[dim + 1 :]
        try:
            layout = self.layout.unflatten(dim, sizes)
        except ValueError:
            if math.prod(sizes) != self.shape[dim]:
                raise
            # No layout makes this reshape (ranks 0..5, 100..105 in rows of 4): keep a table.
            shape = self.shape[:dim] + tuple(sizes) + self.shape[dim + 1 :]
            return MeshSpec.from_ranks(shape, self.array().reshape(-1).tolist(), new_names)
        return self._with(layout, new_names)

    def reshape(self, shape: Sequence[int], names: Sequence[str] | None) -> MeshSpec:
        """The same ranks in row-major order, in ``shape`` (numpy's ``array().reshape``).

        O(ndim) when the layout splits into the new dims (a row-major mesh always does);
        otherwise the ranks are kept in a table (O(size)).
        """
        flat = self if self.ndim == 1 else self._with(self.layout.flatten(), None)
        flat = MeshSpec(flat.layout, None, flat.table)
        return flat.unflatten(0, tuple(shape), None if names is None else tuple(names))

    def same_lines(self, dim: int, other: MeshSpec, other_dim: int) -> bool:
        """Whether ``dim`` here and ``other_dim`` of ``other`` (a mesh of the same ranks, such
        as a reshape of this one) enumerate the same groups, each in the same order, through
        every rank.

        With one rank table (or none) on both sides, it compares the two dims' coalesced
        modes: an ordered layout splits each position into unique digits, so equal modes give
        every rank the same coordinate, hence the same line; different modes give no rank the
        same line. O(modes). Otherwise it compares the lines rank by rank (O(size x ndim)).
        """
        if self.size != other.size or self.shape[dim] != other.shape[other_dim]:
            return False
        if self.table == other.table and self._same_positions(other):
            return self.layout.dims[dim] == other.layout.dims[other_dim]
        return all(self.line(r, dim) == other.line(r, other_dim) for r in self.ranks())

    def _same_positions(self, other: MeshSpec) -> bool:
        """Whether both layouts enumerate one set of positions (by their 1-d flattenings)."""
        mine = Layout((self.layout.modes(),), self.layout.offset)
        theirs = Layout((other.layout.modes(),), other.layout.offset)
        if mine.canonical() == theirs.canonical():
            return True
        if self.size > 1 << 16:
            return False
        import numpy as np

        return bool(np.array_equal(np.sort(mine.positions()), np.sort(theirs.positions())))

    def root_dims(self, root: MeshSpec, rank: int) -> tuple[tuple[int, ...], ...]:
        """For each dim of this mesh, a slice or flatten of ``root`` holding ``rank``, the root
        dims it runs along, in root order; () for a dim of size 1.

        On the (2, 2, 2) root ("dp", "cp", "tp"), root["dp", "cp"].flatten() through rank 5
        runs along root dims (0, 1): its line [1, 3, 5, 7] walks "dp" and "cp" row-major with
        "tp" held at 1. Costs O(ranks on the lines x ndim). Raises ValueError when a line is
        not such a walk (a mesh that no slice or flatten of ``root`` gives).
        """
        home = root.coordinate_of(rank)
        if home is None:
            raise ValueError(f"rank {rank} is not in the root mesh")
        found = []
        for d in range(self.ndim):
            line = self.line(rank, d)
            moved: set[int] = set()
            for r in line:
                coord = root.coordinate_of(r)
                if coord is None:
                    raise ValueError(f"rank {r} of dim {d} is not in the root mesh")
                moved.update(i for i, (a, b) in enumerate(zip(coord, home, strict=True))
                             if a != b)
            dims = tuple(sorted(moved))
            if dims and root.select(dims, rank).ranks() != line:
                raise ValueError(f"dim {d} ({line!r}) does not walk root dims {dims} in order")
            found.append(dims)
        return tuple(found)

    def array(self):
        """The rank array as numpy, of ``shape`` (materialises every rank)."""
        positions = self.layout.positions()
        if self.table is None:
            return positions
        import numpy as np

        lookup = np.asarray(self.table._ranks, dtype=np.int64)
        return lookup[positions]

    def _with(self, layout: Layout, names: tuple[str, ...] | None) -> MeshSpec:
        """Same table, new layout; drop the table when the ranks form an ordered layout."""
        if self.table is None:
            return MeshSpec(layout, names)
        spec = MeshSpec(layout, names, self.table)
        if spec.size <= 1 << 16:
            ranks = spec.array().reshape(-1).tolist()
            return MeshSpec.from_ranks(spec.shape, ranks, names)
        return spec
