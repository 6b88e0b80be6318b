"""tensorplay.distributed: process groups on real engines, and the DeviceMesh built on them.

    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh

    dist.init_process_group()                      # gloo on CPU, nccl on GPU
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    dist.all_reduce(x, group=mesh.get_group("tp"))
"""

from .errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    DistributedError,
    DistributedTimeoutError,
    LaunchEnvError,
    MeshMismatchError,
    NotAMemberError,
    NotInitializedError,
    RankFailedError,
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

_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier",
    "broadcast", "gather", "recv", "reduce", "reduce_scatter_tensor", "scatter", "send",
)


_MESH = ("DeviceMesh", "init_device_mesh")


def __getattr__(name: str):
    """Load the collectives (and torch with them) and the mesh on first use.

    The launcher stays light, and `python -m tensorplay.distributed.device_mesh` runs cleanly.
    """
    if name in _COLLECTIVES:
        from . import collectives as module
    elif name in _MESH:
        from . import device_mesh as module
    else:
        raise AttributeError(f"module 'tensorplay.distributed' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "ArgumentError", "ArgumentTypeError", "BackendError", "DeviceMesh", "DistributedError",
    "DistributedTimeoutError", "LaunchEnvError", "MeshMismatchError", "NotAMemberError",
    "NotInitializedError", "ProcessGroup", "RankFailedError", "ReduceOp", "Work",
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier",
    "broadcast", "destroy_process_group", "gather", "get_backend", "get_process_group_ranks",
    "get_rank", "get_world_size", "init_device_mesh", "init_process_group", "is_initialized",
    "new_group", "recv", "reduce", "reduce_scatter_tensor", "scatter", "send",
]
