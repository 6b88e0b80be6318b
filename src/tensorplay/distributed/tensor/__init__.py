"""tensorplay.distributed.tensor: torch's distributed tensors (DTensor) on our DeviceMesh.

Thin by design: each entry point turns our mesh into torch's (``mesh.to_torch()``: the same
groups, none created) and calls torch's own function; the tensors are torch's DTensor, and
their methods (``redistribute``, ``full_tensor``, ``to_local``) are torch's. A torch
DeviceMesh passes through unchanged, so callbacks that torch hands its mesh to (a
``partition_fn`` of ``distribute_module``) may call these functions with it.

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(torch.randn(8, 16), mesh["tp"], [Shard(0)])
    w.to_local().shape                             # (2, 16) on each of the 4 "tp" ranks
    w.redistribute(placements=[Replicate()])       # all-gathers on mesh.get_group("tp")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import tensor as _torch_tensor
from torch.distributed.device_mesh import DeviceMesh as _TorchMesh
from torch.distributed.tensor import DTensor as _TorchDTensor
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..device_mesh import DeviceMesh
from ..errors import bad_type

__all__ = ["DTensor", "Partial", "Placement", "Replicate", "Shard", "as_torch_mesh",
           "distribute_module", "distribute_tensor", "empty", "full", "ones", "rand", "randn",
           "zeros"]


def as_torch_mesh(device_mesh: DeviceMesh | _TorchMesh | None, name: str = "device_mesh"
                  ) -> _TorchMesh | None:
    """torch's DeviceMesh for ``device_mesh``: ours converted with ``to_torch()``, torch's as
    it is, None as None (torch then takes the mesh of an enclosing ``with torch_mesh:``)."""
    if device_mesh is None or isinstance(device_mesh, _TorchMesh):
        return device_mesh
    if isinstance(device_mesh, DeviceMesh):
        return device_mesh.to_torch()
    raise bad_type(name, device_mesh, "tensorplay DeviceMesh (or torch's)",
                   "pass init_device_mesh(...) or a slice of it, e.g. mesh['tp']")


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | _TorchMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> _TorchDTensor:
    """Split (``Shard(d)``) or copy (``Replicate()``) ``tensor`` over the mesh, taking rank
    ``src_data_rank``'s values: on a 4-rank mesh, ``Shard(0)`` of an (8, 16) tensor leaves a
    (2, 16) block on each rank. torch's ``distribute_tensor`` on ``device_mesh.to_torch()``."""
    return _torch_tensor.distribute_tensor(tensor, as_torch_mesh(device_mesh), placements,
                                           src_data_rank=src_data_rank)


def distribute_module(
    module: torch.nn.Module,
    device_mesh: DeviceMesh | _TorchMesh | None = None,
    partition_fn: Callable[[str, torch.nn.Module, _TorchMesh], None] | None = None,
    input_fn: Callable[..., Any] | None = None,
    output_fn: Callable[..., Any] | None = None,
) -> torch.nn.Module:
    """torch's ``distribute_module`` on ``device_mesh.to_torch()``: ``partition_fn`` turns
    parameters into DTensors (it is handed torch's mesh); ``input_fn``/``output_fn`` wrap
    the forward's inputs and outputs. Without ``partition_fn`` every parameter is
    replicated."""
    return _torch_tensor.distribute_module(module, as_torch_mesh(device_mesh), partition_fn,
                                           input_fn, output_fn)


def _on_our_mesh(torch_factory: Callable[..., _TorchDTensor], doc: str
                 ) -> Callable[..., _TorchDTensor]:
    """torch's DTensor factory ``torch_factory`` taking our mesh too (``as_torch_mesh``)."""

    def factory(*args: Any, device_mesh: DeviceMesh | _TorchMesh | None = None,
                placements: Sequence[Placement] | None = None, **kwargs: Any) -> _TorchDTensor:
        return torch_factory(*args, device_mesh=as_torch_mesh(device_mesh),
                             placements=placements, **kwargs)

    factory.__name__ = factory.__qualname__ = torch_factory.__name__
    factory.__doc__ = doc
    return factory


zeros = _on_our_mesh(_torch_tensor.zeros, """torch's DTensor factory ``zeros`` on
``device_mesh.to_torch()``: ``zeros(8, 16, device_mesh=mesh["tp"], placements=[Shard(0)])``
holds a (2, 16) block of zeros on each of 4 "tp" ranks, made in place (nothing moves).
Keywords (``dtype``, ``requires_grad``, ``layout``) are torch's; ``ones``, ``empty``, ``rand``,
``randn`` and ``full`` alike.""")
ones = _on_our_mesh(_torch_tensor.ones, "torch's ``ones`` on ``device_mesh.to_torch()`` (see "
                    "``zeros``).")
empty = _on_our_mesh(_torch_tensor.empty, "torch's ``empty`` on ``device_mesh.to_torch()`` (see "
                     "``zeros``).")
rand = _on_our_mesh(_torch_tensor.rand, "torch's ``rand`` on ``device_mesh.to_torch()`` (see "
                    "``zeros``; torch's DTensor random state decides the values of each shard).")
randn = _on_our_mesh(_torch_tensor.randn, "torch's ``randn`` on ``device_mesh.to_torch()`` (see "
                     "``rand``).")
full = _on_our_mesh(_torch_tensor.full, "torch's ``full(size, fill_value, ...)`` on "
                    "``device_mesh.to_torch()``: every element ``fill_value`` (see ``zeros``).")


class _DTensorClass(type):
    """Makes ``DTensor`` answer as torch's DTensor class: isinstance, issubclass and
    attributes (so ``isinstance(x, DTensor)`` holds for every DTensor torch returns)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _TorchDTensor)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _TorchDTensor)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_TorchDTensor, name)


class DTensor(metaclass=_DTensorClass):
    """torch's DTensor, whose ``from_local`` also takes our DeviceMesh.

    Instances are torch's DTensor; their methods take torch's mesh (``mesh.to_torch()``)
    where they take one at all (``redistribute(device_mesh=...)``).
    """

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | _TorchMesh | None = None,
        placements: Sequence[Placement] | None = None,
        **kwargs: Any,
    ) -> _TorchDTensor:
        """The DTensor whose shard on this rank is ``local_tensor``, without moving data:
        ``[Shard(0)]`` stacks the 4 "tp" ranks' (2, 16) blocks into an (8, 16) tensor,
        ``[Partial()]`` sums them. Keywords (``run_check``, ``shape``, ``stride``) go to
        torch's ``DTensor.from_local``."""
        return _TorchDTensor.from_local(local_tensor, as_torch_mesh(device_mesh), placements,
                                        **kwargs)
