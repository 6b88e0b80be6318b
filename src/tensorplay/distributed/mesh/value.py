"""DeviceMesh, the value: an n-d array of global ranks with one process group per dimension.

The public module is ``device_mesh`` (``init_device_mesh``, ``sync_replicas``, this class);
the elastic layer (``elastic.mesh.ElasticMesh``) subclasses it.

On a (2, 4) mesh named ("dp", "tp"), rank 5 is at (1, 1); its "tp" group is [4, 5, 6, 7] and
its "dp" group is [1, 5]. A mesh is a value: slicing, flattening and unflattening return new
meshes and change nothing else. Groups live in the world's registry, keyed by their ordered
ranks and backend, and are made by their members only: a mesh's own groups when it is made
(``init_device_mesh``, ``DeviceMesh(...)``), dimension by dimension; the groups of the meshes
made from it (``reshape``, ``flatten``, ``unflatten``; slices reuse their parent's) at their
first use, a collective or ``engine_group`` or ``to_torch()`` (``eager_groups``, below).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import backends as _registry
from ..backends.protocol import MeshView, NativeMesh, NativeMeshes
from ..control.consensus import agree
from ..errors import (
    ArgumentError,
    BackendError,
    NotAMemberError,
    NotATorchMeshError,
    NotInitializedError,
    UnknownDimError,
    bad_argument,
    bad_type,
    format_ranks,
    is_int,
)
from ..geometry.roles import AbstractMesh, Roles, as_dict, dim_roles, merged_role
from ..geometry.spec import MeshSpec
from ..host import env
from ..job.failures import named_failures
from ..job.lifecycle import current_or_adopted_world, current_world
from ..job.world import GroupName, World
from ..process_group import ProcessGroup
from . import args

log = logging.getLogger("tensorplay.distributed")

class DeviceMesh:
    """An n-d array of global ranks; collectives run independently along each dimension.

    ``DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=("dp", "tp"))`` on a world
    of 8; any rectangular array of distinct world ranks works, a subset of the world included.
    Every rank of the world makes the same call (SPMD); ranks outside the mesh get a mesh whose
    get_coordinate() is None.

    A mesh is a frozen value: (world, device type, spec, root spec, per-dim backends, this
    rank's groups), set once and never changed; equal meshes (same device type, ranks, names,
    root and backends) compare and hash equal.
    """

    __slots__ = ("_world", "_device_type", "_spec", "_root", "_backends", "_groups", "_roles",
                 "_eager")
    _world: World
    _device_type: str
    _spec: MeshSpec
    _root: MeshSpec
    _backends: tuple[str, ...]
    _groups: tuple[ProcessGroup, ...]
    _roles: Roles
    _eager: bool  # the meshes made from this one make their groups at once

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        backend_override: Any = None,
    ):
        world = current_or_adopted_world("DeviceMesh()")
        device = args.device_type(device_type)
        shape, ranks = args.explicit_mesh(mesh, world.size)
        names = args.dim_names(mesh_dim_names, len(shape))
        default = _default(world, device)
        backends = args.backend_override(backend_override, names, len(shape), default)
        spec = MeshSpec.from_ranks(shape, ranks, names)
        own, views = eagerness(None)
        agree(world, "DeviceMesh()", {
            "device_type": device, "mesh": ranks, "shape": shape, "mesh_dim_names": names,
            "backend_override": backends, "eager_groups": [own, views],
        })
        world.engine.use_device(device)
        self._set(world, device, spec, spec, backends, _make_groups(world, spec, backends, own),
                  eager=views)

    def _set(self, world: World, device: str, spec: MeshSpec, root: MeshSpec,
             backends: tuple[str, ...], groups: tuple[ProcessGroup, ...],
             roles: Roles | None = None, eager: bool = False) -> None:
        """Fill the fields, once: ``groups`` holds this rank's group per dim, () outside;
        ``roles`` one role (or None) per dim; ``eager``: the meshes made from this one make
        their groups at once (else at first use)."""
        values = (world, device, spec, root, backends, groups,
                  tuple(roles) if roles is not None else (None,) * spec.ndim, eager)
        for name, value in zip(DeviceMesh.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    @classmethod
    def _make(cls, world: World, device: str, spec: MeshSpec, root: MeshSpec,
              backends: tuple[str, ...], groups: tuple[ProcessGroup, ...],
              roles: Roles | None = None, eager: bool = False) -> DeviceMesh:
        mesh = object.__new__(cls)
        mesh._set(world, device, spec, root, backends, groups, roles, eager)
        return mesh

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"DeviceMesh is immutable: cannot set {name!r}; slicing, "
                             "flatten and unflatten return new meshes")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"DeviceMesh is immutable: cannot delete {name!r}")

    if not TYPE_CHECKING:  # hidden from type checkers: a misspelt attribute stays an error
        def __getattr__(self, name: str) -> Any:
            """Only for attributes the mesh lacks. A private name (``_layout``,
            ``_get_root_mesh``, ``_flatten_rank_map``) is torch's DeviceMesh internals read by
            a torch function that was handed our mesh: say so, as an AttributeError, so that
            ``hasattr`` and ``getattr(mesh, name, default)`` answer as usual."""
            cls = type(self)
            if (not name.startswith("_") or name.startswith("__")
                    or any(name in vars(c).get("__slots__", ()) for c in cls.__mro__)):
                raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}",
                                     name=name, obj=self)
            raise _not_torch(f"mesh.{name}", f"read torch's internal {name!r} from it", name)

    # -- what the mesh is -------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda'."""
        return self._device_type

    @property
    def mesh(self):
        """The rank array as an int64 torch tensor (built on demand: O(size)); a numpy array
        in an MPI world, or in a simulated one where torch is not installed."""
        return _registry.rank_array(self._world.engine, self._spec.array())

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._spec.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension."""
        return self._spec.shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """Names of the dimensions, or None."""
        return self._spec.names

    @property
    def mesh_dim_roles(self) -> dict[str, str]:
        """``{dim name: role}`` for the dims that have a role (``init_device_mesh(...,
        mesh_dim_roles=...)``, kept by slices, ``flatten`` and ``reshape``); {} if none."""
        return as_dict(self.mesh_dim_names, self._roles)

    @property
    def abstract(self) -> AbstractMesh:
        """This mesh without its ranks: names, sizes, roles (frozen, hashable). Equal on every
        rank, and for the same shape rebuilt in another world."""
        return AbstractMesh(self.mesh_dim_names, self.shape, self._roles)

    @property
    def spec(self) -> MeshSpec:
        """The pure description of this mesh (layout, rank table, names)."""
        return self._spec

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Ranks in the mesh, or the size of one dimension."""
        if mesh_dim is None:
            return self._spec.size
        return self.shape[self._dim(mesh_dim)]

    # -- where this rank is ---------------------------------------------------------------
    def get_rank(self, coordinate: Sequence[int] | None = None) -> int:
        """This process's global rank, or the global rank at ``coordinate``."""
        self._alive("get_rank()")
        if coordinate is None:
            return self._world.rank
        coord = self._check_coordinate(coordinate)
        return self._spec.rank_at(coord)

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate, None when the mesh does not hold it."""
        self._alive("get_coordinate()")
        coord = self._spec.coordinate_of(self._world.rank)
        return None if coord is None else list(coord)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along ``mesh_dim``: its rank inside that dim's group."""
        dim = self._dim_or_only(mesh_dim, "get_local_rank")
        return self._my_coordinate("get_local_rank()")[dim]

    def shift(self, mesh_dim: int | str | None = None, disp: int = 1,
              periodic: bool = False) -> tuple[int | None, int | None]:
        """(source, dest): the global ranks this rank receives from and sends to when every
        rank passes data ``disp`` steps along ``mesh_dim``, as MPI's ``Cart_shift``; None
        past an open end, wrapped around when ``periodic``. Pure geometry, O(ndim), no
        communication, on every engine.

        On a (2, 4) mesh named ("dp", "tp"), rank 5 = (1, 1): shift("tp") = (4, 6),
        shift("tp", 3) = (None, None), shift("tp", 3, periodic=True) = (6, 4),
        shift("dp") = (1, None). A halo exchange sends to dest and receives from source.
        """
        dim = self._dim_or_only(mesh_dim, "shift")
        if not is_int(disp):
            raise bad_argument("disp", disp, "must be an int number of steps",
                               "pass e.g. disp=1 or disp=-1")
        if not isinstance(periodic, bool):
            raise bad_argument("periodic", periodic, "must be True or False",
                               "pass periodic=True to wrap around the dim")
        self._my_coordinate("shift()")
        return self._spec.shift(self._world.rank, dim, disp, periodic)

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The process group along ``mesh_dim`` through this rank.

        Asked by torch's own code (torch's ``fully_shard`` handed our mesh reads only public
        members, this among them), it raises NotATorchMeshError: our group is no torch group,
        and torch's first collective would otherwise refuse it far from the mistake. One
        frame lookup: ~0.2 us a call on this 2-core machine."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("torch."):
            raise _not_torch("mesh.get_group()", f"asked it for a group ({caller})",
                             "get_group")
        dim = self._dim_or_only(mesh_dim, "get_group")
        self._my_coordinate("get_group()")
        return self._groups[dim]

    def get_all_groups(self) -> list[ProcessGroup]:
        """One process group per dimension, in dimension order."""
        self._my_coordinate("get_all_groups()")
        return list(self._groups)

    # -- elastic meshes (``elastic.mesh.ElasticMesh``) override these --------------------------
    @property
    def epoch(self) -> int:
        """The epoch of an elastic mesh (0 at init_device_mesh, one more at each recover() or
        grow() that changed it); 0 for any other mesh."""
        return 0

    @property
    def fresh_ranks(self) -> list[int]:
        """The ranks that joined an elastic mesh at its epoch and hold no state yet; none
        on any other mesh."""
        return []

    def recover(self, err: BaseException) -> DeviceMesh:
        """Only an elastic mesh recovers (``init_device_mesh(..., elastic='dp')``)."""
        raise _not_elastic(self, "recover()")

    def grow(self) -> DeviceMesh:
        """Only an elastic mesh grows (``init_device_mesh(..., elastic='dp')``)."""
        raise _not_elastic(self, "grow()")

    # -- hosts, reports, pictures -------------------------------------------------------------
    def host_of(self):
        """Which host each world rank runs on: ``mesh.host_of()(5)`` -> 'node1'.

        Posted by every rank at init_process_group and read from the store on first use; a
        fake world is one host (this machine's name).
        """
        self._alive("host_of()")
        return self._world.control.hosts()

    def describe(self, rank: int | None = None, host_of=None) -> str:
        """A text report: shape, rank grid, groups per dim and how many cross hosts, and the
        coordinate and groups of ``rank`` (default this process's rank).

        On a (2, 4) ("dp", "tp") mesh over 2 hosts, rank 5 is at (1, 1), its "tp" group is
        [4, 5, 6, 7] (1 host) and its "dp" group [1, 5] (2 hosts); all 4 "dp" groups cross.
        For this process's rank it ends with the communicators the rank holds in its world,
        the mesh dims that share each, and the dims of this mesh whose group is not made yet.
        """
        from ..geometry.describe import describe

        self._alive("describe()")
        text = describe(self._spec, self._world.rank if rank is None else rank,
                        host_of=self.host_of() if host_of is None else host_of,
                        device_type=self._device_type, backends=self._backends,
                        roles=self._roles if any(self._roles) else None)
        if rank is not None and rank != self._world.rank or not self._groups:
            return text
        return text + "\n\n" + self._communicators()

    def _communicators(self) -> str:
        """describe()'s last section: the communicators this rank holds in its world, which
        mesh dims share each, and this mesh's dims whose group is not made yet."""
        from ..geometry.describe import communicators

        world = self._world
        registry = world.registry
        made = [(g.rank_seq, g.backend, registry.uses(g)) for g in registry.groups()
                if g.is_member and g.made and not g.retired]
        names = self.mesh_dim_names or tuple(str(d) for d in range(self.ndim))
        waiting = [(repr(n), g.rank_seq) for n, g in zip(names, self._groups, strict=True)
                   if not g.made]
        return communicators(world.rank, made, waiting)

    def plot(self, path, dim: int | str | None = None, rank: int | None = None, host_of=None):
        """Draw the mesh to ``path`` (.png or .svg; needs matplotlib): cells coloured by host,
        groups of ``dim`` (default the last) outlined, ``rank`` (default this one) in red."""
        from ..geometry.plot import plot

        self._alive("plot()")
        if rank is None and self._spec.coordinate_of(self._world.rank) is not None:
            rank = self._world.rank
        return plot(self._spec, path, host_of=self.host_of() if host_of is None else host_of,
                    dim=dim, rank=rank)

    # -- new meshes from this one -----------------------------------------------------------
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the named dims through this rank; it reuses this mesh's groups."""
        wanted = args.slice_names(names)
        self._my_coordinate(f"mesh[{names!r}]")
        parts = [self._resolve_name(name) for name in wanted]
        order = [p[0] for p in parts]
        if order != sorted(order):
            in_order = tuple(n for _, n in sorted(zip(order, wanted, strict=True)))
            raise bad_argument("mesh[...]", names, "names are out of mesh order",
                               f"list them in the mesh's order: {in_order}")
        dims = [d for p in parts for d in p]
        if len(set(dims)) != len(dims):
            raise bad_argument("mesh[...]", names, "names overlap (a flattened name covers "
                               "another)", "slice by dims that do not share any dim")
        rank = self._world.rank
        spec = self._spec.select(dims, rank)
        starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
        for part, start in reversed(list(zip(parts, starts, strict=True))):
            if len(part) > 1:
                spec = spec.flatten(None, range(start, start + len(part)))
        backends = tuple(self._backends[part[0]] for part in parts)
        roles = tuple(merged_role([self._roles[d] for d in part]) for part in parts)
        groups: list[ProcessGroup] = []
        for i, (name, part) in enumerate(zip(wanted, parts, strict=True)):
            if len(part) == 1:
                groups.append(self._groups[part[0]])
                continue
            found = self._world.registry.find(spec.line(rank, i), backends[i])
            if found is None:
                raise ArgumentError(f"mesh[{names!r}]: the group of flattened dim {name!r} is "
                                    "missing on this rank. Fix: call flatten() on every rank.")
            groups.append(found)
        spec = MeshSpec(spec.layout, wanted if self.mesh_dim_names else None, spec.table)
        return DeviceMesh._make(self._world, self._device_type, spec, self._root, backends,
                                tuple(groups), roles, self._eager)

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """Merge every dim into one, with one new group (made at its first use, or now with
        eager_groups); name defaults to 'a_b_c'.

        ``mesh["dp", "cp"].flatten()`` makes "dp_cp", which then slices the root mesh too.
        """
        self._alive("flatten()")
        if name is not None and (not isinstance(name, str) or not name):
            raise bad_argument("name", name, "must be a non-empty str", "pass e.g. 'dp_cp'")
        if name is None and self.mesh_dim_names is not None:
            name = "_".join(self.mesh_dim_names)
        root_names = self._root.names or ()
        if name in root_names and (self.ndim > 1 or self.mesh_dim_names != (name,)):
            raise bad_argument("name", name, "is already a dim of the root mesh",
                               "pick a new name")
        world = self._world
        registers = name is not None and self.mesh_dim_names is not None and self.ndim > 1
        registered = None
        if registers:
            assert name is not None  # registers says so
            registered = world.registry.flattened_names(self._root_key()).get(name)
        if registered is not None and registered != self.mesh_dim_names:
            raise bad_argument("name", name, f"already flattens {registered}", "pick a new name")
        agree(world, "flatten()", {"name": name, "shape": self.shape,
                                   "mesh_dim_names": self.mesh_dim_names,
                                   "device_type": self._device_type})
        spec = self._spec.flatten(name)
        backends = (self._backends[0],)
        groups = _make_groups(world, spec, backends, self._eager)
        if registers:
            assert name is not None and self.mesh_dim_names is not None  # registers says so
            world.registry.register_flatten(self._root_key(), name, self.mesh_dim_names)
        return DeviceMesh._make(world, self._device_type, spec, self._root, backends, groups,
                                (merged_role(self._roles),), self._eager)

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """PyTorch's spelling of flatten()."""
        return self.flatten(mesh_dim_name)

    def reshape(self, shape: Sequence[int], mesh_dim_names: Sequence[str] | None = None, *,
                shared: Sequence[str] = (), mesh_dim_roles: Any = None) -> DeviceMesh:
        """A view of the same ranks in a new shape, row-major (as numpy's
        ``mesh.mesh.reshape(shape)``), one -1 inferred; every rank calls it (SPMD).

        The view belongs to this mesh's root (slices, ``flatten``, ``describe``, ``to_torch``
        work on it). A view dim whose groups equal a dim of this mesh (same ordered ranks)
        takes that dim's backend and so reuses its groups from the world's registry; only new
        groups are made, at their first use (now with eager_groups). ``shared`` names dims
        (present in both) that must have the same groups, checked geometrically (no
        communication); a view dim keeps the role of the dim of its name when their groups
        agree, and ``mesh_dim_roles`` sets others.

        The MoE expert view of a (pp, dp_replicate, dp_shard, cp, tp) mesh of 128 ranks:
        ``dense.reshape((2, 2, -1, 8), ("pp", "dp_replicate", "efsdp", "ep"),
        shared=("pp", "dp_replicate"))``: its "ep" groups are the flattened cp x tp groups.
        """
        self._alive("reshape()")
        sizes = _reshape_sizes(shape, self)
        names = args.dim_names(mesh_dim_names, len(sizes))
        if names is None and self.mesh_dim_names is not None:
            raise bad_argument("mesh_dim_names", mesh_dim_names, "is required to reshape a "
                               "mesh with dim names", f"give {len(sizes)} names")
        wanted = _shared_names(shared, self.mesh_dim_names, names)
        roles_given = dim_roles(mesh_dim_roles, names, len(sizes))
        spec = self._spec.reshape(sizes, names)
        mine = self.mesh_dim_names or ()
        match: list[int | None] = []  # for each view dim, a dim of this mesh with its groups
        for b in range(spec.ndim):
            named = [mine.index(names[b])] if names and names[b] in mine else []
            match.append(next((a for a in [*named, *range(self.ndim)]
                               if self._spec.same_lines(a, spec, b)), None))
        for name in wanted:
            a, b = mine.index(name), names.index(name)  # type: ignore[union-attr]
            if match[b] != a and not self._spec.same_lines(a, spec, b):
                raise ArgumentError(f"reshape(): shared={tuple(shared)!r}: "
                                    + _differs(self, a, spec, b, name) + ". Fix: share only "
                                    "dims whose groups the reshape keeps (the dims outside "
                                    "the ones it splits or merges), or drop it from shared.")
        roles = list(roles_given or (None,) * spec.ndim)
        for b, kept in enumerate(match):  # a dim kept as it was (same name, same groups)
            if (roles[b] is None and kept is not None and names and mine
                    and mine[kept] == names[b]):
                roles[b] = self._roles[kept]
        common = set(self._backends)
        other = self._backends[0] if len(common) == 1 else _default(self._world,
                                                                       self._device_type)
        backends = tuple(other if a is None else self._backends[a] for a in match)
        agree(self._world, "reshape()", {
            "shape": sizes, "mesh_dim_names": names, "shared": wanted, "mesh_dim_roles": roles,
            "of": [self.shape, self.mesh_dim_names], "device_type": self._device_type})
        groups = _make_groups(self._world, spec, backends, self._eager)
        return DeviceMesh._make(self._world, self._device_type, spec, self._root, backends,
                                groups, tuple(roles), self._eager)

    def unflatten(
        self, dim: int | str, sizes: Sequence[int], names: Sequence[str] | None = None
    ) -> DeviceMesh:
        """Split ``dim`` into dims of ``sizes``; only the new groups are created (at their
        first use, or now with eager_groups).

        On a 1-d mesh "dp" of 8, unflatten("dp", (2, 4), ("replicate", "shard")) gives a
        (2, 4) mesh whose "shard" group through rank 5 is [4, 5, 6, 7].
        """
        self._alive("unflatten()")
        d = args.mesh_dim(dim, self.mesh_dim_names, self.ndim, "dim")
        new_sizes = args.positive_sizes(sizes, self.shape[d])
        if self.mesh_dim_names is None and names is not None and self.ndim > 1:
            raise bad_argument("names", names, "cannot name dims of a mesh without dim names",
                               "pass names=None, or build the mesh with mesh_dim_names")
        if self.mesh_dim_names is not None or names is not None:
            new_names = args.dim_names(names, len(new_sizes), "names")
            if new_names is None:
                raise bad_argument("names", names, "is required on a named mesh",
                                   f"give {len(new_sizes)} names")
            others = [n for i, n in enumerate(self.mesh_dim_names or ()) if i != d]
            clash = [n for n in new_names if n in others]
            if clash:
                raise bad_argument("names", names, f"{clash[0]!r} is already a dim",
                                   "pick new names")
        else:
            new_names = None
        spec = self._spec.unflatten(d, new_sizes, new_names)
        agree(self._world, "unflatten()", {"dim": d, "sizes": new_sizes, "names": new_names,
                                           "shape": self.shape, "device_type": self._device_type})
        backends = self._backends[:d] + (self._backends[d],) * len(new_sizes) + \
            self._backends[d + 1:]
        groups = _make_groups(self._world, spec, backends, self._eager)
        roles = self._roles[:d] + (None,) * len(new_sizes) + self._roles[d + 1:]
        return DeviceMesh._make(self._world, self._device_type, spec, spec, backends, groups,
                                roles, self._eager)

    @classmethod
    def from_group(
        cls,
        group: Any,
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """Wrap existing groups (one per dim) in a mesh without creating any group."""
        world = current_world("DeviceMesh.from_group()")
        device = args.device_type(device_type)
        groups = list(group) if isinstance(group, list | tuple) else [group]
        if not groups:
            raise bad_argument("group", group, "is empty", "pass one group per dim")
        ours = [_as_our_group(world, g, i) for i, g in enumerate(groups)]
        if mesh is None:
            if len(ours) != 1:
                raise bad_argument("mesh", None, "is required with several groups",
                                   "pass the rank array the groups come from")
            mesh = ours[0].ranks
        shape, ranks = args.explicit_mesh(mesh, world.size)
        if len(shape) != len(ours):
            raise bad_argument("group", group, f"gives {len(ours)} groups for a "
                               f"{len(shape)}-d mesh", "pass one group per dim")
        names = args.dim_names(mesh_dim_names, len(shape))
        spec = MeshSpec.from_ranks(shape, ranks, names)
        if spec.coordinate_of(world.rank) is not None:
            _check_lines(world, spec, ours)
        backends = tuple(g.backend for g in ours)
        held = tuple(ours) if spec.coordinate_of(world.rank) is not None else ()
        return cls._make(world, device, spec, spec, backends, held)

    # -- the engine's own mesh (torch's DeviceMesh) --------------------------------------------
    def to_torch(self) -> Any:
        """This mesh as torch's DeviceMesh, for DTensor, tensor parallelism and FSDP2.

        It runs on this mesh's own groups and creates no other; those still waiting for
        their first use (a view's, a flatten's) are made now, with its root's and the root's
        registered flattens, by every rank at this same call (torch's mesh holds engine
        groups). Equal meshes give the same object (made once per world). A slice or flatten
        gives the matching slice of its root's torch mesh, so both come from one root, as
        FSDP2 with TP requires: on a (2, 4) ("dp", "tp") mesh, ``mesh["tp"].to_torch() ==
        mesh.to_torch()["tp"]``, and on rank 5 its group is
        ``mesh.get_group("tp").engine_group`` ([4, 5, 6, 7]). Outside a subset mesh it is
        torch's mesh without groups (get_coordinate() None), as torch's own is there.
        Flattened names of the root ("dp_cp") are known to the torch root too. Raises
        BackendError in a simulated world, or when the installed torch lacks what it needs.
        """
        self._alive("to_torch()")
        _native_meshes(self._world, adopting=False)  # before any group is made
        if self._spec == self._root and self._groups:  # flattens made since this was built
            root_names = self.mesh_dim_names or ()
            for name, merged in self._world.registry.flattened_names(self._root_key()).items():
                if all(n in root_names for n in merged):  # not a flatten of a reshape's dims
                    self[name]._native()
        return self._native()

    def _native(self) -> Any:
        return self._world.registry.native_mesh(self._native_key(), self._build_native)

    def _build_native(self) -> Any:
        """The engine's mesh over this mesh's groups: a root from its rank array, any other
        mesh as dims of its root's (built first)."""
        world, groups = self._world, tuple(g.engine_group for g in self._groups)
        engine = _native_meshes(world, adopting=False)
        if self._spec == self._root:
            view = MeshView(self._device_type, self.mesh_dim_names, groups,
                            ranks=self._spec.array())
            return engine.to_native_mesh(view, None)
        anchor = world.rank if self._groups else self._spec.rank_at((0,) * self.ndim)
        try:
            dims = self._spec.root_dims(self._root, anchor)
        except ValueError:  # a reshape whose dims cut root dims: torch's mesh of its own ranks
            view = MeshView(self._device_type, self.mesh_dim_names, groups,
                            ranks=self._spec.array())
            return engine.to_native_mesh(view, None)
        root = self._root_on_groups(dims)
        names, flatten_of = self.mesh_dim_names, None
        if names and len(dims) == 1:  # a flatten the root answers to, by this name?
            merged = self._flattened_dims(names[0])
            if merged is not None and dims[0] == tuple(
                    i for i in merged if self._root.shape[i] > 1):
                flatten_of = names[0]
        view = MeshView(self._device_type, names, groups, root_dims=dims, flatten_of=flatten_of)
        return engine.to_native_mesh(view, root._native())

    def _flattened_dims(self, name: str) -> tuple[int, ...] | None:
        """The root dims that ``name`` flattens in the world's registry, None if none."""
        merged = self._world.registry.flattened_names(self._root_key()).get(name)
        root_names = self._root.names or ()
        if merged is None or any(n not in root_names for n in merged):
            return None
        return tuple(root_names.index(n) for n in merged)

    def _root_on_groups(self, dims: tuple[tuple[int, ...], ...]) -> DeviceMesh:
        """The root this mesh was sliced or flattened from, on its groups in the world's
        registry: the backend of a dim this mesh keeps is this mesh's, the default elsewhere."""
        backends = [_default(self._world, self._device_type)] * self._root.ndim
        for d, covered in enumerate(dims):
            if len(covered) == 1:
                backends[covered[0]] = self._backends[d]
        groups = _make_groups(self._world, self._root, backends)
        return DeviceMesh._make(self._world, self._device_type, self._root, self._root,
                                tuple(backends), groups)

    @classmethod
    def from_torch(cls, torch_mesh: Any) -> DeviceMesh:
        """Adopt torch's DeviceMesh (one a library made) as our mesh, creating no group.

        Its groups join this world's registry and ``mesh.to_torch()`` gives ``torch_mesh``
        back. A slice of a torch root by its dim names becomes that slice of the adopted root:
        ``from_torch(tm["tp"]) == from_torch(tm)["tp"]``. Any other torch mesh (flattened or
        unflattened by torch) becomes a root of its own. Its groups must keep the mesh's rank
        order (torch's new_group sorts ranks, so a permuted torch mesh is refused).
        """
        world = current_world("DeviceMesh.from_torch()")
        found = _native_meshes(world, adopting=True).mesh_from_native(torch_mesh)
        if found is None:
            raise bad_type("torch_mesh", torch_mesh, f"a {world.engine.name} DeviceMesh",
                           "pass the DeviceMesh a library built, e.g. its init_device_mesh()")
        root = found.root or found
        mesh = _adopt(world, root, "DeviceMesh.from_torch()")
        # to_torch() gives the library's mesh back
        world.registry.native_mesh(mesh._native_key(), lambda: root.obj)
        if found.root is not None:
            assert found.names is not None  # a slice of a root is named by the root's dims
            mesh = mesh[found.names]
            world.registry.native_mesh(mesh._native_key(), lambda: found.obj)
        return mesh

    # -- value semantics ---------------------------------------------------------------------
    def _key(self) -> tuple:
        return (*self._native_key(), self._roles)

    def _native_key(self) -> tuple:
        """What the engine's mesh depends on (not the roles): one torch mesh per geometry."""
        return (self._device_type, self._spec, self._root, self._backends, self.epoch)

    def _root_key(self) -> tuple:
        return (self._device_type, self._root)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        dims = ", ".join(
            f"{name}={size}" for name, size in zip(self.mesh_dim_names or
                                                   [str(i) for i in range(self.ndim)],
                                                   self.shape, strict=True)
        )
        if self.size() <= 64:
            body = f"mesh={self._spec.array().tolist()}"
        else:
            body = f"ranks={self._spec.ranks()!r}"
        epoch = f", epoch {self.epoch}" if self.epoch else ""
        return f"DeviceMesh({self._device_type!r}, {dims}; {body}{epoch})"

    def __reduce__(self):
        return _unpickle, (self._device_type, self._spec, self._root, self._backends,
                           self._roles, self._eager)

    # -- helpers ---------------------------------------------------------------------------------
    def _alive(self, what: str) -> None:
        if not self._world.alive:
            raise NotInitializedError(f"{what}: this mesh belongs to a destroyed world. Fix: "
                                      "build a new mesh after init_process_group().")

    def _dim(self, mesh_dim: int | str) -> int:
        return args.mesh_dim(mesh_dim, self.mesh_dim_names, self.ndim)

    def _dim_or_only(self, mesh_dim: int | str | None, what: str) -> int:
        self._alive(f"{what}()")
        if mesh_dim is None:
            if self.ndim != 1:
                raise bad_argument(
                    "mesh_dim", None, f"is required on a {self.ndim}-d mesh",
                    f"pass an index 0..{self.ndim - 1}"
                    + (f" or a name in {self.mesh_dim_names}" if self.mesh_dim_names else ""),
                )
            return 0
        return self._dim(mesh_dim)

    def _my_coordinate(self, what: str) -> tuple[int, ...]:
        self._alive(what)
        coord = self._spec.coordinate_of(self._world.rank)
        if coord is None or not self._groups:
            raise NotAMemberError(
                f"{what}: rank {self._world.rank} is not in this mesh. Fix: call it only on "
                f"ranks for which get_coordinate() is not None."
            )
        return coord

    def _check_coordinate(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        if isinstance(coordinate, str) or not isinstance(coordinate, Sequence):
            raise bad_argument("coordinate", coordinate, "must be a sequence of ints",
                               f"pass {self.ndim} ints")
        coord = tuple(coordinate)
        if len(coord) != self.ndim or any(
            not is_int(c) or not 0 <= c < s
            for c, s in zip(coord, self.shape, strict=False)
        ):
            raise bad_argument("coordinate", coordinate, f"is not a coordinate of shape "
                               f"{self.shape}", f"pass {self.ndim} ints within the shape")
        return coord

    def _resolve_name(self, name: str) -> tuple[int, ...]:
        """Own dims that ``name`` denotes: one dim, or the dims a flattened name merged."""
        names = self.mesh_dim_names or ()
        if name in names:
            return (names.index(name),)
        flattened = self._world.registry.flattened_names(self._root_key())
        merged = flattened.get(name)
        if merged is not None and all(n in names for n in merged):
            return tuple(names.index(n) for n in merged)
        # a flattened name slices only meshes that hold its dims (not the root, for a flatten
        # of a view's dims; not a slice that lacks one of them)
        known = list(names) + [f for f, dims in flattened.items() if all(n in names for n in dims)]
        raise bad_argument("mesh[...]", name, "is not a dim name of this mesh",
                           f"use one of {tuple(known)}" if known else
                           "this mesh has no dim names; build it with mesh_dim_names=... "
                           "to slice it", kind=UnknownDimError)


def _native_meshes(world: World, adopting: bool) -> NativeMeshes:
    """The world's engine, which has mesh objects of its own (torch's DeviceMesh); else the
    BackendError of ``to_torch()`` (``from_torch()`` when ``adopting``) naming the engine."""
    engine = world.engine
    if isinstance(engine, NativeMeshes):
        return engine
    name, simulated = engine.name, engine.capabilities.simulated
    which = f"a simulated ({name!r}) world" if simulated else f"{_article(name)} {name} world"
    if adopting:
        raise BackendError(
            f"DeviceMesh.from_torch(): {which} cannot adopt torch_mesh: its groups belong to "
            + ("a real torch world. Fix: call init_process_group('gloo') (or nccl) and adopt "
               "torch meshes built in that world." if simulated else
               "torch.distributed. Fix: adopt torch meshes in a gloo or nccl world."))
    raise BackendError(
        f"to_torch(): {which} has no torch process groups to build torch's DeviceMesh on. "
        "Fix: run on gloo or nccl "
        + (f"(e.g. tensorplay-run --nproc-per-node 8) to use DTensor, tensor parallelism or "
           f"FSDP2; a {name} world plans and checks meshes only." if simulated else
           "(tensorplay-run or torchrun, init_process_group('gloo')) to use DTensor, tensor "
           "parallelism or FSDP2."))


def _article(name: str) -> str:
    """'an' before an engine name read letter by letter that sounds a vowel first ("an mpi
    world"), else 'a'."""
    return "an" if name[:1] in "aefhilmnorsx" else "a"


def _default(world: World, device: str) -> str:
    """A mesh's default backend: the world's, or what its engine runs ``device`` on (gloo
    for a 'cpu' mesh on an nccl world)."""
    return world.engine.backend_for_device(device, world.backend)


def eagerness(given: object) -> tuple[bool, bool]:
    """``init_device_mesh(..., eager_groups=given)`` -> (make the mesh's own groups now, make
    the groups of the meshes made from it when they are made): True -> (True, True), False ->
    (False, False), None -> ``TENSORPLAY_EAGER_GROUPS`` (1, 0), else (True, False): a mesh's
    own groups at init, as torch's init_device_mesh; its views' at first use."""
    if given is None:
        given = env.eager_groups_from_env()
    if given is None:
        return True, False
    if not isinstance(given, bool):
        raise bad_type("eager_groups", given, "bool or None",
                       "pass eager_groups=True to make every group when its mesh is made")
    return given, given


def _make_groups(world: World, spec: MeshSpec, backends: Sequence[str], make: bool = True,
                 within: timedelta | None = None) -> tuple[ProcessGroup, ...]:
    """This rank's group along each dim, in dim order; () when the mesh does not hold it.
    ``make``: engine groups not made yet are made now, in dim order (each ``within`` that
    long, if given: ``World.group``); else each at its first use (a collective,
    ``engine_group``), by its members.

    A group's errors name it by its dim: "the 'dp' group [1, 5]"; a group this call creates
    is described to the engine as torch describes its own meshes' groups: "mesh_dp" ("mesh_dp_cp"
    for a flatten, "mesh_dim_1" for an unnamed dim).
    """
    if spec.coordinate_of(world.rank) is None:
        return ()
    groups = []
    of = "(" + ", ".join(spec.names) + ")" if spec.names else f"a {spec.shape} mesh"
    for d in range(spec.ndim):
        name = spec.names[d] if spec.names else str(d)
        desc = f"mesh_{spec.names[d]}" if spec.names else f"mesh_dim_{d}"
        line = spec.line(world.rank, d)
        use = f"{name!r} of {of}" if spec.names else f"dim {d} of {of}"
        # repr(line) costs O(1) (a long group shows as its ends and size): this runs per dim
        with named_failures(world, f"creating the group of mesh dim {name!r} ({line!r})"):
            groups.append(world.group(line, backends[d], GroupName(repr(name), desc, use),
                                      make=make, within=within))
    return tuple(groups)


def _reshape_sizes(shape: object, mesh: DeviceMesh) -> tuple[int, ...]:
    """reshape()'s sizes: one -1 inferred, the product the mesh's size; a size that does not
    fit names the mesh's dims and sizes."""
    total = mesh.size()
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    have = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    if isinstance(shape, Sequence) and not isinstance(shape, str) and all(
            is_int(v) for v in shape):
        known = [int(v) for v in shape if v != -1]
        product = math.prod(known)
        if all(v >= 1 for v in known) and list(shape).count(-1) <= 1 and (
                total % product if -1 in shape else product != total):
            words = " x ".join(str(v) for v in known) + (f" = {product}" if len(known) > 1
                                                          else "")
            problem = (f"the sizes {words} do not divide" if -1 in shape else
                       f"the sizes {words} hold {product} ranks, not") + \
                f" the mesh's {total} ranks ({have})"
            raise bad_argument("shape", shape, problem,
                               "choose sizes whose product is the mesh's size (one -1 is "
                               "inferred): split or merge its dims, e.g. "
                               f"{_example(mesh.shape)}")
    return args.positive_sizes(shape, total, "shape")


def _example(shape: tuple[int, ...]) -> str:
    """A valid reshape of ``shape``: its last two dims merged, -1 first."""
    if len(shape) < 2:
        return f"({shape[0]},)" if shape else "()"
    return str((-1, *shape[1:-2], shape[-2] * shape[-1])) if len(shape) > 2 else \
        str((-1, shape[0] * shape[1]))


def _shared_names(shared: object, mine: tuple[str, ...] | None,
                  view: tuple[str, ...] | None) -> tuple[str, ...]:
    """reshape()'s ``shared``: distinct dim names present in both meshes."""
    if isinstance(shared, str) or not isinstance(shared, Sequence):
        raise bad_type("shared", shared, "tuple of dim names", "pass e.g. shared=('pp',)")
    names = tuple(shared)
    for name in names:
        if not isinstance(name, str):
            raise bad_type("shared", shared, "tuple of str", "name dims with strings")
        if name not in (mine or ()) or name not in (view or ()):
            where = "this mesh" if name not in (mine or ()) else "the view"
            both = [n for n in (mine or ()) if n in (view or ())]
            raise bad_argument("shared", shared, f"names {name!r}, which is not a dim of "
                               f"{where}", f"share dims named in both meshes: {tuple(both)}",
                               kind=UnknownDimError)
    if len(set(names)) != len(names):
        raise bad_argument("shared", shared, "repeats a name", "name each dim once")
    return names


def _differs(mesh: DeviceMesh, a: int, view: MeshSpec, b: int, name: str) -> str:
    """'dim 'pp': rank 5's group is [...] in the view but [...] in the mesh', for this rank
    when it is in the mesh and its groups differ, else the first rank whose groups differ."""
    me = mesh._world.rank
    ranks = [me] if mesh.spec.coordinate_of(me) is not None else []
    for rank in [*ranks, *mesh.spec.ranks()]:
        mine, theirs = mesh.spec.line(rank, a), view.line(rank, b)
        if mine != theirs:
            return (f"dim {name!r}: rank {rank}'s group is {_ranks_text(theirs)} "
                    f"in the view but {_ranks_text(mine)} in the mesh")
    return f"dim {name!r}: the groups differ"


def _ranks_text(ranks) -> str:
    """[1, 5]; a group over 16 ranks in runs: [0-63, 128-191, ... (N in all)]."""
    return str(ranks.tolist()) if len(ranks) <= 16 else f"[{format_ranks(ranks)}]"


def _as_our_group(world: World, group: Any, index: int) -> ProcessGroup:
    if isinstance(group, ProcessGroup):
        return group
    adopted = world.adopt(group)
    if adopted is None:
        raise bad_argument(f"group[{index}]", group, "is not a process group",
                           f"pass tensorplay or {world.engine.name} process groups")
    return adopted


def _adopt(world: World, found: NativeMesh, what: str) -> DeviceMesh:
    """Our root mesh over an engine mesh's rank array and groups (adopted, none created)."""
    if found.ranks is None:
        raise NotAMemberError(f"{what}: rank {world.rank} is not in torch_mesh, so its ranks "
                              "are unknown here. Fix: adopt its root mesh on this rank.")
    device = args.device_type(found.device_type)
    shape, ranks = args.explicit_mesh(found.ranks, world.size)
    spec = MeshSpec.from_ranks(shape, ranks, args.dim_names(found.names, len(shape)))
    ours = tuple(_as_our_group(world, g, i) for i, g in enumerate(found.groups))
    if ours:  # an engine that sorts a group's ranks (torch's new_group) breaks mesh order
        _check_lines(world, spec, ours, "torch_mesh.get_group({d})",
                     "its groups must list ranks in mesh order; build the mesh with "
                     "tensorplay (DeviceMesh(device_type, ranks).to_torch()) to keep it")
    backends = tuple(g.backend for g in ours) or (_default(world, device),) * spec.ndim
    return DeviceMesh._make(world, device, spec, spec, backends, ours)


def _check_lines(world: World, spec: MeshSpec, groups: Sequence[ProcessGroup],
                 arg: str = "group[{d}]",
                 fix: str = "pass the groups in dim order, each matching the mesh") -> None:
    """Each group must be the mesh's line through this rank along its dim, in mesh order."""
    for d, g in enumerate(groups):
        if spec.line(world.rank, d) != g.rank_seq:
            raise bad_argument(
                arg.format(d=d), g.ranks, f"is not the mesh line through rank {world.rank} "
                f"along dim {d} ({spec.line(world.rank, d).tolist()})", fix)


def _unpickle(device: str, spec: MeshSpec, root: MeshSpec, backends: tuple[str, ...],
              roles: Roles | None = None, eager: bool = False):
    """Rebuild a pickled mesh in the current world, reusing its groups, or registering them
    to be made at first use (at once when its mesh made its views' groups so)."""
    world = current_world("unpickling a DeviceMesh")
    return DeviceMesh._make(world, device, spec, root, backends,
                            _make_groups(world, spec, backends, eager), roles, eager)


def _laid_out(world: World, device: str, shape: tuple[int, ...], names: tuple[str, ...] | None,
              host_aware: bool) -> MeshSpec:
    """The spec of an ``init_device_mesh`` mesh (row-major, or host-aware), once the engine
    picked this process's device; rank 0 logs advice when a dim's groups cross hosts."""
    world.engine.use_device(device)
    spec = MeshSpec.row_major(shape, names)
    if host_aware:  # every rank reads the full host list (O(world size) each)
        from ..geometry import topology

        order = topology.host_aware_order(shape, world.control.hosts())
        if order is not None:
            spec = MeshSpec.from_ranks(shape, order, names)
    elif world.rank == 0 and (hosts := world.control.known_hosts()) is not None:  # rank 0 holds it
        from ..geometry import topology

        if spec.size <= topology.CROSSING_LIMIT:
            hint = topology.advice(spec, hosts)
            if hint is not None:
                log.warning("init_device_mesh%s: %s", shape, hint)
    return spec


def _not_elastic(mesh: DeviceMesh, what: str) -> ArgumentError:
    return bad_argument("mesh", mesh, f"is not elastic, so {what} cannot change it",
                        "make it with init_device_mesh(..., elastic='dp') (its replica "
                        "dim), and call it on that mesh, not on a slice of it")


def _not_torch(what: str, did: str, name: str) -> NotATorchMeshError:
    """The error for a torch function that was handed our mesh and ``did`` something only
    torch's DeviceMesh can answer."""
    return NotATorchMeshError(
        f"{what}: this is tensorplay's DeviceMesh, not torch's; a torch function {did}. Fix: "
        "pass mesh.to_torch() to torch functions (torch's DeviceMesh on the same groups), or "
        "call the versions that take our mesh: tensorplay.distributed.fsdp.fully_shard, "
        "tensorplay.distributed.tensor (distribute_tensor, DTensor.from_local) and "
        "tensorplay.distributed.tensor.parallel (parallelize_module).", name=name)
