"""Say what a rank waits in when one of our calls lasts, at no cost to the call itself.

A daemon thread looks at the main thread's stack once a second (``sys._current_frames``).
When the outermost frame of a call of ours (a collective, a mesh being built, a check,
init_process_group) is the same frame it saw ``TENSORPLAY_PROGRESS_S`` seconds ago (default
30; 0 turns this off), it logs once, at WARNING:

    rank 3: still in all_reduce() on the 'dp' group [3, 7] after 30 s (waits up to 300 s)

Nothing is set or cleared on the call's own path, so the fast all_reduce stays as fast.
"""

from __future__ import annotations

import _thread
import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..process_group import ProcessGroup

if TYPE_CHECKING:
    from types import FrameType

    from .context import JobContext

log = logging.getLogger("tensorplay.distributed")
LOOK_EVERY_S = 1.0
_PACKAGE = Path(__file__).resolve().parents[1]
# the modules whose public functions are the calls a user waits in
_ENTRY_FILES = {str(_PACKAGE / f) for f in ("collectives.py", "device_mesh.py", "world.py")}

_watching: tuple[int, JobContext | None] | None = None  # (generation, world) watched; None: nothing


def watch(world: JobContext, after_s: float) -> None:
    """Watch this process's main thread for calls of ``world`` that last ``after_s`` s."""
    global _watching
    generation = (_watching[0] + 1) if _watching else 1
    _watching = (generation, world)
    if after_s > 0:
        main = threading.main_thread().ident
        assert main is not None  # the main thread has started: it runs this
        _thread.start_new_thread(_loop, (generation, after_s, main))


def stop() -> None:
    """Stop watching (the world was destroyed); the thread ends at its next look."""
    global _watching
    _watching = (_watching[0], None) if _watching else None


def _loop(generation: int, after_s: float, main: int) -> None:
    seen: tuple[int, float] | None = None  # (id of the frame, when it was first seen)
    told: int | None = None  # the frame already reported
    while True:
        time.sleep(LOOK_EVERY_S)
        current = _watching
        if current is None or current[0] != generation or current[1] is None:
            return
        world = current[1]
        frame = _entry_frame(sys._current_frames().get(main))
        if frame is None:
            seen = None
            continue
        if seen is None or seen[0] != id(frame):
            seen = (id(frame), time.monotonic())
        elif told != id(frame) and time.monotonic() - seen[1] >= after_s:
            told = id(frame)
            log.warning("rank %d: still in %s after %.0f s (waits up to %g s)", world.rank,
                        describe(frame), time.monotonic() - seen[1],
                        world.timeout.total_seconds())
        del frame


def _entry_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of a public call of ours on this stack, or None."""
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename in _ENTRY_FILES and not code.co_name.startswith("_"):
            found = frame
        frame = frame.f_back
    return found


def describe(frame: FrameType) -> str:
    """'all_reduce() on the 'dp' group [3, 7]': the call and the group it acts on."""
    group = frame.f_locals.get("pg")
    where = f" on {group.label}" if isinstance(group, ProcessGroup) else ""
    return f"{frame.f_code.co_name}(){where}"
