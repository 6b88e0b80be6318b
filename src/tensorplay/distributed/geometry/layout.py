"""Pure mesh geometry: a layout maps an n-d coordinate to an integer position.

Each dimension is a row-major product of modes ``(size, stride)``; the position of a coordinate
is ``offset + sum(mode_coordinate * stride)``. A (2, 4) row-major layout has dims
``(((2, 4),), ((4, 1),))``: coordinate (1, 1) is position 5, and the line through 5 along
dim 1 is [4, 5, 6, 7]. Flattening concatenates modes, unflattening splits them, slicing keeps
some dims and folds the others into the offset, so every operation costs O(number of modes),
whatever the number of positions. No processes, no numpy unless materialising is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Mode = tuple[int, int]
"""One factor of a dimension: (size, stride)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """An injective map from coordinates of ``shape`` to integer positions."""

    dims: tuple[tuple[Mode, ...], ...]
    offset: int = 0

    def __post_init__(self) -> None:
        # Each dim is stored coalesced ((2, 6), (6, 1) -> (12, 1); a size-1 dim is ((1, 1),)),
        # so equal layouts compare equal however they were built, and unflatten() can split
        # a dim that an earlier flatten() made of several modes.
        dims = tuple(_coalesce(modes) or ((1, 1),) for modes in self.dims)
        object.__setattr__(self, "dims", dims)

    @classmethod
    def row_major(cls, shape: Sequence[int], offset: int = 0) -> Layout:
        """The compact row-major layout of ``shape``: (2, 4) -> strides (4, 1)."""
        dims: list[tuple[Mode, ...]] = []
        stride = 1
        for size in reversed(shape):
            dims.append(((size, stride),))
            stride *= size
        return cls(tuple(reversed(dims)), offset)

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension (the product of its modes)."""
        return tuple(math.prod(size for size, _ in modes) for modes in self.dims)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.dims)

    @property
    def numel(self) -> int:
        """Number of positions."""
        return math.prod(self.shape)

    def modes(self) -> tuple[Mode, ...]:
        """All modes of all dims, outermost first."""
        return tuple(mode for modes in self.dims for mode in modes)

    def position(self, coordinate: Sequence[int]) -> int:
        """Position of an in-range coordinate: (1, 1) of a (2, 4) row-major layout -> 5."""
        return self.offset + sum(
            _dim_contribution(modes, c) for modes, c in zip(self.dims, coordinate, strict=True)
        )

    def coordinate(self, position: int) -> tuple[int, ...] | None:
        """Inverse of position(); None when the position is not in the layout.

        Requires an ordered layout (see is_ordered); every layout built from row_major by the
        operations below is one.
        """
        rest = position - self.offset
        if rest < 0:
            return None
        found: dict[int, int] = {}
        for index, (size, stride) in sorted(
            enumerate(self.modes()), key=lambda item: item[1][1], reverse=True
        ):
            if size == 1:
                found[index] = 0
                continue
            digit = rest // stride if stride else 0
            if digit >= size:
                return None
            found[index] = digit
            rest -= digit * stride
        if rest != 0:
            return None
        coordinate: list[int] = []
        index = 0
        for modes in self.dims:
            value = 0
            for size, _ in modes:
                value = value * size + found[index]
                index += 1
            coordinate.append(value)
        return tuple(coordinate)

    def is_ordered(self) -> bool:
        """True when each stride exceeds the largest sum of all smaller-stride steps.

        That makes coordinate() exact by greedy division (largest stride first).
        """
        reach = 0
        for size, stride in sorted(self.modes(), key=lambda mode: mode[1]):
            if size == 1:
                continue
            if stride <= reach:
                return False
            reach += (size - 1) * stride
        return True

    def line(self, position: int, dim: int) -> Layout:
        """The 1-d layout of the positions through ``position`` along ``dim``."""
        return self.select((dim,), position)

    def select(self, dims: Sequence[int], position: int) -> Layout:
        """Keep ``dims`` (in the given order) and fix the others at ``position``'s coordinate."""
        coordinate = self.coordinate(position)
        if coordinate is None:
            raise ValueError(f"position {position} is not in {self}")
        kept = {d: coordinate[d] for d in dims}
        offset = self.position([0 if d in kept else c for d, c in enumerate(coordinate)])
        return Layout(tuple(self.dims[d] for d in dims), offset)

    def flatten(self, dims: Sequence[int] | None = None) -> Layout:
        """Merge ``dims`` (default: all, in order) into one dim placed where the first one was."""
        chosen = list(range(self.ndim)) if dims is None else list(dims)
        merged = tuple(mode for d in chosen for mode in self.dims[d])
        out: list[tuple[Mode, ...]] = []
        for d, modes in enumerate(self.dims):
            if d == chosen[0]:
                out.append(merged)
            elif d not in chosen:
                out.append(modes)
        return Layout(tuple(out), self.offset)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> Layout:
        """Split ``dim`` into dims of ``sizes`` (row-major), splitting modes where needed.

        Raises ValueError when the sizes do not multiply to the dim's size or cut a mode in
        a way that is not row-major (a mode of 6 cannot give an inner dim of 4).
        """
        if math.prod(sizes) != self.shape[dim]:
            raise ValueError(f"sizes {tuple(sizes)} do not multiply to {self.shape[dim]}")
        pending = list(self.dims[dim])
        new_dims: list[tuple[Mode, ...]] = []
        for target in reversed(sizes):
            taken: list[Mode] = []
            need = target
            while need > 1:
                size, stride = pending.pop()
                if size == 1:
                    continue
                if need % size == 0:
                    taken.append((size, stride))
                    need //= size
                elif size % need == 0:
                    taken.append((need, stride))
                    pending.append((size // need, stride * need))
                    need = 1
                else:
                    raise ValueError(f"size {target} does not divide mode {(size, stride)}")
            new_dims.append(tuple(reversed(taken)) or ((1, 1),))
        out = self.dims[:dim] + tuple(reversed(new_dims)) + self.dims[dim + 1 :]
        return Layout(out, self.offset)

    def positions(self):
        """All positions as a numpy array of ``shape`` (materialises numel integers)."""
        import numpy as np

        flat = np.full(1, self.offset, dtype=np.int64)
        for size, stride in self.modes():
            flat = (flat[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
        return flat.reshape(self.shape)

    def canonical(self) -> tuple[int, tuple[Mode, ...]]:
        """Key of the ordered 1-d sequence this layout enumerates: (offset, coalesced modes).

        Two layouts that enumerate the same positions in the same order share it; so does
        fit() of that sequence.
        """
        return self.offset, _coalesce(self.modes())


def fit(values: Sequence[int]) -> Layout | None:
    """A 1-d ordered layout that enumerates ``values`` exactly, or None when none exists.

    [0, 1, 4, 5] -> offset 0, modes ((2, 4), (2, 1)).  O(len(values)).
    """
    if not values:
        return None
    base = values[0]
    rel = [v - base for v in values]
    modes: list[Mode] = []
    count = len(rel)
    block = 1  # distance in the list between consecutive elements of the current mode
    while block < count:
        stride = rel[block]
        run = 1
        while run * block < count and rel[run * block] == run * stride:
            run += 1
        if count % (run * block):
            return None
        period = run * block
        for start in range(0, count, period):
            head = rel[start]
            for i in range(period):
                if rel[start + i] != head + rel[i]:
                    return None
        modes.append((run, stride))
        block = period
    layout = Layout((tuple(reversed(modes)) or ((1, 1),),), base)
    return layout if layout.is_ordered() else None


def _dim_contribution(modes: Sequence[Mode], value: int) -> int:
    """Position step of coordinate ``value`` along a dim made of ``modes`` (row-major)."""
    total = 0
    for size, stride in reversed(modes):
        value, digit = divmod(value, size)
        total += digit * stride
    return total


def _coalesce(modes: Sequence[Mode]) -> tuple[Mode, ...]:
    """Drop size-1 modes and merge neighbours that continue each other: (2,4),(4,1) -> (8,1)."""
    out: list[Mode] = []
    for size, stride in reversed(modes):
        if size == 1:
            continue
        if out and out[-1][1] * out[-1][0] == stride:
            inner_size, inner_stride = out.pop()
            out.append((inner_size * size, inner_stride))
        else:
            out.append((size, stride))
    return tuple(reversed(out))
