"""tensorplay.distributed.fsdp: torch's FSDP2 (``fully_shard``) on our DeviceMesh.

The mesh's roles say what each dim does: a 1-d "shard" mesh (or a 1-d mesh without a role,
as torch takes one) shards every parameter over its ranks (FSDP); a 2-d mesh with a
"replicate" dim and then a "shard" dim shards over the second and keeps a copy per index of
the first (HSDP). On 8 ranks with

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
                            mesh_dim_roles={"dp_replicate": "replicate", "dp_shard": "shard",
                                            "tp": "tensor"})

``fully_shard(model, mesh=mesh["dp_shard"])`` shards over [0, 2] on rank 0, and
``fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])`` shards over [0, 2] and
averages gradients with [4, 6]. The whole mesh is refused ("tp" is no data-parallel dim): slice
it first. ``mesh_dim_roles=`` gives roles for this call to a mesh built without them.

The work is torch's own ``torch.distributed.fsdp.fully_shard``, called with the chosen mesh's
``to_torch()`` (torch's DeviceMesh on our groups; none created); a torch DeviceMesh passes
through unchanged. The returned module and the policies are torch's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch
from torch.distributed.device_mesh import DeviceMesh as _TorchMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from ..device_mesh import DeviceMesh
from ..errors import NotAMemberError, bad_argument, bad_type
from ..geometry.roles import AbstractMesh, dim_roles

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "data_parallel_dims", "fully_shard"]

_DATA_PARALLEL = ("replicate", "shard")


@overload
def fully_shard(module: torch.nn.Module, *, mesh: DeviceMesh | _TorchMesh | None = None,
                mesh_dim_roles: Mapping[str, str] | None = None, **kwargs: Any) -> FSDPModule:
    ...


@overload
def fully_shard(module: list[torch.nn.Module], *, mesh: DeviceMesh | _TorchMesh | None = None,
                mesh_dim_roles: Mapping[str, str] | None = None, **kwargs: Any
                ) -> list[FSDPModule]:
    ...


def fully_shard(module: Any, *, mesh: DeviceMesh | _TorchMesh | None = None,
                mesh_dim_roles: Mapping[str, str] | None = None, **kwargs: Any) -> Any:
    """torch's ``fully_shard`` on our mesh: FSDP over a 1-d "shard" mesh, HSDP over a 2-d
    ("replicate", "shard") one.

    ``mesh``: our DeviceMesh (a slice or flatten of one), whose roles decide; torch's
    DeviceMesh, passed through; or None (torch's default: every rank, FSDP).
    ``mesh_dim_roles``: ``{dim name: "replicate" | "shard"}`` for this call, in place of the
    mesh's own roles (for a mesh built without them). Other keywords (``reshard_after_forward``,
    ``mp_policy``, ``offload_policy``, ...) go to torch's ``fully_shard`` unchanged; with
    ``dp_mesh_dims=`` (torch's: data-parallel dims of a full SPMD mesh) torch reads the whole
    mesh and the roles decide nothing. Every argument is checked before anything is made.
    """
    _check_module(module)
    _check_keywords(kwargs)
    return _torch_fully_shard(module, mesh=_torch_mesh(mesh, mesh_dim_roles, kwargs), **kwargs)


def _check_module(module: object) -> None:
    if isinstance(module, torch.nn.Module):
        return
    if isinstance(module, list) and module and all(
            isinstance(m, torch.nn.Module) for m in module):
        return
    raise bad_type("module", module, "torch.nn.Module or a non-empty list of them",
                   "pass the model (or a block of it) to shard")


def _check_keywords(kwargs: Mapping[str, Any]) -> None:
    known = [n for n in inspect.signature(_torch_fully_shard).parameters
             if n not in ("module", "mesh")]
    for name in kwargs:
        if name not in known:
            raise bad_argument(name, kwargs[name], "is not an argument of torch's fully_shard",
                               f"use mesh=, mesh_dim_roles= or one of {tuple(known)}")


def _torch_mesh(mesh: object, roles: Mapping[str, str] | None,
                kwargs: Mapping[str, Any]) -> _TorchMesh | None:
    """The torch mesh to hand torch's fully_shard, once ``mesh`` and ``roles`` are checked."""
    if mesh is None or isinstance(mesh, _TorchMesh):
        if roles is not None:
            raise bad_argument("mesh_dim_roles", roles, "gives roles to tensorplay's mesh only; "
                               f"mesh is {'None' if mesh is None else 'a torch DeviceMesh'}, "
                               "which torch reads as it is", "pass our mesh (init_device_mesh"
                               "(...) or a slice of it), or drop mesh_dim_roles")
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise bad_type("mesh", mesh, "tensorplay DeviceMesh (or torch's, or None)",
                       "pass init_device_mesh(...) or a slice of it, e.g. mesh['dp_shard']")
    if "dp_mesh_dims" in kwargs:
        if roles is not None:
            raise bad_argument("mesh_dim_roles", roles, "and dp_mesh_dims both say which dims "
                               "are data-parallel", "pass one of them")
    else:
        data_parallel_dims(mesh.abstract, roles)
    if mesh.get_coordinate() is None:
        from .. import get_rank

        raise NotAMemberError(
            f"fully_shard(mesh={mesh!r}): rank {get_rank()} is not in this mesh, so it holds "
            "no shard. Fix: call fully_shard only on the mesh's ranks (get_coordinate() is "
            "not None), or use a mesh that holds every rank.")
    return mesh.to_torch()


def data_parallel_dims(mesh: AbstractMesh, mesh_dim_roles: Mapping[str, str] | None = None
                       ) -> tuple[str | None, str | None]:
    """(replicate dim, shard dim) of a mesh fully_shard takes, by name (None where absent or
    unnamed); a typed error naming ``mesh`` (or ``mesh_dim_roles``) for any other mesh.

    ``AbstractMesh(("dp",), (4,), (None,))`` -> (None, "dp"): FSDP; ``AbstractMesh(("r", "s"),
    (2, 2), ("replicate", "shard"))`` -> ("r", "s"): HSDP. Roles come from
    ``mesh_dim_roles`` when given, else from the mesh.
    """
    names, roles = mesh.names, mesh.roles
    if mesh_dim_roles is not None:
        roles = dim_roles(mesh_dim_roles, names, mesh.ndim) or (None,) * mesh.ndim
    shown = AbstractMesh(names, mesh.shape, roles)  # what the errors show: dims and roles
    if mesh.ndim == 1:
        if roles[0] in (None, "shard"):
            return None, (names[0] if names else None)
        raise bad_argument(
            "mesh", shown, f"its one dim has role {roles[0]!r}, but a 1-d mesh is what "
            "fully_shard shards over: its role must be 'shard' (or none)",
            "give that dim role 'shard', or for HSDP pass a 2-d view of a 'replicate' dim "
            "and a 'shard' dim, e.g. mesh['dp_replicate', 'dp_shard']")
    if mesh.ndim == 2 and set(roles) <= {None} and names is not None:
        raise bad_argument(
            "mesh", shown, "is 2-d without roles, so which dim replicates and which shards "
            "is unknown", f"give it roles: fully_shard(..., mesh_dim_roles={{{names[0]!r}: "
            f"'replicate', {names[1]!r}: 'shard'}}), or init_device_mesh(..., "
            "mesh_dim_roles=...) ('replicate' first); or pass one dim, "
            f"mesh[{names[1]!r}], for FSDP")
    if mesh.ndim == 2 and names is None:
        raise bad_argument("mesh", shown, "is 2-d without dim names, which HSDP needs",
                           "build it with mesh_dim_names and mesh_dim_roles, e.g. "
                           "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp_replicate', "
                           "'dp_shard'), mesh_dim_roles={'dp_replicate': 'replicate', "
                           "'dp_shard': 'shard'})")
    if mesh.ndim == 2 and tuple(roles) == _DATA_PARALLEL:
        assert names is not None  # refused above
        return names[0], names[1]
    if mesh.ndim == 2 and tuple(roles) == _DATA_PARALLEL[::-1]:
        raise bad_argument(
            "mesh", shown, "has its 'shard' dim before its 'replicate' dim; HSDP takes "
            "(replicate, shard)", "build the mesh with the replicate dim first, e.g. "
            "mesh_dim_names=('dp_replicate', 'dp_shard', ...)")
    raise bad_argument("mesh", shown, _why_not(roles),
                       f"slice its data-parallel dims first: {_slice_fix(names, roles)}")


def _why_not(roles: Sequence[str | None]) -> str:
    other = [r for r in roles if r is not None and r not in _DATA_PARALLEL]
    if other:
        return (f"holds dims that are not data-parallel (roles {', '.join(map(repr, other))}), "
                "but fully_shard takes a 'shard' dim, or a 'replicate' dim and a 'shard' dim")
    return (f"has {len(roles)} dims, but fully_shard takes a 'shard' dim, or a 'replicate' dim "
            "and a 'shard' dim")


def _slice_fix(names: tuple[str, ...] | None, roles: Sequence[str | None]) -> str:
    """mesh["dp_shard"] for FSDP and mesh["dp_replicate", "dp_shard"] for HSDP, with this
    mesh's own names when its roles say which."""
    if names is None:
        return ("build the mesh with mesh_dim_names and mesh_dim_roles, then pass "
                "mesh['dp_shard'] (FSDP) or mesh['dp_replicate', 'dp_shard'] (HSDP)")
    shard = [n for n, r in zip(names, roles, strict=True) if r == "shard"]
    replicate = [n for n, r in zip(names, roles, strict=True) if r == "replicate"]
    if len(shard) == 1 and len(replicate) == 1 and names.index(replicate[0]) < names.index(
            shard[0]):
        return (f"mesh[{shard[0]!r}] (FSDP) or mesh[{replicate[0]!r}, {shard[0]!r}] "
                "(HSDP)")
    if len(shard) == 1:
        return f"mesh[{shard[0]!r}] (FSDP)"
    return ("mesh['dp_shard'] (FSDP) or mesh['dp_replicate', 'dp_shard'] (HSDP), those dims "
            "having roles 'shard' and 'replicate' (mesh_dim_roles=...)")
