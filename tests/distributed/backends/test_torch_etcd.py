"""backends/torch_etcd.py: a real etcd as torch's c10d store. Its verbs answer as torch's own
stores do, its failures are the two errors c10d reads, gloo makes groups through it, and a job
of real processes under ``tensorplay-run --store etcd`` trains on it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tensorplay.distributed.backends import torch_etcd
from tests import etcd, spawn, timing

pytestmark = pytest.mark.slow  # starts an etcd daemon
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def member():
    with etcd.Member() as m:
        yield m


def _store(member, prefix: str, seconds: float = 10.0) -> torch_etcd.EtcdStore:
    return torch_etcd.connect([member.endpoint], prefix, timedelta(seconds=seconds))


def test_every_verb_answers_as_torchs_own_store_does(member):
    ours, theirs = _store(member, "verbs/"), dist.HashStore()
    for store in (ours, theirs):
        store.set("a", "1")
    assert ours.get("a") == theirs.get("a") == b"1"
    assert ours.add("n", 2) == theirs.add("n", 2) == 2
    assert ours.add("n", 3) == theirs.add("n", 3) == 5
    assert ours.compare_set("c", "", "x") == theirs.compare_set("c", "", "x") == b"x"
    assert ours.compare_set("c", "y", "z") == theirs.compare_set("c", "y", "z") == b"x"
    assert ours.compare_set("c", "x", "z") == theirs.compare_set("c", "x", "z") == b"z"
    assert ours.check(["a", "n"]) and not ours.check(["a", "missing"])
    assert ours.delete_key("a") and not ours.delete_key("a")
    assert ours.num_keys() == 2  # n and c
    prefixed = dist.PrefixStore("world_1", ours)  # c10d joins them with a "/"
    prefixed.set("k", "v")
    assert ours.get("world_1/k") == b"v" and prefixed.clone().get("k") == b"v"


def test_a_wait_that_runs_out_is_torchs_store_timeout_naming_the_key(member):
    store = _store(member, "waits/", seconds=1.0)
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError) as caught:
        store.get("never")
    assert "never" in str(caught.value)
    assert time.monotonic() - began < timing.bound(1.0, 5)
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.5))


def test_a_store_whose_member_is_gone_is_a_network_error_naming_it():
    dead = f"127.0.0.1:{spawn.free_port()}"
    began = time.monotonic()
    with pytest.raises(dist.DistNetworkError) as caught:
        torch_etcd.connect([dead], "", timedelta(seconds=2))
    assert f"{dead}: Connection refused" in str(caught.value)
    assert time.monotonic() - began < timing.bound(2.0, 5)


def test_gloo_makes_a_group_through_it(member):
    """Two ranks as threads: the world group, then a new group, all through etcd."""
    sums: list[float] = []

    def rank(r: int) -> None:
        store = dist.PrefixStore("gloo/", _store(member, "threads/", 60.0))
        group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
        t = torch.tensor([float(r + 1)])
        group.allreduce([t]).wait()
        sums.append(t.item())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timing.guard(60))
    assert sums == [3.0, 3.0]


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

