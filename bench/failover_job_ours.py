"""The training loop that bench/failover.py runs under tensorplay-run (ours).

A world of every rank on every host, a 16-byte all_reduce per step and 0.1 s of "compute", up
to 2000 steps; local rank 0 of each host prints ``step k`` (flushed) once step k's all_reduce
is done, which is how the benchmark knows when to inject its fault. With FAULT_RANK and
FAULT_STEP set, that rank writes the time to FAULT_STAMP and SIGKILLs itself at that step (the
"rank killed" fault). failover_job_torch.py is the same loop on plain torch.distributed.
"""

from __future__ import annotations

import os
import signal
import time

import torch

import tensorplay.distributed as dist

STEPS = 2000


def main() -> None:
    fault_rank = int(os.environ.get("FAULT_RANK", "-1"))
    fault_step = int(os.environ.get("FAULT_STEP", "-1"))
    dist.init_process_group()
    rank = dist.get_rank()
    printer = os.environ.get("LOCAL_RANK") == "0"
    for step in range(STEPS):
        if rank == fault_rank and step == fault_step:
            with open(os.environ["FAULT_STAMP"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(4))
        if printer:
            print(f"step {step}", flush=True)
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
