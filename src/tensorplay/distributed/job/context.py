"""The job as a cross-rank helper sees it: a narrow, read-only view of the World.

The helpers that word failures (``job/failures.py``), check arguments across ranks
(``control/consensus.py``), count calls (``control/accounting.py``), watch progress
(``job/progress.py``) and carry the control plane (``control/store.py``,
``control/gather.py``) take a ``JobContext``, not the ``World``: they read these fields and
call these methods, and write nothing. ``World`` meets it as it is (a Protocol: no import of
``job/world.py`` is needed, so none of these modules sits in an import circle with it). On
rank 5 of a (2, 4) gloo job: rank 5, size 8, backend "gloo", timeout 300 s, the torch engine,
its ``StoreControl``, the epoch's groups (``registry``), ``epochs.host_pids`` {4: 812, 5:
813, ...} for the ranks of its host,
``members()`` range(8) until an elastic mesh lost a slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..backends.protocol import Joined
    from ..control.keys import Spmd
    from ..control.plane import Control
    from .epochs import Epochs
    from .registry import GroupRegistry


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
    def engine(self) -> Joined: ...  # the engine as this world runs it
    @property
    def spmd(self) -> Spmd: ...
    @property
    def control(self) -> Control: ...
    @property
    def registry(self) -> GroupRegistry: ...  # the current epoch's groups
    @property
    def epochs(self) -> Epochs: ...  # host pids, admissions, a layer's advice after a loss
    @property
    def alive(self) -> bool: ...

    def members(self) -> Sequence[int]:
        """The ranks that take part in cross-rank checks."""
        ...
