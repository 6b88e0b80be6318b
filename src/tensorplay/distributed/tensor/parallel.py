"""tensorplay.distributed.tensor.parallel: torch's tensor parallelism on our DeviceMesh.

``parallelize_module`` turns our mesh into torch's (``mesh.to_torch()``, on the same groups)
and calls torch's; the styles are torch's own. On a (2, 4) ("dp", "tp") mesh:

    parallelize_module(mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

splits ``up``'s weight by output features and ``down``'s by input features over the 4 "tp"
ranks; ``down``'s partial outputs are summed on ``mesh.get_group("tp")``.
"""

from __future__ import annotations

import torch
from torch.distributed import DeviceMesh as TorchMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)
from torch.distributed.tensor.parallel import parallelize_module as _parallelize_module

from ..device_mesh import DeviceMesh
from . import as_torch_mesh

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "loss_parallel",
           "parallelize_module"]


def parallelize_module(
    module: torch.nn.Module,
    device_mesh: DeviceMesh | TorchMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> torch.nn.Module:
    """torch's ``parallelize_module`` on ``device_mesh.to_torch()``: apply a style (or a dict
    of submodule name -> style) over a 1-d mesh, usually the "tp" slice."""
    return _parallelize_module(module, as_torch_mesh(device_mesh), parallelize_plan,
                               src_data_rank=src_data_rank)
