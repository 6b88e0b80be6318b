"""Shared fixtures: one pool of 8 real gloo ranks for the whole session (spawning is slow),
the guard of the two test tiers (docs/testing.md), and how many cases each property test draws
in each tier."""

from __future__ import annotations

import pytest

from tests import laws, spawn


def pytest_configure(config):
    laws.choose(config.getoption("markexpr") or "")


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is seen
def pytest_collection_modifyitems(config, items):
    """Keep slow costs out of the daily tier (``-m "not slow"``): a ``faults`` test must also be
    ``slow``, and so must every user of ``world8``, whose start-up (8 processes importing torch,
    6-14 s on 2 cores) is paid by whichever test asks for it first."""
    wrong = []
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        if item.get_closest_marker("faults") is not None:
            wrong.append(f"{item.nodeid}: marked faults, so it must be marked slow too")
        if "world8" in getattr(item, "fixturenames", ()):
            wrong.append(f"{item.nodeid}: uses the world8 pool, so it must be marked slow")
    if wrong:
        raise pytest.UsageError("tier markers (see docs/testing.md):\n  " + "\n  ".join(wrong))
    items.sort(key=_cost_rank)


def _cost_rank(item: pytest.Item) -> int:
    """The costliest tests first (``faults``, then other ``slow``), each kind in file order:
    the two workers start on the long ones, and the last tests left to share out are short,
    so that neither worker ends the run alone in a long one (full suite: 295 s against 327 s
    in file order, one run each, 2 cores)."""
    if item.get_closest_marker("faults") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


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


@pytest.fixture
def gloo1():
    """A real 1-rank gloo world in this process; destroyed after the test."""
    import tensorplay.distributed as dist

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{spawn.free_port()}", rank=0,
                            world_size=1, timeout=30)
    yield
    dist.destroy_process_group()
