"""Dim roles and a mesh's abstract identity, pure (no world, no engine).

A role says what a mesh dim is for: ``init_device_mesh(..., mesh_dim_roles={"dp_shard":
"shard", "tp": "tensor"})``. Roles travel with slices (a kept dim keeps its role), with
``flatten`` (a dim merged from dims of one common role keeps it, else it has none) and with
``reshape`` (a view dim with the same name and the same groups keeps its role; the call may
set others). ``AbstractMesh`` is what a mesh is without its ranks: names, sizes, roles;
equal on every rank that built the same shape, hashable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import UnknownDimError, bad_argument, bad_type

ROLES = ("replicate", "shard", "tensor", "expert", "pipeline", "context")
"""The allowed roles: data-parallel replicas, data-parallel shards (FSDP), tensor parallelism,
expert parallelism, pipeline stages, context (sequence) parallelism."""

Roles = tuple[str | None, ...]
"""One entry per dim: its role, or None."""


def dim_roles(value: object, names: tuple[str, ...] | None, ndim: int,
              arg: str = "mesh_dim_roles") -> Roles | None:
    """``{name: role}`` checked against ``names`` and ROLES -> one role (or None) per dim;
    None when ``value`` is None or empty."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_type(arg, value, "dict of dim name -> role",
                       "pass e.g. {'dp_shard': 'shard', 'tp': 'tensor'}")
    if not value:
        return None
    if names is None:
        raise bad_argument(arg, value, "needs dim names to refer to",
                           "pass mesh_dim_names too")
    roles: list[str | None] = [None] * ndim
    for name, role in value.items():
        if name not in names:
            raise bad_argument(arg, value, f"names {name!r}, which is not a dim",
                               f"use dims of {names}", kind=UnknownDimError)
        if role is not None and role not in ROLES:
            raise bad_argument(arg, value, f"gives dim {name!r} the unknown role {role!r}",
                               f"use one of {ROLES} (or None)")
        roles[names.index(name)] = role
    return tuple(roles) if any(r is not None for r in roles) else None


def merged_role(roles: Sequence[str | None]) -> str | None:
    """The role of a dim flattened from dims with ``roles``: their common role, else None."""
    found = set(roles)
    return roles[0] if len(found) == 1 else None


def as_dict(names: tuple[str, ...] | None, roles: Roles | None) -> dict[str, str]:
    """``{name: role}`` for the named dims that have a role."""
    if names is None or roles is None:
        return {}
    return {n: r for n, r in zip(names, roles, strict=True) if r is not None}


@dataclass(frozen=True, slots=True)
class AbstractMesh:
    """A mesh's identity without ranks: dim names, sizes and roles.

    Two meshes of the same shape, names and roles have equal abstracts on every rank (and in
    every world), so an abstract can key a cache of compiled plans or compare a checkpoint's
    mesh with today's. ``AbstractMesh(("dp", "tp"), (2, 4), ("replicate", "tensor"))``.
    """

    names: tuple[str, ...] | None
    shape: tuple[int, ...]
    roles: Roles

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    def role(self, dim: int | str) -> str | None:
        """The role of a dim, by index or name; None when it has none."""
        index = dim if isinstance(dim, int) else (self.names or ()).index(dim)
        return self.roles[index]
