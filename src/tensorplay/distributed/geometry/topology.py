"""Pure host topology: which host each rank runs on, which mesh groups cross hosts, and a rank
order that keeps the innermost dims' groups inside one host.

A host map is any callable ``host_of(rank) -> str``. ``hosts_simulated(16, 2)`` puts ranks
0-7 on "host0" and 8-15 on "host1" (blocks, as launchers fill hosts). On a round-robin
launcher (host = rank % 2) a row-major (4, 4) mesh named ("dp", "tp") has all 4 "tp" groups
crossing hosts ([0, 1, 2, 3] spans both) and no "dp" group crossing ([0, 4, 8, 12] is all on
host 0). host_aware_order((4, 4), that map) gives [0, 2, 4, ..., 14, 1, 3, ..., 15]: the "tp"
groups become [0, 2, 4, 6], ... (inside one host) and the "dp" groups cross instead, which is
what a mesh wants: bandwidth-hungry inner dims on the fast links inside a host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import bad_argument, bad_type, check_int
from .spec import MeshSpec

HostOf = Callable[[int], str]
"""The host map interface: global rank -> host name."""

CROSSING_LIMIT = 1 << 22
"""Largest mesh (in ranks) for which callers should count crossing groups (O(N) numpy work)."""


class Hosts:
    """A host map that also answers for a whole numpy array of ranks at once.

    Either blocks (rank r on host r // per_host, the launcher's fill order) or a table of one
    host name per rank. ``Hosts.blocks(8, 2)(5)`` is "host1"; ``Hosts.from_names(["a", "b",
    "a", "b"]).ids(np.array([0, 1, 2, 3]))`` is [0, 1, 0, 1] (hosts numbered by smallest rank).
    """

    __slots__ = ("_names", "_per_host", "_table", "_size")

    def __init__(self, names: Sequence[str], size: int, per_host: int | None, table=None):
        self._names = tuple(names)
        self._size = size
        self._per_host = per_host
        self._table = table

    @classmethod
    def blocks(cls, world_size: int, n_hosts: int, names: Sequence[str] | None = None) -> Hosts:
        """``n_hosts`` hosts of world_size // n_hosts consecutive ranks each."""
        world_size = _positive("world_size", world_size)
        n_hosts = _positive("n_hosts", n_hosts)
        if world_size % n_hosts:
            raise bad_argument("n_hosts", n_hosts, f"does not divide world_size={world_size}",
                               "give a host count that divides the world size")
        if names is None:
            names = [f"host{i}" for i in range(n_hosts)]
        elif len(names) != n_hosts:
            raise bad_argument("names", names, f"has {len(names)} names for {n_hosts} hosts",
                               f"give {n_hosts} names")
        return cls(names, world_size, world_size // n_hosts)

    @classmethod
    def round_robin(cls, world_size: int, n_hosts: int) -> Hosts:
        """Rank r on host f"host{r % n_hosts}": a launcher that deals ranks out like cards."""
        blocks = cls.blocks(world_size, n_hosts)  # same checks
        table = (np.arange(world_size, dtype=np.int64) % n_hosts).astype(np.int32)
        return cls(blocks.names, world_size, None, table)

    @classmethod
    def from_names(cls, names: Sequence[str]) -> Hosts:
        """Host of rank r is names[r]: the list a real world gathers at init."""
        index: dict[str, int] = {}
        ids = np.empty(len(names), dtype=np.int32)
        for rank, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise bad_argument(f"names[{rank}]", name, "is not a host name",
                                   "give one non-empty str per rank")
            ids[rank] = index.setdefault(name, len(index))
        if not len(ids):
            raise bad_argument("names", names, "is empty", "give one host name per rank")
        return cls(tuple(index), len(ids), None, ids)

    @property
    def size(self) -> int:
        """Number of ranks covered: 0 .. size-1."""
        return self._size

    @property
    def names(self) -> tuple[str, ...]:
        """Host names; names[i] is the host with id i (ids follow the smallest rank)."""
        return self._names

    def ids(self, ranks) -> np.ndarray:
        """Host id of every rank in an int array of any shape (vectorised)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self._size):
            bad = int(ranks.max() if ranks.max() >= self._size else ranks.min())
            raise bad_argument("rank", bad, f"is outside the {self._size} ranks this host map "
                               "covers", f"ask for ranks 0..{self._size - 1}")
        if self._table is None:
            return (ranks // self._per_host).astype(np.int32)
        return self._table[ranks]

    def __call__(self, rank: int) -> str:
        return self._names[int(self.ids(np.array([rank]))[0])]

    def __repr__(self) -> str:
        if self._table is None:
            return f"Hosts.blocks({self._size}, {len(self._names)})"
        return f"Hosts(<{len(self._names)} hosts over {self._size} ranks>)"


def hosts_simulated(world_size: int, n_hosts: int) -> Hosts:
    """Rank r on host f"host{r // (world_size // n_hosts)}": hosts(16, 2)(9) -> "host1"."""
    return Hosts.blocks(world_size, n_hosts)


def hosts_round_robin(world_size: int, n_hosts: int) -> Hosts:
    """Rank r on host f"host{r % n_hosts}": hosts_round_robin(16, 2)(9) -> "host1"."""
    return Hosts.round_robin(world_size, n_hosts)


def hosts_from_names(names: Sequence[str]) -> Hosts:
    """The host map of a real world from the host name of each rank, gathered at init."""
    return Hosts.from_names(names)


def host_ids(host_of: HostOf, ranks) -> tuple[np.ndarray, tuple[str, ...]]:
    """(host id of each of ``ranks``, host names by id) for any host map; O(len(ranks)).

    A Hosts answers in numpy; any other callable is asked once per rank.
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    if isinstance(host_of, Hosts):
        return host_of.ids(ranks), host_of.names
    if not callable(host_of):
        raise bad_type("host_of", host_of, "callable rank -> host name",
                       "pass hosts_simulated(world_size, n_hosts) or a function")
    index: dict[str, int] = {}
    flat = ranks.reshape(-1)
    ids = np.empty(flat.shape, dtype=np.int32)
    for i, rank in enumerate(flat.tolist()):
        name = host_of(rank)
        if not isinstance(name, str):
            raise bad_type(f"host_of({rank})", name, "str", "return the host name as a str")
        ids[i] = index.setdefault(name, len(index))
    return ids.reshape(ranks.shape), tuple(index)


def _positive(name: str, value: object) -> int:
    count = check_int(name, value, "pass a whole number")
    if count < 1:
        raise bad_argument(name, value, "must be at least 1", "pass a positive count")
    return count


def _crossing(ids: np.ndarray, dims: Sequence[int]) -> dict[int, int]:
    """Lines along each of ``dims`` of the host-id array whose ranks are on several hosts."""
    out: dict[int, int] = {}
    for d in dims:
        lines = np.moveaxis(ids, d, -1).reshape(-1, ids.shape[d])
        out[d] = int(np.count_nonzero(lines.min(axis=1) != lines.max(axis=1)))
    return out


def crossing_dims(spec: MeshSpec, host_of: HostOf) -> dict[int, int]:
    """For each dim, how many of its groups hold ranks of more than one host.

    Of size // shape[d] groups per dim. On a (2, 4) ("dp", "tp") mesh with
    hosts_simulated(8, 2): {0: 4, 1: 0} (every "dp" group [j, 4 + j] spans both hosts, each
    "tp" row stays inside one). O(N) numpy work; callers skip it above CROSSING_LIMIT.
    """
    ids, _ = host_ids(host_of, spec.array())
    return _crossing(ids, range(spec.ndim))


def _inner_block(shape: Sequence[int], per_host: int) -> int:
    """Largest k such that the product of the last k dims divides ``per_host``."""
    k, block = 0, 1
    for size in reversed(shape):
        if per_host % (block * size):
            break
        k, block = k + 1, block * size
    return k


def _inner_dims(shape: Sequence[int], ids: np.ndarray) -> int:
    """How many inner dims a host-major order keeps inside one host (``ids``: host per rank).

    0 when hosts hold unequal numbers of ranks or no inner dim bigger than 1 fits in a host.
    """
    counts = np.unique(ids, return_counts=True)[1]
    if counts.min() != counts.max():
        return 0
    k = _inner_block(shape, int(counts[0]))
    return k if math.prod(shape[len(shape) - k:]) > 1 else 0


def host_aware_order(shape: Sequence[int], host_of: HostOf) -> list[int] | None:
    """Ranks to lay out row-major over ``shape`` so the innermost dims' groups stay on one host.

    Hosts in order of their smallest rank, each host's ranks ascending, concatenated; the
    product of the last k dims divides the ranks per host, so each inner block lies inside one
    host. With host = rank % 2 on 16 ranks and shape (4, 4): [0, 2, ..., 14, 1, 3, ..., 15].
    None when hosts hold unequal numbers of ranks, no inner dim fits in a host, or row-major
    order already keeps those inner dims inside hosts (nothing to improve). O(N log N).
    """
    shape = tuple(_positive(f"shape[{i}]", s) for i, s in enumerate(shape))
    ids, _ = host_ids(host_of, np.arange(math.prod(shape), dtype=np.int64))
    k = _inner_dims(shape, ids)
    if k == 0:
        return None
    inner = range(len(shape) - k, len(shape))
    if not any(_crossing(ids.reshape(shape), inner).values()):
        return None
    _, first, host = np.unique(ids, return_index=True, return_inverse=True)
    place = np.argsort(np.argsort(first))  # host -> its place when ordered by smallest rank
    return np.argsort(place[host.reshape(-1)], kind="stable").tolist()


def advice(spec: MeshSpec, host_of: HostOf) -> str | None:
    """One line when some dim's groups cross hosts but a host-aware order keeps them inside.

    Only for a mesh of ranks 0..N-1 (the whole world). On 16 ranks with host = rank % 2 and a
    row-major (4, 4) ("dp", "tp") mesh: "mesh dim 'tp': 4 of 4 groups cross hosts; a host-aware
    rank order keeps them inside one host. Fix: init_device_mesh(..., host_aware=True)."
    """
    array = spec.array()
    return _advice(spec, array, host_ids(host_of, array)[0])


def _advice(spec: MeshSpec, array: np.ndarray, ids: np.ndarray) -> str | None:
    """advice() given the rank array and the host id of each of its ranks."""
    if int(array.min()) != 0 or int(array.max()) != spec.size - 1:
        return None
    k = _inner_dims(spec.shape, ids)
    if k == 0:
        return None
    inner = list(range(spec.ndim - k, spec.ndim))
    crossing = _crossing(ids, inner)
    fixable = [d for d in inner if crossing[d]]
    if not fixable:
        return None
    parts = [f"{dim_label(spec, d)}: {crossing[d]:,} of {spec.size // spec.shape[d]:,} groups"
             for d in fixable]
    noun = "dim" if len(fixable) == 1 else "dims"
    return (f"mesh {noun} {'; '.join(parts)} cross hosts; a host-aware rank order keeps them "
            "inside one host. Fix: init_device_mesh(..., host_aware=True).")


def slices_per_host(spec: MeshSpec, dim: int, host_of: HostOf) -> dict[str, list[int]]:
    """host -> the slices (indices along ``dim``) holding a rank of that host: what losing
    the host costs an elastic mesh on ``dim``. (2, 4) ("dp", "tp") on 2 hosts of 4 ranks in
    blocks: {"hostA": [0], "hostB": [1]}; dealt round-robin: both hosts cost both slices.
    O(mesh size)."""
    array = spec.array()
    ids, names = host_ids(host_of, array)
    coords = np.indices(array.shape)[dim]  # each position's slice along ``dim``
    found: dict[str, set[int]] = {}
    for host_id, index in zip(ids.reshape(-1).tolist(), coords.reshape(-1).tolist(),
                              strict=True):
        found.setdefault(names[host_id], set()).add(index)
    return {host: sorted(indices) for host, indices in found.items()}


def dim_label(spec: MeshSpec, dim: int) -> str:
    """"'tp'" for a named dim, "1" for an unnamed one."""
    return repr(spec.names[dim]) if spec.names else str(dim)
