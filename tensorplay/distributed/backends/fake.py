"""The "fake" engine: a world that exists only in this process.

Any rank of any world size can be simulated: groups cost nothing to create and collectives
return at once, leaving data as it is (as PyTorch's fake backend does). Use it to plan and
check a mesh for 100,000 GPUs on a laptop.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

NAME = "fake"
BACKENDS = ("fake",)


def check_available(backend: str) -> None:
    """The fake engine is always available."""


def init_world(
    backend: str,
    init_method: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    master: tuple[str, int] | None,
) -> tuple[Any, Any]:
    """Nothing to start: no engine group, no store."""
    return None, None


def new_group(name: str, ranks: list[int], backend: str, timeout: timedelta, desc: str) -> Any:
    """Groups of the fake world have no engine object."""
    return None


def destroy() -> None:
    """Nothing to tear down."""


def is_engine_group(obj: object) -> bool:
    """The fake world has no engine groups to wrap."""
    return False
