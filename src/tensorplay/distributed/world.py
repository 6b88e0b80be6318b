"""The torch.distributed-shaped lifecycle of a job: the public door to ``job/lifecycle.py``.

    import tensorplay.distributed as dist
    dist.init_process_group()        # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    dist.get_rank(), dist.get_world_size()   # (5, 8) on rank 5 of an 8-rank job
    dist.destroy_process_group()
"""

from __future__ import annotations

from .job.lifecycle import (
    current_world,
    destroy_process_group,
    get_backend,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)

__all__ = ["current_world", "destroy_process_group", "get_backend", "get_process_group_ranks",
           "get_rank", "get_world_size", "init_process_group", "is_initialized", "new_group"]
