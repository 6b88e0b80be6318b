"""Strict mode: before each collective, the members of its group check they make the same call.

Opt in with ``TENSORPLAY_STRICT=1`` or ``init_process_group(strict=True)``. Each call's
fingerprint (the collective, the group's call number, each buffer's shape and dtype, the op,
src or dst, and the call site in the user's code) is hashed to 8 bytes, and the members
all-gather the hashes on the group itself before the call runs. When they differ, the members
all-gather the fingerprints' words on the group too (slots of TEXT_BYTES; the same on every
engine) and every member raises the same CallMismatchError, e.g. on the main job's "tp" group
[0-3]::

    ranks made different calls on the 'tp' group [0-3] at its call #6:
      rank 0: all_reduce((4, 8) float64, SUM) at train.py:41
      ranks 1-3: all_reduce((4, 8) float64, SUM) at train.py:44

The price is one small all-gather per call (measured in bench/README.md). A simulated world
moves nothing, so it is never strict.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..errors import CallMismatchError
from ..process_group import ReduceOp

if TYPE_CHECKING:
    from ..backends.protocol import GroupOps
    from ..process_group import ProcessGroup

_PACKAGE = str(Path(__file__).resolve().parent)
_POINT_TO_POINT = ("send", "recv")
TEXT_BYTES = 512  # a call's words, as all-gathered after a difference


class StrictOps:
    """A group's collectives, each preceded by the members' check of its fingerprint."""

    def __init__(self, inner: GroupOps, group: ProcessGroup):
        self._inner, self._group = inner, group

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call = getattr(self._inner, name)
        if name in _POINT_TO_POINT:  # two members, not the group: nothing to compare
            return call

        def checked(*args: Any) -> Any:
            self._check(f"{name}({', '.join(_words(a) for a in args if _words(a))})")
            return call(*args)

        return checked

    def _check(self, call: str) -> None:
        import numpy as np

        group = self._group
        n = group.calls
        text = f"{call} at {_call_site()}"
        digest = hashlib.sha256(f"{n} {call}".encode()).digest()  # the call site may differ
        mine = np.array([int.from_bytes(digest[:8], "little", signed=True)], dtype=np.int64)
        every = np.zeros(group.size(), dtype=np.int64)
        self._inner.all_gather_into_tensor(every, mine, False)
        if (every == every[0]).all():
            return
        by_digest: dict[int, list[int]] = {}
        for member, value in zip(group.ranks, every.tolist(), strict=True):
            by_digest.setdefault(value, []).append(member)
        firsts = [ranks[0] for ranks in by_digest.values()]
        texts = self._gather_texts(text, firsts)
        raise CallMismatchError(group.label, seq=n, calls=dict(
            zip(texts, by_digest.values(), strict=True)))

    def _gather_texts(self, text: str, firsts: list[int]) -> list[str]:
        """The call texts of the members in ``firsts``, all-gathered on the group itself in
        slots of TEXT_BYTES (every member takes part: all saw the same fingerprints)."""
        import numpy as np

        mine = np.zeros(TEXT_BYTES, dtype=np.uint8)
        data = text.encode()[:TEXT_BYTES]
        mine[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        every = np.zeros((self._group.size(), TEXT_BYTES), dtype=np.uint8)
        self._inner.all_gather_into_tensor(every, mine, False)
        rows = [self._group.group_rank(r) for r in firsts]
        return [every[i].tobytes().rstrip(b"\0").decode(errors="replace") for i in rows]


def _words(value: Any) -> str:
    """How a collective's argument shows in its fingerprint: shapes and dtypes, not data."""
    if value is None or isinstance(value, bool):
        return ""
    if isinstance(value, ReduceOp):
        return value.name
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return f"[{len(value)} x {_words(value[0])}]" if value else "[]"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{tuple(shape)} {value.dtype}"
    return type(value).__name__


def _call_site() -> str:
    """file:line of the innermost frame outside this package: the user's call."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
