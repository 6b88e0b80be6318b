"""The torch engine's seams: the private torch APIs it relies on, and its failure reading."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as tdist

from tensorplay.distributed.backends import torch_c10d
from tests import timing


def test_every_private_torch_api_we_use_still_has_the_signature_we_rely_on():
    start = time.monotonic()
    problems = torch_c10d.probe()
    assert problems == [], "\n".join(problems)
    assert time.monotonic() - start < timing.bound(0, 1), timing.describe()  # cheap: runs first


def test_a_changed_private_api_is_named_with_the_torch_version(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setattr(c10d, "_new_process_group_helper", lambda group_size, ranks: None)
    monkeypatch.delattr(c10d, "_get_default_store")
    problems = torch_c10d.probe()
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"torch {torch.__version__}: "
                                  "distributed_c10d._new_process_group_helper is not (")
    assert problems[1].endswith("_get_default_store is not a function")


def test_the_private_apis_are_listed_in_the_engine_docstring():
    for api in ("_new_process_group_helper", "pg_group_ranks", "_get_default_store",
                "pg_coalesce_state", "master_listen_fd", "_has_torch_function_unary",
                "ProcessGroup.allreduce"):
        assert api in torch_c10d.__doc__, api


@pytest.mark.parametrize(("err", "kind"), [
    (tdist.DistStoreError("wait timeout after 5000ms"), "timeout"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms"), "timeout"),
    (tdist.DistNetworkError("failed to recv, got 0 bytes"), "peer_lost"),
    (RuntimeError("[pair.cc:1] Connection reset by peer"), "peer_lost"),
    (RuntimeError("Connection closed by peer [127.0.0.1]:4242"), "peer_lost"),
    (RuntimeError("unsupported dtype"), "other"),
    (ValueError("not the engine's"), None),
])
def test_failures_are_classified_in_one_place(err, kind):
    assert torch_c10d.ENGINE.classify(err) == kind


def test_a_real_store_s_failures_are_judged_gone_or_timed_out_and_a_bug_is_not():
    """torch's TCPStore: a wait that runs out, then a set once the server has closed (rank 0
    exited), each as the engine's ``store_failure`` sees it; the control plane's store raises
    ours in their place (the engine's error the cause)."""
    import gc
    from datetime import timedelta

    from tensorplay.distributed.backends.protocol import StoreGone, StoreTimedOut
    from tensorplay.distributed.control.store import JobStore

    engine = torch_c10d.ENGINE
    server = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=0.3))
    client = JobStore(tdist.TCPStore("127.0.0.1", server.port, None, False,
                                     timeout=timedelta(seconds=0.3)), engine.store_failure)
    with pytest.raises(StoreTimedOut, match="wait timeout") as waited:
        client.get("never set")
    assert isinstance(waited.value.__cause__, tdist.DistStoreError)
    del server
    gc.collect()  # the server closes with its last reference
    deadline = time.monotonic() + timing.bound(0, 5)
    with pytest.raises(StoreGone) as gone:
        while time.monotonic() < deadline:  # the client sees the close within moments
            client.set("k", "1")
    assert engine.store_failure(gone.value.__cause__) == "gone"
    assert engine.store_failure(TypeError("set(): incompatible arguments")) is None


def test_gloo_groups_cannot_shrink_so_a_recovery_remakes_them(gloo1):
    """docs/elastic.md: torch's shrink_group is NCCL only, so an elastic recovery makes the new
    epoch's groups afresh. If this torch lets gloo shrink, that speed-up is worth taking."""
    assert callable(getattr(tdist, "shrink_group", None))  # the call exists in this torch...
    backend = tdist.group.WORLD._get_backend(torch.device("cpu"))
    assert type(backend).__name__ == "ProcessGroupGloo"
    assert backend.supports_shrinking is False  # ...but not for gloo


def test_a_severed_group_refuses_every_later_call_at_once(gloo1):
    """After sever() a call on the group fails at once, as for a lost peer, without entering
    gloo: gloo can miss this side's own shutdown for a call posted after it, and then wait
    for a peer that has not broken its side (seen: a late rank in a ring all_reduce)."""
    import numpy as np

    from tensorplay.distributed import ReduceOp
    from tensorplay.distributed.job import lifecycle as _world

    world = _world.current_world("test")
    engine = world.engine
    engine.prepare_elastic()  # as an elastic mesh does: calls made from now can be refused
    group = world.default_group
    ops = engine.ops(group.made_engine_group(), group,
                     lambda err, what: RuntimeError(f"{what} failed: {err}"))
    ops.all_reduce(np.ones(2), ReduceOp.SUM, False)  # working
    engine.sever(group.made_engine_group())
    for call in (lambda: ops.all_reduce(torch.ones(2), ReduceOp.SUM, False),
                 lambda: ops.broadcast(np.ones(2), 0, False),
                 lambda: ops.barrier(False)):
        with pytest.raises(RuntimeError, match=r"\(\) failed: this rank broke its connections "
                                               r"of the group: a recovery began"):
            call()


def _refused_while_waiting_job(rank: int) -> dict:
    """Rank 0 waits in an all_reduce on a breakable gloo group that rank 1 has not joined;
    another thread refuses the group 0.3 s later without shutting any socket (gloo never
    hears of it). Rank 1 joins the all_reduce only after rank 0's call ended, so that the
    abandoned work completes and both ranks end cleanly."""
    import threading
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from tensorplay.distributed import ReduceOp
    from tensorplay.distributed.backends.torch_collectives import TorchGroupOps

    tdist.init_process_group("gloo", timeout=timedelta(seconds=60))
    store = c10d._get_default_store()
    ops = TorchGroupOps(c10d._get_default_group(), "gloo", 2,
                        lambda err, what: RuntimeError(f"{what} failed: {err}"), breakable=True)
    out: dict = {}
    if rank == 0:
        threading.Timer(0.3, ops.refuse, ("a recovery began (test)",)).start()
        start = time.monotonic()
        try:
            ops.all_reduce(torch.ones(2), ReduceOp.SUM, False)
        except RuntimeError as err:
            out["error"] = str(err)
        out["seconds"] = time.monotonic() - start
        store.set("rank 0 done", "1")
    else:
        store.wait(["rank 0 done"])
        tdist.all_reduce(torch.ones(2))
    store.set(f"rank {rank} ended", "1")
    store.wait([f"rank {1 - rank} ended"])
    tdist.destroy_process_group()
    return out


@pytest.mark.slow  # two processes
def test_a_call_waiting_on_a_breakable_group_fails_within_a_slice_of_its_refusal():
    """The call was posted before the refusal, and no socket was shut: it still fails, one
    wait slice after the refusal, instead of waiting out the group's 60 s timeout."""
    from tensorplay.distributed.backends.torch_collectives import WAIT_SLICE
    from tests import spawn

    got = spawn.run(_refused_while_waiting_job, 2, init=False, timeout=60)
    assert got[0]["error"] == "all_reduce() failed: a recovery began (test)", got
    assert 0.3 <= got[0]["seconds"] < timing.bound(0.3 + WAIT_SLICE.total_seconds(), 5.0), got


RENDEZVOUS_S = 2.0  # how long gloo waits for the absent member in the test below


def _abandoned_rendezvous_job(rank: int, apart: bool) -> dict:
    """Rank 0 makes the group [0, 1] on a helper thread (as ``unless_told`` does for a grown
    epoch's groups) and rank 1 never does, so gloo's rendezvous waits RENDEZVOUS_S in the store
    for rank 1's address; once it waits there (its own address posted) rank 0's main thread
    reads one key of the world's store. Seconds from the helper's start: when the read and the
    rendezvous ended. Both ranks end once the rendezvous has failed."""
    import threading
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from tensorplay.distributed.geometry.spec import Ranks

    tdist.init_process_group("gloo", timeout=timedelta(seconds=60))
    store = c10d._get_default_store()
    engine = torch_c10d.TorchWorld(store, adopted=True)  # a world's engine, as start() makes
    out: dict = {}
    if rank == 0:
        probe = store.clone()  # a connection of its own: sees the rendezvous's keys as posted
        keys_before = probe.num_keys()
        def make() -> None:
            try:
                engine.new_group("gloo-test-absent", Ranks.of([0, 1]), "gloo",
                                 timedelta(seconds=RENDEZVOUS_S), "test", apart=apart)
            except RuntimeError as err:
                out["rendezvous"] = type(err).__name__
            out["rendezvous_end"] = time.monotonic() - began
        began = time.monotonic()
        helper = threading.Thread(target=make, daemon=True)
        helper.start()
        # the helper is in its rendezvous once it has posted its own address; then it waits
        # in the store for rank 1's, which never comes
        assert timing.wait_until(lambda: probe.num_keys() > keys_before, 10.0), "no rendezvous"
        store.check(["anything"])
        out["read_end"] = time.monotonic() - began
        helper.join(timing.guard(60))
        store.set("rank 0 done", "1")
    else:
        store.wait(["rank 0 done"])
    tdist.destroy_process_group()
    return out


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("apart", [True, False])
def test_a_rendezvous_given_up_on_a_helper_thread_holds_no_store_call_of_the_process(apart):
    """A TCPStore client serves one request at a time, and gloo's rendezvous waits in the store
    for each member's address: made over the process's own connection (``apart=False``), the
    group's making holds every store call of the process until gloo gives up (seen: ranks
    that had given up a grown epoch's group sat 30 s in the recovery's first store read and
    were declared lost); ``apart=True`` (a bounded making, ``World._make``) meets over a
    connection of its own, and the main thread's read returns during the wait. If this torch
    stops queueing (``apart=False`` answers during the wait too), the clone is not needed."""
    from tests import spawn

    got = spawn.run(_abandoned_rendezvous_job, 2, apart, init=False, timeout=60)[0]
    assert got["rendezvous"] == "DistStoreError", got  # gloo gave up: rank 1 never came
    assert got["rendezvous_end"] >= RENDEZVOUS_S, got
    if apart:  # read 0.3 s in (0.0002 s here), long before gloo's wait ended
        assert got["read_end"] < min(timing.bound(0.3, 0.5), got["rendezvous_end"]), got
    else:  # queued behind the whole wait (2.004 s here)
        assert got["read_end"] >= RENDEZVOUS_S, got
