"""The torch engine's mesh adapter: torch's DeviceMesh over our groups, and back.

DTensor, ``parallelize_module`` and FSDP2's ``fully_shard`` take torch's DeviceMesh.
``to_native`` builds one over a mesh's own c10d groups (creating none); ``from_native``
describes one that a library built, for ``DeviceMesh.from_torch`` to adopt.

How torch 2.13 keeps a mesh, and what we give it. On the (2, 4) root [[0, 1, 2, 3],
[4, 5, 6, 7]] named ("dp", "tp"):

- the root holds its rank array flattened, ``_rank_map`` = [0, 1, ..., 7], and a row-major
  ``_MeshLayout`` over it: "dp" is (size 2, stride 4), "tp" is (4, 1);
- any other mesh keeps its root's ``_rank_map`` and ``_root_mesh``, and per dim the root dims
  it runs along, collapsed into one axis: the slice "tp" is (4, 1), the flatten "dp_tp" (8, 1).
  Torch makes its own slices and flattens this way, so ``==`` holds between ours and torch's
  ``tm["tp"]``, and ``DeviceMesh._concatenate`` (FSDP2 + TP joins "dp" and "tp" with it)
  accepts them;
- ``_dim_group_names``: each dim's c10d group name, empty on a rank outside the mesh (as torch
  leaves it there: DTensor then holds empty local shards and skips the collectives);
- the root's ``_pg_registry`` maps those names to the groups, and its ``_flatten_mapping``
  holds a flattened mesh under the name the root answers to (``tm["dp_tp"]``).

Private torch APIs we rely on (``probe()`` checks each; ``to_native`` and ``from_native``
raise BackendError naming the torch version when one is missing):

- ``DeviceMesh(device_type, _layout=, _rank_map=, _root_mesh=, _init_backend=False)``;
- ``DeviceMesh._rank_map``, ``._layout``, ``._dim_group_names``, ``._pg_registry``,
  ``._flatten_mapping``, ``._get_root_mesh()``;
- ``torch.distributed._mesh_layout._MeshLayout`` (``from_sizes_strides``, ``collapse``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.distributed import DeviceMesh as TorchMesh

from ..errors import BackendError
from .protocol import MeshView, NativeMesh


def to_native(view: MeshView, root: TorchMesh | None) -> TorchMesh:
    """torch's DeviceMesh over ``view``'s groups; ``root`` is torch's mesh of its root."""
    from torch.distributed._mesh_layout import _MeshLayout

    _require("DeviceMesh.to_torch()")
    if root is None:
        rank_map = torch.as_tensor(view.ranks.reshape(-1), dtype=torch.int).contiguous()
        layout = _MeshLayout.from_sizes_strides(tuple(view.ranks.shape))
    else:
        assert view.root_dims is not None  # a view given with its root is a non-root's
        rank_map = root._rank_map
        layout = _MeshLayout([_MeshLayout([root._layout[i] for i in dims]).collapse()
                              for dims in view.root_dims])
    mesh = TorchMesh(view.device_type, mesh_dim_names=view.names, _layout=layout,
                     _rank_map=rank_map, _root_mesh=root, _init_backend=False)
    mesh._dim_group_names = [g.group_name for g in view.groups]
    (mesh if root is None else root)._pg_registry.update((g.group_name, g) for g in view.groups)
    if view.flatten_of is not None:
        assert root is not None  # only a non-root view flattens dims of its root
        root._flatten_mapping.setdefault(view.flatten_of, mesh)
    return mesh


def from_native(obj: object) -> NativeMesh | None:
    """``obj`` described for adoption, None when it is not torch's DeviceMesh.

    A slice by its root's dim names, in the root's order (``tm["tp"]``, ``tm["dp", "tp"]``), is
    described by its root and those names; any other mesh as a root of its own.
    """
    if not isinstance(obj, TorchMesh):
        return None
    _require("DeviceMesh.from_torch()")
    root = obj._get_root_mesh()
    names, root_names = obj.mesh_dim_names, root.mesh_dim_names or ()
    if root is not obj and names and all(n in root_names for n in names) and \
            [root_names.index(n) for n in names] == sorted(root_names.index(n) for n in names):
        return NativeMesh(obj, obj.device_type, None, names, (), root=_describe(root))
    return _describe(obj)


def _describe(mesh: TorchMesh) -> NativeMesh:
    inside = mesh.get_coordinate() is not None
    try:
        ranks = mesh.mesh.tolist()
    except RuntimeError:  # a slice that lacks this rank: torch cannot tell which line it is
        ranks = None
    groups = tuple(mesh.get_all_groups()) if inside else ()
    return NativeMesh(mesh, mesh.device_type, ranks, mesh.mesh_dim_names, groups)


def _require(what: str) -> None:
    """Raise BackendError when this torch lacks an API the adapter uses (checked once)."""
    problems = _problems()
    if problems:
        raise BackendError(
            f"{what}: this torch cannot build its DeviceMesh on our groups: "
            + "; ".join(problems) + ". Fix: install the torch this package is tested with "
            "(2.13), or build torch's mesh yourself with torch's DeviceMesh.from_group("
            "[g.engine_group for g in mesh.get_all_groups()], ...)."
        )


@functools.cache
def _problems() -> tuple[str, ...]:
    return tuple(probe())


def probe() -> list[str]:
    """Problems with the private torch APIs above (empty when all is as we rely on)."""
    problems: list[str] = []

    def expect(ok: bool, api: str, wanted: str) -> None:
        if not ok:
            problems.append(f"torch {torch.__version__}: {api} is not {wanted}")

    mesh_layout: type | None
    try:
        from torch.distributed import _mesh_layout
    except ImportError:
        mesh_layout = None
    else:
        mesh_layout = getattr(_mesh_layout, "_MeshLayout", None)
    expect(callable(getattr(mesh_layout, "from_sizes_strides", None))
           and callable(getattr(mesh_layout, "collapse", None)),
           "torch.distributed._mesh_layout._MeshLayout", "there (with from_sizes_strides, "
           "collapse)")
    params = set(inspect.signature(TorchMesh.__init__).parameters)
    expect({"_layout", "_rank_map", "_root_mesh", "_init_backend"} <= params,
           "DeviceMesh.__init__", "taking _layout=, _rank_map=, _root_mesh=, _init_backend=")
    fields = set(getattr(TorchMesh, "__annotations__", {}))
    expect({"_rank_map", "_layout", "_flatten_mapping", "_pg_registry"} <= fields,
           "DeviceMesh", "holding _rank_map, _layout, _flatten_mapping, _pg_registry")
    expect(callable(getattr(TorchMesh, "_get_root_mesh", None)),
           "DeviceMesh._get_root_mesh", "a method")
    expect("_dim_group_names" in inspect.getsource(TorchMesh.get_group),
           "DeviceMesh.get_group", "reading _dim_group_names")
    return problems
