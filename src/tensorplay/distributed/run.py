"""tensorplay-run, the launcher: the entry point of the console script and of ``python -m``.

The launcher itself is the package ``tensorplay.distributed.launcher`` (docs/launcher.md,
docs/architecture.md); this module keeps the two documented ways to start it working::

    tensorplay-run --nproc-per-node 8 train.py
    python -m tensorplay.distributed.run --nproc-per-node 8 train.py
"""

from __future__ import annotations

import sys

from tensorplay.distributed.launcher.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
