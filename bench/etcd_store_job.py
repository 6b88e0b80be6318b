"""bench/etcd_store.py's job: rank 0 prints how long the (2, 4) mesh's groups took to make.

Run under ``tensorplay-run --nproc-per-node 8`` (with ``--store etcd`` or without) and
``TENSORPLAY_EAGER_GROUPS=1``: the mesh makes every group at once; a barrier on each dim
makes sure every rank has them. Prints ``mesh groups made in 0.123 s`` on rank 0.
"""

from __future__ import annotations

import time

import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh


def main() -> None:
    dist.init_process_group("gloo")  # ours: the mesh's groups are ours
    dist.barrier()
    began = time.perf_counter()
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for name in ("dp", "tp"):
        dist.barrier(group=mesh.get_group(name))
    took = time.perf_counter() - began
    if dist.get_rank() == 0:
        print(f"mesh groups made in {took:.3f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
