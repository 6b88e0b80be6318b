"""The meshes made from a mesh: slices (``mesh["tp"]``), ``flatten``, ``unflatten`` and
``reshape``, each the parts of a new mesh of the same world computed from a mesh's parts
(``DeviceMesh`` wraps them); nothing of the mesh they come from changes.

On a (2, 4) mesh named ("dp", "tp"), on rank 5 at (1, 1): ``mesh["tp"]`` is the 1-d mesh
[4, 5, 6, 7] on the "tp" group the mesh holds already; ``mesh.flatten()`` is the 1-d mesh
"dp_tp" of all 8 ranks, one new group (made at its first use); ``mesh.reshape((4, 2), ("a",
"b"))`` puts rank 5 at (2, 1), its "b" group [4, 5] new, its "a" group [1, 3, 5, 7] new;
``mesh.unflatten("tp", (2, 2), ("t0", "t1"))`` keeps "dp" [1, 5] and makes "t0" [5, 7] and
"t1" [4, 5]. Slicing makes no group; the others find in the world's registry the groups whose
ordered ranks coincide and make only the new ones, at their first use (now with
eager_groups). Every rank makes the same call (SPMD): each but slicing passes the cross-rank
check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..control.consensus import agree
from ..errors import ArgumentError, UnknownDimError, bad_argument, bad_type, format_ranks, is_int
from ..geometry.roles import dim_roles, merged_role
from ..geometry.spec import MeshSpec
from ..process_group import ProcessGroup
from . import args
from .groups import make_groups, mesh_backend
from .parts import MeshParts


def select(parts: MeshParts, names: str | tuple[str, ...]) -> MeshParts:
    """``mesh[names]``: the sub-mesh of the named dims through this rank, on this mesh's
    groups (a flattened name's group is the registry's, made by ``flatten``)."""
    wanted = args.slice_names(names)
    parts.coordinate(f"mesh[{names!r}]")
    found = [resolve_name(parts, name) for name in wanted]
    order = [p[0] for p in found]
    if order != sorted(order):
        in_order = tuple(n for _, n in sorted(zip(order, wanted, strict=True)))
        raise bad_argument("mesh[...]", names, "names are out of mesh order",
                           f"list them in the mesh's order: {in_order}")
    dims = [d for p in found for d in p]
    if len(set(dims)) != len(dims):
        raise bad_argument("mesh[...]", names, "names overlap (a flattened name covers "
                           "another)", "slice by dims that do not share any dim")
    world, rank = parts.world, parts.world.rank
    spec = parts.spec.select(dims, rank)
    starts = [sum(len(p) for p in found[:i]) for i in range(len(found))]
    for part, start in reversed(list(zip(found, starts, strict=True))):
        if len(part) > 1:
            spec = spec.flatten(None, range(start, start + len(part)))
    backends = tuple(parts.backends[part[0]] for part in found)
    roles = tuple(merged_role([parts.roles[d] for d in part]) for part in found)
    groups: list[ProcessGroup] = []
    for i, (name, part) in enumerate(zip(wanted, found, strict=True)):
        if len(part) == 1:
            groups.append(parts.groups[part[0]])
            continue
        group = world.registry.find(spec.line(rank, i), backends[i])
        if group is None:
            raise ArgumentError(f"mesh[{names!r}]: the group of flattened dim {name!r} is "
                                "missing on this rank. Fix: call flatten() on every rank.")
        groups.append(group)
    spec = MeshSpec(spec.layout, wanted if parts.spec.names else None, spec.table)
    return MeshParts(world, parts.device, spec, parts.root, backends, tuple(groups), roles,
                     parts.eager)


def resolve_name(parts: MeshParts, name: str) -> tuple[int, ...]:
    """The mesh's dims that ``name`` denotes: one dim, or the dims a flattened name merged
    ("dp_cp" on a ("dp", "cp", "tp") mesh: (0, 1))."""
    names = parts.spec.names or ()
    if name in names:
        return (names.index(name),)
    flattened = parts.world.registry.flattened_names(parts.root_key())
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


def flatten(parts: MeshParts, name: str | None) -> MeshParts:
    """Every dim merged into one, with one new group; ``name`` defaults to 'a_b_c' and,
    for a named mesh of several dims, slices the root from then on (``mesh["dp_cp"]``)."""
    if name is not None and (not isinstance(name, str) or not name):
        raise bad_argument("name", name, "must be a non-empty str", "pass e.g. 'dp_cp'")
    spec, world = parts.spec, parts.world
    if name is None and spec.names is not None:
        name = "_".join(spec.names)
    if name in (parts.root.names or ()) and (spec.ndim > 1 or spec.names != (name,)):
        raise bad_argument("name", name, "is already a dim of the root mesh",
                           "pick a new name")
    # the name the root answers to from now on: a named mesh of several dims only
    registers = name if spec.names is not None and spec.ndim > 1 else None
    if registers is not None:
        registered = world.registry.flattened_names(parts.root_key()).get(registers)
        if registered is not None and registered != spec.names:
            raise bad_argument("name", name, f"already flattens {registered}",
                               "pick a new name")
    agree(world, "flatten()", {"name": name, "shape": spec.shape,
                               "mesh_dim_names": spec.names, "device_type": parts.device})
    flat = spec.flatten(name)
    backends = (parts.backends[0],)
    groups = make_groups(world, flat, backends, parts.eager)
    if registers is not None and spec.names is not None:
        world.registry.register_flatten(parts.root_key(), registers, spec.names)
    return MeshParts(world, parts.device, flat, parts.root, backends, groups,
                     (merged_role(parts.roles),), parts.eager)


def unflatten(parts: MeshParts, dim: int | str, sizes: Sequence[int],
              names: Sequence[str] | None) -> MeshParts:
    """``dim`` split into dims of ``sizes``: a root of its own, whose groups of the other
    dims are the registry's and whose new dims' groups are made at first use."""
    spec, world = parts.spec, parts.world
    d = args.mesh_dim(dim, spec.names, spec.ndim, "dim")
    new_sizes = args.positive_sizes(sizes, spec.shape[d])
    if spec.names is None and names is not None and spec.ndim > 1:
        raise bad_argument("names", names, "cannot name dims of a mesh without dim names",
                           "pass names=None, or build the mesh with mesh_dim_names")
    new_names = None
    if spec.names is not None or names is not None:
        new_names = args.dim_names(names, len(new_sizes), "names")
        if new_names is None:
            raise bad_argument("names", names, "is required on a named mesh",
                               f"give {len(new_sizes)} names")
        others = [n for i, n in enumerate(spec.names or ()) if i != d]
        clash = [n for n in new_names if n in others]
        if clash:
            raise bad_argument("names", names, f"{clash[0]!r} is already a dim",
                               "pick new names")
    split = spec.unflatten(d, new_sizes, new_names)
    agree(world, "unflatten()", {"dim": d, "sizes": new_sizes, "names": new_names,
                                 "shape": spec.shape, "device_type": parts.device})
    backends = parts.backends[:d] + (parts.backends[d],) * len(new_sizes) + \
        parts.backends[d + 1:]
    groups = make_groups(world, split, backends, parts.eager)
    roles = parts.roles[:d] + (None,) * len(new_sizes) + parts.roles[d + 1:]
    return MeshParts(world, parts.device, split, split, backends, groups, roles, parts.eager)


def reshape(parts: MeshParts, shape: Sequence[int], mesh_dim_names: Sequence[str] | None,
            shared: Sequence[str], mesh_dim_roles: Any) -> MeshParts:
    """The same ranks in a new shape, row-major, in the same root (see
    ``DeviceMesh.reshape``): a view dim whose groups equal a dim of this mesh takes that
    dim's backend, so the registry gives it that dim's groups."""
    spec, world = parts.spec, parts.world
    sizes = _reshape_sizes(shape, spec)
    names = args.dim_names(mesh_dim_names, len(sizes))
    if names is None and spec.names is not None:
        raise bad_argument("mesh_dim_names", mesh_dim_names, "is required to reshape a "
                           "mesh with dim names", f"give {len(sizes)} names")
    wanted = _shared_names(shared, spec.names, names)
    roles_given = dim_roles(mesh_dim_roles, names, len(sizes))
    view = spec.reshape(sizes, names)
    mine = spec.names or ()
    match: list[int | None] = []  # for each view dim, a dim of this mesh with its groups
    for b in range(view.ndim):
        named = [mine.index(names[b])] if names and names[b] in mine else []
        match.append(next((a for a in [*named, *range(spec.ndim)]
                           if spec.same_lines(a, view, b)), None))
    for name in wanted:  # names is not None here: every shared name is a dim of the view
        a, b = mine.index(name), (names or ()).index(name)
        if match[b] != a and not spec.same_lines(a, view, b):
            raise ArgumentError(f"reshape(): shared={tuple(shared)!r}: "
                                + _differs(parts, a, view, b, name) + ". Fix: share only "
                                "dims whose groups the reshape keeps (the dims outside "
                                "the ones it splits or merges), or drop it from shared.")
    roles = list(roles_given or (None,) * view.ndim)
    for b, kept in enumerate(match):  # a dim kept as it was (same name, same groups)
        if roles[b] is None and kept is not None and names and mine and mine[kept] == names[b]:
            roles[b] = parts.roles[kept]
    other = (parts.backends[0] if len(set(parts.backends)) == 1
             else mesh_backend(world, parts.device))
    backends = tuple(other if a is None else parts.backends[a] for a in match)
    agree(world, "reshape()", {
        "shape": sizes, "mesh_dim_names": names, "shared": wanted, "mesh_dim_roles": roles,
        "of": [spec.shape, spec.names], "device_type": parts.device})
    groups = make_groups(world, view, backends, parts.eager)
    return MeshParts(world, parts.device, view, parts.root, backends, groups, tuple(roles),
                     parts.eager)


def _reshape_sizes(shape: object, spec: MeshSpec) -> tuple[int, ...]:
    """reshape()'s sizes: one -1 inferred, the product the mesh's size; a size that does not
    fit names the mesh's dims and sizes ("the sizes 3 x 4 = 12 hold 12 ranks, not the mesh's
    8 ranks (dp=2, tp=4)")."""
    total = spec.size
    names = spec.names or tuple(str(d) for d in range(spec.ndim))
    have = ", ".join(f"{n}={s}" for n, s in zip(names, spec.shape, strict=True))
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
                               f"{_example(spec.shape)}")
    return args.positive_sizes(shape, total, "shape")


def _example(shape: tuple[int, ...]) -> str:
    """A valid reshape of ``shape``: its last two dims merged, -1 first ((2, 4) -> (-1, 8))."""
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


def _differs(parts: MeshParts, a: int, view: MeshSpec, b: int, name: str) -> str:
    """'dim 'pp': rank 5's group is [...] in the view but [...] in the mesh', for this rank
    when it is in the mesh and its groups differ, else the first rank whose groups differ."""
    me, spec = parts.world.rank, parts.spec
    ranks = [me] if spec.coordinate_of(me) is not None else []
    for rank in [*ranks, *spec.ranks()]:
        mine, theirs = spec.line(rank, a), view.line(rank, b)
        if mine != theirs:
            return (f"dim {name!r}: rank {rank}'s group is {_ranks_text(theirs)} "
                    f"in the view but {_ranks_text(mine)} in the mesh")
    return f"dim {name!r}: the groups differ"


def _ranks_text(ranks: Any) -> str:
    """[1, 5]; a group over 16 ranks in runs: [0-63, 128-191, ... (N in all)]."""
    return str(ranks.tolist()) if len(ranks) <= 16 else f"[{format_ranks(ranks)}]"
