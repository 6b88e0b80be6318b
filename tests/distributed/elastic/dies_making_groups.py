"""examples/train_elastic.py, with one fault more for the tests: the first replacement of the
rank named in DIES_MAKING_GROUPS ("<rank>:<folder>") SIGKILLs itself as it starts to make its
first group of the epoch it was admitted to. So it dies after its admission (the members wrote
the grown epoch, and it posted its arrival), while that epoch's groups are made: its peers
wait for it in gloo's rendezvous, the others in the groups after. Before it dies it writes
``<folder>/<rank>-died``: "<pid> <group name> <wall time>", which the test reads.

The point is named, not timed: a timer (0.5 s after the replacement starts, say) finds a warm
replacement already in the mesh (0.23-0.33 s from its start to its first step here), and the
fault is never made. Only the test's processes read this; the package has no hook for it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_elastic.py"
WHO = "DIES_MAKING_GROUPS"


def arm(rank: int, folder: Path) -> None:
    """Make this process SIGKILL itself at its first group making (see the module
    docstring), after it wrote ``folder/<rank>-died``."""
    from tensorplay.distributed.backends import torch_c10d

    def new_group(_world: object, name: str, *_args: object, **_kwargs: object) -> None:
        (folder / f"{rank}-died").write_text(f"{os.getpid()} {name} {time.time():.3f}")
        os.kill(os.getpid(), signal.SIGKILL)

    # every group of this process's worlds is made by TorchWorld.new_group
    torch_c10d.TorchWorld.new_group = new_group  # type: ignore[method-assign,assignment]


def main() -> None:
    rank, _, folder = os.environ.get(WHO, "").partition(":")
    if (rank and os.environ.get("TENSORPLAY_RESTART_COUNT") == "1"
            and os.environ.get("RANK") == rank):
        arm(int(rank), Path(folder))
    sys.path.insert(0, str(EXAMPLE.parent))  # the example's own imports (mlp_problem, ...)
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
