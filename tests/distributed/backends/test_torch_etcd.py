"""backends/torch_etcd.py against a real etcd member on 127.0.0.1 (tests/etcd.py): every verb as
torch's own HashStore answers it, through a PrefixStore as c10d calls it; a wait that runs out
and a member that is gone as the two errors c10d reads; gloo groups over it in threads; and 4
real ranks of a (2, 2) mesh that meet on etcd alone, nobody listening on MASTER_PORT; and the
main job under ``tensorplay-run --store etcd``."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from tensorplay.distributed.backends import etcd as etcd_client
from tensorplay.distributed.backends import torch_etcd
from tensorplay.distributed.host import wire
from tests import etcd, spawn, timing

pytestmark = pytest.mark.slow  # starts an etcd daemon
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def member():
    with etcd.Member() as m:
        yield m


def _store(member, name: str, seconds: float = 10) -> torch_etcd.EtcdStore:
    return torch_etcd.connect([member.endpoint], f"{name}/",
                              timedelta(seconds=timing.guard(seconds)))


def _both(store: tdist.Store, calls) -> list:
    """The answers of ``calls`` (each a function of the store) on ``store``, an error as its
    type's name."""
    out = []
    for call in calls:
        try:
            out.append(call(store))
        except (RuntimeError, tdist.DistError) as err:
            out.append(type(err).__name__)
    return out


def test_every_verb_answers_as_torch_s_hashstore_does(member, request):
    calls = [
        lambda s: s.set("a", "1"), lambda s: s.get("a"), lambda s: s.set("b", b"\xff\x00"),
        lambda s: s.get("b"), lambda s: s.add("n", 2), lambda s: s.add("n", 3),
        lambda s: s.add("n", 0), lambda s: s.get("n"),
        lambda s: s.compare_set("c", "", "first"), lambda s: s.compare_set("c", "", "other"),
        lambda s: s.compare_set("c", "first", "next"), lambda s: s.compare_set("c", "no", "x"),
        lambda s: s.get("c"),
        lambda s: s.check(["a", "n"]), lambda s: s.check(["a", "nokey"]),
        lambda s: s.wait(["a", "b"]), lambda s: s.wait(["a"], timedelta(seconds=1)),
        lambda s: s.multi_get(["a", "c"]), lambda s: s.multi_set(["d", "e"], ["4", "5"]),
        lambda s: s.get("e"), lambda s: s.num_keys(),
        lambda s: s.delete_key("d"), lambda s: s.delete_key("d"), lambda s: s.check(["d"]),
        lambda s: s.num_keys(), lambda s: s.clone().get("a"),
    ]
    ours = tdist.PrefixStore("world", _store(member, request.node.name))
    theirs = tdist.PrefixStore("world", tdist.HashStore())
    assert _both(ours, calls) == _both(theirs, calls)
    assert _both(ours, calls[:2]) == [None, b"1"]  # and it really is etcd's
    assert etcd_client.Etcd([member.endpoint], 5.0, f"{request.node.name}/").value(
        "world/a") == b"1"


def test_compare_set_of_a_missing_key_with_an_expected_value_answers_as_tcpstore(member, request):
    """HashStore and TCPStore differ here; c10d's rendezvous runs on TCPStore."""
    tcp = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)
    ours = _store(member, request.node.name)
    assert ours.compare_set("missing", "x", "y") == tcp.compare_set("missing", "x", "y")


def test_a_wait_that_runs_out_is_a_diststoreerror_naming_the_keys(member, request):
    store = tdist.PrefixStore("world", _store(member, request.node.name))
    store.set("here", "1")
    began = time.monotonic()
    with pytest.raises(tdist.DistStoreError) as caught:
        store.wait(["here", "never"], timedelta(seconds=0.5))
    assert time.monotonic() - began < timing.bound(0.5, 5)
    assert "world/never" in str(caught.value) and "500ms" in str(caught.value)
    store.set_timeout(timedelta(seconds=0.3))  # c10d's own timeout, read at each call
    with pytest.raises(tdist.DistStoreError) as caught:
        store.get("never")
    assert "300ms" in str(caught.value) and member.endpoint in str(caught.value)


def test_set_timeout_through_a_prefixstore_is_the_store_s_timeout(member, request):
    inner = _store(member, request.node.name)
    tdist.PrefixStore("p", inner).set_timeout(timedelta(seconds=7))
    assert inner.timeout == timedelta(seconds=7)


def test_a_store_whose_member_is_gone_is_a_distnetworkerror_naming_the_endpoint(request):
    with etcd.Member() as lost:
        store = tdist.PrefixStore("world", _store(lost, request.node.name))
        store.set("a", "1")
        lost.proc.kill()
        lost.proc.wait(timeout=timing.guard(30))
        began = time.monotonic()
        for call in (lambda: store.set("a", "2"), lambda: store.get("a"),
                     lambda: store.add("n", 1), lambda: store.wait(["a"])):
            with pytest.raises(tdist.DistNetworkError) as caught:
                call()
            assert lost.endpoint in str(caught.value), caught.value
            assert "Connection refused" in str(caught.value), caught.value
        assert time.monotonic() - began < timing.bound(0, 10)
        with pytest.raises(tdist.DistNetworkError, match=lost.endpoint):
            torch_etcd.connect([lost.endpoint], "x/", timedelta(seconds=5))


def test_a_store_handed_to_c10d_as_a_temporary_stays_alive(member, request):
    store = tdist.PrefixStore("world", torch_etcd.EtcdStore(
        [member.endpoint], f"{request.node.name}/", timedelta(seconds=timing.guard(10))))
    gc.collect()
    store.set("a", "1")
    assert store.get("a") == b"1" and store.clone().get("a") == b"1"


def test_gloo_groups_over_threads_meet_through_a_prefixstore_of_etcd(member, request):
    def rank(r: int, results: dict) -> None:
        store = tdist.PrefixStore("world_1/", torch_etcd.EtcdStore(
            [member.endpoint], f"{request.node.name}/", timedelta(seconds=timing.guard(30))))
        group = tdist.ProcessGroupGloo(store, r, 2, timedelta(seconds=timing.guard(30)))
        t = torch.tensor([float(r + 1)])
        group.allreduce([t]).wait()
        results[r] = t.item()

    results: dict[int, float] = {}
    threads = [threading.Thread(target=rank, args=(r, results)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timing.guard(60))
    assert results == {0: 3.0, 1: 3.0}


def _mesh_rank(rank: int) -> tuple[float, bool, int]:
    import os

    import numpy as np

    import tensorplay.distributed as dist
    from tensorplay.distributed.backends import torch_etcd
    from tensorplay.distributed.host import netif

    assert torch_etcd.__file__.startswith(spawn.ROOT), torch_etcd.__file__  # this checkout's
    mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = np.array([float(rank)])
    dist.all_reduce(x, group=mesh.get_group("tp"))
    nobody = netif.refuses(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return float(x[0]), nobody, len(torch_etcd._LIVE)


def test_four_ranks_of_a_mesh_meet_on_etcd_alone(member, request):
    prefix = f"{request.node.name}/ranks/"
    got = spawn.run(_mesh_rank, 4, timeout=120,
                    env={wire.STORE: f"etcd://{member.endpoint}/{prefix}"})
    # tp groups are {0, 1} and {2, 3}
    assert [g[0] for g in got] == [1.0, 1.0, 5.0, 5.0]
    assert all(g[1] for g in got), "something listened on MASTER_PORT"
    assert all(g[2] >= 1 for g in got)  # each rank's store is an EtcdStore
    assert etcd_client.Etcd([member.endpoint], 5.0, prefix).count(
        "tensorplay/attempt_0/tensorplay/world_1/") > 0


def test_a_world_whose_etcd_cannot_be_reached_says_which_endpoints_and_what_they_said(
        monkeypatch):
    from tensorplay.distributed.backends import torch_rendezvous
    from tensorplay.distributed.errors import BackendError

    etcd.require()
    nobody = f"127.0.0.1:{spawn.free_port()}"
    monkeypatch.setenv(wire.STORE, f"etcd://{nobody}/ranks/")
    with pytest.raises(BackendError) as caught:
        torch_rendezvous.make_tcp_store("127.0.0.1", spawn.free_port(), rank=0, world_size=2,
                                        timeout=timedelta(seconds=timing.guard(5)))
    assert nobody in str(caught.value) and "Connection refused" in str(caught.value)
    assert wire.STORE in str(caught.value) and "Fix:" in str(caught.value)


def test_the_main_job_trains_on_it_under_tensorplay_run_store_etcd(tmp_path):
    """8 ranks on one host, nobody serving a TCPStore: the (2, 4) example matches one process,
    and the launcher's member leaves nothing behind."""
    etcd.require()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorplay.distributed.run", "--store", "etcd",
         "--nproc-per-node", "8", str(ROOT / "examples" / "train_dp_tp.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": spawn.pythonpath(), "TMPDIR": str(tmp_path)})
    out, _ = timing.communicate(proc, 120)
    assert proc.returncode == 0, out
    assert "[rank 0] OK: matches single-process training" in out, out
    assert not list(tmp_path.glob("tensorplay-run-*/etcd-*")), list(tmp_path.rglob("*"))
