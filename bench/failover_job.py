"""The training loop that bench/failover.py runs, under tensorplay-run or under torchrun.

    python bench/failover_job.py --launcher ours       # on tensorplay.distributed
    python bench/failover_job.py --launcher torchrun   # on plain torch.distributed, gloo

A world of every rank on every host, a 16-byte all_reduce per step and 0.1 s of "compute", up
to 2000 steps; local rank 0 of each host prints ``step k`` (flushed) once step k's all_reduce
is done, which is how the benchmark knows when to inject its fault. With FAULT_RANK and
FAULT_STEP set, that rank writes the time to FAULT_STAMP and SIGKILLs itself at that step (the
"rank killed" fault). The two launchers run the same loop; only the library differs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import time

import torch

STEPS = 2000
LIBRARIES = {"ours": ("tensorplay.distributed", ()), "torchrun": ("torch.distributed", ("gloo",))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=list(LIBRARIES), required=True,
                   help="ours: tensorplay.distributed (under tensorplay-run); torchrun: "
                        "torch.distributed with gloo")
    module, init_args = LIBRARIES[p.parse_args().launcher]
    dist = importlib.import_module(module)
    fault_rank = int(os.environ.get("FAULT_RANK", "-1"))
    fault_step = int(os.environ.get("FAULT_STEP", "-1"))
    dist.init_process_group(*init_args)
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
