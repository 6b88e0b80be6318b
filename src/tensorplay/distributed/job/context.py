"""The job as a cross-rank helper sees it: a narrow, read-only view of the World.

The helpers that word failures (``job/failures.py``), check arguments across ranks
(``control/consensus.py``), count calls (``control/accounting.py``), watch progress
(``job/progress.py``) and carry the control plane (``control/store.py``,
``control/gather.py``) take a ``JobContext``, not the ``World``: they read these fields and
call these methods, and write nothing. ``World`` meets it as it is (a Protocol: no import of
``job/world.py`` is needed, so none of these modules sits in an import circle with it). On
rank 5 of a (2, 4) gloo job: rank 5, size 8, backend "gloo", timeout 300 s, the torch engine,
its ``StoreControl``, ``host_pids`` {4: 812, 5: 813, ...} for the ranks of its host,
``members()`` range(8) until an elastic mesh lost a slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..backends.protocol import Engine
    from ..control.keys import Spmd
    from ..control.plane import Control
    from ..process_group import ProcessGroup


class JobContext(Protocol):
    """What the cross-rank helpers read of the job (see the module docstring)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def timeout(self) -> timedelta: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def spmd(self) -> Spmd: ...
    @property
    def control(self) -> Control: ...
    @property
    def host_pids(self) -> dict[int, int] | None: ...  # rank -> pid of this host's ranks
    @property
    def admitted_from(self) -> dict[int, str]: ...  # rank -> launcher instance ("1.2")
    @property
    def recovery_fix(self) -> str | None: ...  # a layer's advice after a loss (elastic)
    @property
    def alive(self) -> bool: ...

    def members(self) -> Sequence[int]:
        """The ranks that take part in cross-rank checks."""
        ...

    def groups(self) -> list[ProcessGroup]:
        """Every group of the current epoch, the world group included."""
        ...
