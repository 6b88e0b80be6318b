"""The control planes without a store: GatherControl (an engine's all-gather of texts, MPI's
control communicator) and SoloControl (a simulated world). The protocols above them are the
store's, word for word: the same argument check gives the same error on both."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tensorplay.distributed.control import consensus
from tensorplay.distributed.control.gather import GatherControl, SoloControl
from tensorplay.distributed.errors import MeshMismatchError
from tests.fakes import ThreadEngine, ThreadRanks


class GatherEngine(ThreadEngine):
    """A store-less engine whose ``allgather_text`` meets across the threads (``GathersText``)."""

    def __init__(self, timeout_s: float, size: int):
        super().__init__(timeout_s)
        from tensorplay.distributed.backends.protocol import Capabilities

        self.capabilities = Capabilities(simulated=False, has_store=False)
        self._size, self._calls = size, {}  # rank -> its all-gathers so far
        self.ended: list[Any] = []

    def allgather_text(self, text: str, step: str) -> list[str]:
        import threading

        rank = int(threading.current_thread().name.split()[-1])
        self._calls[rank] = self._calls.get(rank, 0) + 1
        return self._exchange.gather("control", self._calls[rank], rank, self._size, text,
                                     self._timeout_s)

    def tell_ended(self, counts: Any) -> None:
        self.ended.append(dict(counts))


def _gather_ranks(n: int) -> ThreadRanks:
    """n thread ranks whose worlds have no store: their control plane is a GatherControl."""
    ranks = ThreadRanks(n)
    ranks.engine = GatherEngine(ranks.timeout_s, n)
    ranks.store = None  # type: ignore[assignment]
    from tensorplay.distributed.job.world import World

    for r in range(n):
        ranks._worlds[r] = World(r, n, "mpi", timedelta(seconds=ranks.timeout_s), ranks.engine,
                                 None)
    return ranks


def test_a_world_without_a_store_gets_a_gather_control():
    ranks = _gather_ranks(2)
    assert isinstance(ranks.world(0).control, GatherControl)


def test_tally_groups_the_members_by_text_the_same_on_every_rank():
    ranks = _gather_ranks(4)
    out = ranks.run(lambda w: w.control.tally("check", "a" if w.rank != 2 else "b"))
    assert out == [[[0, 1, 3], [2]]] * 4
    texts = ranks.run(lambda w: w.control.texts("say", f"r{w.rank}", [0, 2]))
    assert texts == [["r0", "r2"]] * 4


def test_exchange_and_hosts_come_from_the_all_gather():
    ranks = _gather_ranks(3)
    pids = ranks.run(lambda w: w.control.meet_hosts("hosts"))
    assert all(set(p) == {0, 1, 2} for p in pids)  # one host: every rank is a host-mate
    hosts = ranks.world(1).control.hosts()
    assert {hosts(r) for r in range(3)} == {hosts(0)}  # every rank on this machine's host
    got = ranks.run(lambda w: w.control.exchange("calls", str(w.rank * 10), [0, 2], 1.0))
    assert got == [{0: "0", 2: "20"}] * 3


def test_a_mismatch_reads_the_same_on_a_store_and_without_one():
    def check(world):
        shape = (2, 2) if world.rank != 3 else (4, 1)
        with pytest.raises(MeshMismatchError) as caught:
            consensus.agree(world, "init_device_mesh()", {"mesh_shape": shape})
        return str(caught.value)

    over_gather = _gather_ranks(4).run(check)
    over_store = ThreadRanks(4).run(check)
    assert len(set(over_gather)) == 1 and over_gather == over_store
    assert "ranks 0-2" in over_gather[0] and "rank 3" in over_gather[0]


def test_ending_tells_the_engine_the_final_counts():
    ranks = _gather_ranks(1)
    world = ranks.world(0)
    GatherControl(world, ranks.engine).ending({"g": ([0, 1], 4)})
    assert ranks.engine.ended == [{"g": ([0, 1], 4)}]


def test_a_simulated_world_agrees_with_itself(fake_world):
    from tensorplay.distributed.job import lifecycle as world_module

    fake_world(99_999, 100_000)
    control = world_module.current_world("test").control
    assert isinstance(control, SoloControl)
    assert control.tally("check", "x") == [range(100_000)]  # O(1): a range, not a list
    assert control.exchange("calls", "{}", [0, 5], 1.0) == {0: "{}", 5: "{}"}
    assert control.meet_hosts("hosts") == {} and control.known_hosts() is None
