"""Shared fixtures: one pool of 8 real gloo ranks for the whole session (spawning is slow)."""

from __future__ import annotations

import pytest

from tests import spawn


@pytest.fixture(scope="session")
def world8():
    """Eight ranks on 127.0.0.1 that stay initialised; ``world8.run(fn, *args)``."""
    pool = spawn.Pool(8)
    yield pool
    pool.close()


@pytest.fixture
def fake_world():
    """Start a simulated world at a given rank; destroyed after the test."""
    import tensorplay.distributed as dist

    def start(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
