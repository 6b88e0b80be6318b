"""Say what a rank waits in when one of our calls lasts, at no cost to the call itself.

The calls a user can wait in are declared where they are defined, with ``@entry("name()",
group="pg")``: the decorator files the function's code object in a registry and returns the
function itself, so the call runs exactly as before (no wrapper, no extra frame). A daemon
thread looks at the main thread's stack once a second (``sys._current_frames``). When the
outermost frame of a declared call is the same frame it saw ``TENSORPLAY_PROGRESS_S``
seconds ago (default 30; 0 turns this off), it logs once, at WARNING, the declared name and,
when the entry declares the local that holds the group it acts on, that group:

    rank 3: still in all_reduce() on the 'dp' group [3, 7] after 30 s (waits up to 300 s)
    rank 5: still in flatten() after 30 s (waits up to 300 s)

The outermost declared frame is the call the user made: ``init_device_mesh`` that waits in a
group's making inside ``World.group`` is named ``init_device_mesh()``, ``sync_replicas`` that
waits in its ``broadcast`` is named ``sync_replicas()``.
"""

from __future__ import annotations

import _thread
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..process_group import ProcessGroup

if TYPE_CHECKING:
    from types import CodeType, FrameType

    from .context import JobContext

log = logging.getLogger("tensorplay.distributed")
LOOK_EVERY_S = 1.0


@dataclass(frozen=True)
class Entry:
    """A declared call: its name in the notice ("all_reduce()"), and the local variable of
    its frame that holds the ProcessGroup it acts on (None: no one group)."""

    name: str
    group: str | None = None


class _Function(Protocol):
    """A function as a decorator gets it: its code object is what the stack's frames show."""

    __code__: CodeType

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


F = TypeVar("F", bound=_Function)

# code object -> entry: the registry the watcher compares each frame's code against
_ENTRIES: dict[CodeType, Entry] = {}
_watching: tuple[int, JobContext | None] | None = None  # (generation, world) watched; None: nothing


def entry(name: str, *, group: str | None = None) -> Callable[[F], F]:
    """Declare the decorated function a call a user can wait in, named ``name`` in the notice;
    ``group``: the local variable (an argument, or one set before the wait: collectives'
    ``pg``, the group resolved from ``group=None``) that holds the ProcessGroup it acts on.
    The function comes back unchanged. A ``group`` the function has no local of is refused
    here, at import, not guessed at in a notice."""
    def declare(fn: F) -> F:
        code = fn.__code__
        if group is not None and group not in code.co_varnames:
            raise ValueError(f"progress.entry({name!r}, group={group!r}): "
                             f"{code.co_name}() has no local {group!r}")
        _ENTRIES[code] = Entry(name, group)
        return fn
    return declare


def declared(fn: _Function) -> Entry | None:
    """The entry ``fn`` was declared as, None when it is no declared call (of a classmethod,
    pass its function, ``__func__``: the code the stack shows)."""
    return _ENTRIES.get(fn.__code__)


def entries() -> list[Entry]:
    """Every call declared so far (by the modules imported), in declaration order."""
    return list(_ENTRIES.values())


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
        found = _entry_frame(sys._current_frames().get(main))
        if found is None:
            seen = None
            continue
        frame = found[0]
        if seen is None or seen[0] != id(frame):
            seen = (id(frame), time.monotonic())
        elif told != id(frame) and time.monotonic() - seen[1] >= after_s:
            told = id(frame)
            log.warning("rank %d: still in %s after %.0f s (waits up to %g s)", world.rank,
                        describe(*found), time.monotonic() - seen[1],
                        world.timeout.total_seconds())
        del frame, found


def _entry_frame(frame: FrameType | None) -> tuple[FrameType, Entry] | None:
    """The outermost frame of a declared call on this stack, and its entry; None if none."""
    found = None
    while frame is not None:
        declared_as = _ENTRIES.get(frame.f_code)
        if declared_as is not None:
            found = (frame, declared_as)
        frame = frame.f_back
    return found


def describe(frame: FrameType, declared_as: Entry) -> str:
    """"all_reduce() on the 'dp' group [3, 7]": the call, and the group its declared local
    holds (nothing when the entry declares none, or the local is not set yet)."""
    group = frame.f_locals.get(declared_as.group) if declared_as.group else None
    where = f" on {group.label}" if isinstance(group, ProcessGroup) else ""
    return f"{declared_as.name}{where}"
