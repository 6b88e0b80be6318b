"""tensorplay-run, the launcher: the entry point of the console script and of ``python -m``.

The launcher itself is the package ``tensorplay.distributed.launcher`` (docs/launcher.md,
docs/architecture.md); this module keeps the two documented ways to start it working::

    tensorplay-run --nproc-per-node 8 train.py
    python -m tensorplay.distributed.run --nproc-per-node 8 train.py
"""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from typing import NoReturn

from tensorplay.distributed.launcher.main import main as launch

__all__ = ["main"]


def main(argv: list[str] | None = None) -> NoReturn:
    """Run tensorplay-run and leave with its exit code, its output flushed, without the
    interpreter's teardown: a daemon thread of the launcher (the heartbeat, a node's link) may
    still be inside a torch store call then, and tearing the interpreter down around it aborts
    the process ("terminate called without an active exception", exit code -6: seen once, a
    launcher of a finished job on a loaded machine). The launcher's own clean-up (its ranks,
    files, the store) is done before ``launch`` returns."""
    code = launch(argv)
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a pipe closed by the reader; a stream closed
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
