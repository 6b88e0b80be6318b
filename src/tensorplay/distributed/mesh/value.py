"""DeviceMesh, the value: an n-d array of global ranks with one process group per dimension.

The public module is ``device_mesh`` (``init_device_mesh``, ``sync_replicas``, this class);
the elastic layer (``elastic.mesh.ElasticMesh``) subclasses it. Here: the value (made once of
its ``MeshParts``, frozen, compared and pickled by value), its queries and neighbour query
``shift``, ``get_group``, reports and pictures; its views (slices, ``flatten``,
``unflatten``, ``reshape``) are computed in ``mesh/views.py``, its groups made in
``mesh/groups.py``, its torch conversion in ``mesh/native.py``.

On a (2, 4) mesh named ("dp", "tp"), rank 5 is at (1, 1); its "tp" group is [4, 5, 6, 7] and
its "dp" group is [1, 5]. A mesh is a value: slicing, flattening and unflattening return new
meshes and change nothing else. Groups live in the world's registry, keyed by their ordered
ranks and backend, and are made by their members only: a mesh's own groups when it is made
(``init_device_mesh``, ``DeviceMesh(...)``), dimension by dimension; the groups of the meshes
made from it (``reshape``, ``flatten``, ``unflatten``; slices reuse their parent's) at their
first use, a collective or ``engine_group`` or ``to_torch()`` (``eager_groups``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .. import backends as _registry
from ..control.consensus import agree
from ..errors import ArgumentError, bad_argument, is_int
from ..geometry.roles import AbstractMesh, Roles, as_dict
from ..geometry.spec import MeshSpec
from ..job import progress
from ..job.lifecycle import current_or_adopted_world, current_world
from ..process_group import ProcessGroup
from . import args, groups, native, views
from .parts import MeshParts

_Mesh = TypeVar("_Mesh", bound="DeviceMesh")


class DeviceMesh:
    """An n-d array of global ranks; collectives run independently along each dimension.

    ``DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=("dp", "tp"))`` on a world
    of 8; any rectangular array of distinct world ranks works, a subset of the world included.
    Every rank of the world makes the same call (SPMD); ranks outside the mesh get a mesh whose
    get_coordinate() is None.

    A mesh is a frozen value made of its ``parts`` (world, device type, spec, root spec,
    per-dim backends, this rank's groups, roles), set once and never changed; equal meshes
    (same device type, ranks, names, root, backends and roles) compare and hash equal.
    """

    __slots__ = ("_parts",)
    _parts: MeshParts

    @progress.entry("DeviceMesh()")
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
        backends = args.backend_override(backend_override, names, len(shape),
                                         groups.mesh_backend(world, device))
        spec = MeshSpec.from_ranks(shape, ranks, names)
        own, views_too = groups.eagerness(None)
        agree(world, "DeviceMesh()", {
            "device_type": device, "mesh": ranks, "shape": shape, "mesh_dim_names": names,
            "backend_override": backends, "eager_groups": [own, views_too],
        })
        world.engine.use_device(device)
        self._fill(MeshParts(world, device, spec, spec, backends,
                             groups.make_groups(world, spec, backends, own),
                             (None,) * spec.ndim, views_too))

    # -- the layers' interface: what a mesh is made of, and a mesh made of it ---------------
    @classmethod
    def of(cls: type[_Mesh], parts: MeshParts) -> _Mesh:
        """The mesh made of ``parts``, with no cross-rank check and no group made: how the
        package makes a mesh whose parts it computed (views, adoption, ``init_device_mesh``,
        unpickling, the elastic layer's epochs, each with its own parts)."""
        mesh = object.__new__(cls)
        mesh._fill(parts)
        return mesh

    def _fill(self, parts: MeshParts) -> None:
        object.__setattr__(self, "_parts", parts)  # the one write: a mesh is frozen after it

    @property
    def parts(self) -> MeshParts:
        """What this mesh is made of (``mesh/parts.py``): for the package's layers over the
        mesh (views, torch conversion, the elastic layer); user code reads the properties."""
        return self._parts

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
            raise native.not_torch(f"mesh.{name}", f"read torch's internal {name!r} from it",
                                   name)

    # -- what the mesh is -------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda'."""
        return self._parts.device

    @property
    def mesh(self):
        """The rank array as an int64 torch tensor (built on demand: O(size)); a numpy array
        in an MPI world, or in a simulated one where torch is not installed."""
        return _registry.rank_array(self._parts.world.engine, self._parts.spec.array())

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._parts.spec.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension."""
        return self._parts.spec.shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """Names of the dimensions, or None."""
        return self._parts.spec.names

    @property
    def mesh_dim_roles(self) -> dict[str, str]:
        """``{dim name: role}`` for the dims that have a role (``init_device_mesh(...,
        mesh_dim_roles=...)``, kept by slices, ``flatten`` and ``reshape``); {} if none."""
        return as_dict(self.mesh_dim_names, self._parts.roles)

    @property
    def abstract(self) -> AbstractMesh:
        """This mesh without its ranks: names, sizes, roles (frozen, hashable). Equal on every
        rank, and for the same shape rebuilt in another world."""
        return AbstractMesh(self.mesh_dim_names, self.shape, self._parts.roles)

    @property
    def spec(self) -> MeshSpec:
        """The pure description of this mesh (layout, rank table, names)."""
        return self._parts.spec

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Ranks in the mesh, or the size of one dimension."""
        if mesh_dim is None:
            return self._parts.spec.size
        return self.shape[self._dim(mesh_dim)]

    # -- where this rank is ---------------------------------------------------------------
    def get_rank(self, coordinate: Sequence[int] | None = None) -> int:
        """This process's global rank, or the global rank at ``coordinate``."""
        self._parts.alive("get_rank()")
        if coordinate is None:
            return self._parts.world.rank
        return self._parts.spec.rank_at(self._check_coordinate(coordinate))

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate, None when the mesh does not hold it."""
        self._parts.alive("get_coordinate()")
        coord = self._parts.spec.coordinate_of(self._parts.world.rank)
        return None if coord is None else list(coord)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along ``mesh_dim``: its rank inside that dim's group."""
        dim = self._dim_or_only(mesh_dim, "get_local_rank")
        return self._parts.coordinate("get_local_rank()")[dim]

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
        self._parts.coordinate("shift()")
        return self._parts.spec.shift(self._parts.world.rank, dim, disp, periodic)

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The process group along ``mesh_dim`` through this rank.

        Asked by torch's own code (torch's ``fully_shard`` handed our mesh reads only public
        members, this among them), it raises NotATorchMeshError: our group is no torch group,
        and torch's first collective would otherwise refuse it far from the mistake. One
        frame lookup: ~0.2 us a call on this 2-core machine."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("torch."):
            raise native.not_torch("mesh.get_group()", f"asked it for a group ({caller})",
                                   "get_group")
        dim = self._dim_or_only(mesh_dim, "get_group")
        self._parts.coordinate("get_group()")
        return self._parts.groups[dim]

    def get_all_groups(self) -> list[ProcessGroup]:
        """One process group per dimension, in dimension order."""
        self._parts.coordinate("get_all_groups()")
        return list(self._parts.groups)

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
        raise not_elastic(self, "recover()")

    def grow(self) -> DeviceMesh:
        """Only an elastic mesh grows (``init_device_mesh(..., elastic='dp')``)."""
        raise not_elastic(self, "grow()")

    # -- hosts, reports, pictures -------------------------------------------------------------
    def host_of(self):
        """Which host each world rank runs on: ``mesh.host_of()(5)`` -> 'node1'.

        Posted by every rank at init_process_group and read from the store on first use; a
        fake world is one host (this machine's name).
        """
        self._parts.alive("host_of()")
        return self._parts.world.control.hosts()

    def describe(self, rank: int | None = None, host_of=None) -> str:
        """A text report: shape, rank grid, groups per dim and how many cross hosts, and the
        coordinate and groups of ``rank`` (default this process's rank).

        On a (2, 4) ("dp", "tp") mesh over 2 hosts, rank 5 is at (1, 1), its "tp" group is
        [4, 5, 6, 7] (1 host) and its "dp" group [1, 5] (2 hosts); all 4 "dp" groups cross.
        For this process's rank it ends with the communicators the rank holds in its world,
        the mesh dims that share each, and the dims of this mesh whose group is not made yet.
        """
        from ..geometry.describe import describe

        parts = self._parts
        parts.alive("describe()")
        me = parts.world.rank
        text = describe(parts.spec, me if rank is None else rank,
                        host_of=self.host_of() if host_of is None else host_of,
                        device_type=parts.device, backends=parts.backends,
                        roles=parts.roles if any(parts.roles) else None)
        if rank is not None and rank != me or not parts.groups:
            return text
        return text + "\n\n" + self._communicators()

    def _communicators(self) -> str:
        """describe()'s last section: the communicators this rank holds in its world, which
        mesh dims share each, and this mesh's dims whose group is not made yet."""
        from ..geometry.describe import communicators

        world = self._parts.world
        made = [(g.rank_seq, g.backend, world.registry.uses(g)) for g in world.registry.groups()
                if g.is_member and g.made and not g.retired]
        names = self.mesh_dim_names or tuple(str(d) for d in range(self.ndim))
        waiting = [(repr(n), g.rank_seq) for n, g in zip(names, self._parts.groups, strict=True)
                   if not g.made]
        return communicators(world.rank, made, waiting)

    def plot(self, path, dim: int | str | None = None, rank: int | None = None, host_of=None):
        """Draw the mesh to ``path`` (.png or .svg; needs matplotlib): cells coloured by host,
        groups of ``dim`` (default the last) outlined, ``rank`` (default this one) in red."""
        from ..geometry.plot import plot

        parts = self._parts
        parts.alive("plot()")
        if rank is None and parts.spec.coordinate_of(parts.world.rank) is not None:
            rank = parts.world.rank
        return plot(parts.spec, path, host_of=self.host_of() if host_of is None else host_of,
                    dim=dim, rank=rank)

    # -- new meshes from this one (``mesh/views.py``) ---------------------------------------
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the named dims through this rank; it reuses this mesh's groups
        (on the (2, 4) mesh, rank 5's ``mesh["tp"]`` is [4, 5, 6, 7] on its "tp" group)."""
        return DeviceMesh.of(views.select(self._parts, names))

    @progress.entry("flatten()")
    def flatten(self, name: str | None = None) -> DeviceMesh:
        """Merge every dim into one, with one new group (made at its first use, or now with
        eager_groups); name defaults to 'a_b_c'.

        ``mesh["dp", "cp"].flatten()`` makes "dp_cp", which then slices the root mesh too.
        """
        self._parts.alive("flatten()")
        return DeviceMesh.of(views.flatten(self._parts, name))

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """PyTorch's spelling of flatten() (code written for both, as bench/mesh_scale.py)."""
        return self.flatten(mesh_dim_name)

    @progress.entry("reshape()")
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
        self._parts.alive("reshape()")
        return DeviceMesh.of(views.reshape(self._parts, shape, mesh_dim_names, shared,
                                           mesh_dim_roles))

    @progress.entry("unflatten()")
    def unflatten(
        self, dim: int | str, sizes: Sequence[int], names: Sequence[str] | None = None
    ) -> DeviceMesh:
        """Split ``dim`` into dims of ``sizes``; only the new groups are created (at their
        first use, or now with eager_groups).

        On a 1-d mesh "dp" of 8, unflatten("dp", (2, 4), ("replicate", "shard")) gives a
        (2, 4) mesh whose "shard" group through rank 5 is [4, 5, 6, 7].
        """
        self._parts.alive("unflatten()")
        return DeviceMesh.of(views.unflatten(self._parts, dim, sizes, names))

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
        return DeviceMesh.of(groups.adopted(world, group, device, mesh, mesh_dim_names))

    # -- the engine's own mesh (torch's DeviceMesh; ``mesh/native.py``) ------------------------
    @progress.entry("to_torch()")
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
        self._parts.alive("to_torch()")
        return native.to_torch(self._parts, self.epoch)

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
        return DeviceMesh.of(native.from_torch(world, torch_mesh))

    # -- value semantics ---------------------------------------------------------------------
    def _key(self) -> tuple:
        return (*self._parts.native_key(self.epoch), self._parts.roles)

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
        spec = self._parts.spec
        body = f"mesh={spec.array().tolist()}" if spec.size <= 64 else f"ranks={spec.ranks()!r}"
        epoch = f", epoch {self.epoch}" if self.epoch else ""
        return f"DeviceMesh({self.device_type!r}, {dims}; {body}{epoch})"

    def __reduce__(self):
        parts = self._parts
        return _unpickle, (parts.device, parts.spec, parts.root, parts.backends, parts.roles,
                           parts.eager)

    # -- argument checks ------------------------------------------------------------------------
    def _dim(self, mesh_dim: int | str) -> int:
        return args.mesh_dim(mesh_dim, self.mesh_dim_names, self.ndim)

    def _dim_or_only(self, mesh_dim: int | str | None, what: str) -> int:
        self._parts.alive(f"{what}()")
        if mesh_dim is None:
            if self.ndim != 1:
                raise bad_argument(
                    "mesh_dim", None, f"is required on a {self.ndim}-d mesh",
                    f"pass an index 0..{self.ndim - 1}"
                    + (f" or a name in {self.mesh_dim_names}" if self.mesh_dim_names else ""),
                )
            return 0
        return self._dim(mesh_dim)

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


def not_elastic(mesh: DeviceMesh, what: str) -> ArgumentError:
    """The error of ``recover()``, ``grow()`` or ``sync_replicas()`` on a mesh that is not
    elastic (a plain mesh, or a slice of an elastic one)."""
    return bad_argument("mesh", mesh, f"is not elastic, so {what} cannot change it",
                        "make it with init_device_mesh(..., elastic='dp') (its replica "
                        "dim), and call it on that mesh, not on a slice of it")


@progress.entry("pickle.loads() of a DeviceMesh")
def _unpickle(device: str, spec: MeshSpec, root: MeshSpec, backends: tuple[str, ...],
              roles: Roles | None = None, eager: bool = False) -> DeviceMesh:
    """Rebuild a pickled mesh in the current world, reusing its groups, or registering them
    to be made at first use (at once when its mesh made its views' groups so)."""
    world = current_world("unpickling a DeviceMesh")
    return DeviceMesh.of(MeshParts(world, device, spec, root, backends,
                                   groups.make_groups(world, spec, backends, eager),
                                   roles if roles is not None else (None,) * spec.ndim, eager))
