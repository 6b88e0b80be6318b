"""tensorplay.distributed: process groups on real engines, and the DeviceMesh built on them.

    import tensorplay.distributed as dist
    from tensorplay.distributed import init_device_mesh

    dist.init_process_group()                      # gloo / nccl; mpi under mpiexec
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    dist.all_reduce(x, group=mesh.get_group("tp"))
"""

from typing import TYPE_CHECKING

from .collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    recv,
    reduce,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .errors import (
    AlreadyInitializedError,
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    CallMismatchError,
    DistributedError,
    DistributedTimeoutError,
    LaunchEnvError,
    MembersFinished,
    MeshMismatchError,
    NotAMemberError,
    NotATorchMeshError,
    NotInitializedError,
    RankFailedError,
    ShrinkError,
    StaleEpochError,
    UnknownDimError,
)
from .process_group import ProcessGroup, ReduceOp, Work
from .world import (
    destroy_process_group,
    get_backend,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)

if TYPE_CHECKING:  # what an IDE and a type checker see; loaded on first use below
    from .device_mesh import DeviceMesh, init_device_mesh, sync_replicas

_MESH = ("DeviceMesh", "init_device_mesh", "sync_replicas")


def __getattr__(name: str):
    """Load the mesh on first use, so that ``python -m tensorplay.distributed.device_mesh``
    (the planning command's old spelling) runs it fresh as ``__main__``."""
    if name not in _MESH:
        raise AttributeError(f"module 'tensorplay.distributed' has no attribute {name!r}")
    from . import device_mesh

    value = getattr(device_mesh, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    """Every public name, the lazily loaded mesh included (for dir(), help() and IDEs)."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AlreadyInitializedError", "ArgumentError", "ArgumentTypeError", "BackendError",
    "CallMismatchError", "DeviceMesh", "DistributedError", "DistributedTimeoutError",
    "LaunchEnvError", "MembersFinished", "MeshMismatchError", "NotAMemberError",
    "NotATorchMeshError",
    "NotInitializedError", "ProcessGroup", "RankFailedError", "ReduceOp", "ShrinkError",
    "StaleEpochError", "UnknownDimError", "Work",
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier",
    "broadcast", "destroy_process_group", "gather", "get_backend", "get_process_group_ranks",
    "get_rank", "get_world_size", "init_device_mesh", "init_process_group", "is_initialized",
    "new_group", "recv", "reduce", "reduce_scatter_tensor", "scatter", "send", "sync_replicas",
]
