"""launcher/etcd_nodes.py: what a launcher of ``--store etcd`` does on its way out when the
store is gone (``EtcdNodes.store_unreachable``), and how long its probe for members already up
waits (``EtcdNodes._answers``): endpoints where nothing listens, and a real etcd member on
127.0.0.1 (tests/etcd.py)."""

from __future__ import annotations

import time

import pytest

from tensorplay.distributed.launcher.etcd_nodes import EtcdNodes
from tensorplay.distributed.launcher.roster import NodeFlags
from tensorplay.distributed.launcher.verdicts import Verdict
from tests import etcd, spawn

pytest.importorskip("etcd3gw", reason='the etcd client: pip install -e ".[ha]"')


def _nodes(endpoints: list[str], index: int = 1) -> EtcdNodes:
    flags = NodeFlags(nnodes=3, index=index, nproc=1, host="hostB", addr="127.0.0.1",
                      port=spawn.free_port(), grace_s=3.0, join_timeout_s=10.0, elastic=True,
                      store="etcd", own_addr="127.0.0.1", members=3)
    nodes = EtcdNodes(flags)
    nodes.endpoints = endpoints
    return nodes


def _store_lost(nodes: EtcdNodes, by: int) -> None:
    nodes.verdicts.verdict = Verdict("store", by, "lost the job's store")


def test_its_own_store_verdict_with_no_member_answering_skips_the_store_calls_of_its_way_out():
    base = spawn.free_ports(2)
    dead = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]  # nothing listens there
    nodes = _nodes(dead)
    assert not nodes.store_unreachable()  # the job goes on: no verdict, nothing skipped
    _store_lost(nodes, by=1)
    began = time.monotonic()
    assert nodes.store_unreachable()
    assert nodes.await_others() is False  # at once: no CALL_S per refused call
    assert time.monotonic() - began < 1.5, "the probes are bounded by 1 s, made at once"


@pytest.mark.slow  # starts an etcd daemon
def test_a_member_answering_or_another_nodes_verdict_keeps_the_store_calls():
    with etcd.Member() as member:
        nodes = _nodes([f"127.0.0.1:{spawn.free_port()}", member.endpoint])
        _store_lost(nodes, by=1)
        assert not nodes.store_unreachable()  # a member has a leader again: leave through it
        assert EtcdNodes._answers(nodes.endpoints, time.monotonic() + 60, 1.0,
                                  refused_ends=True)  # one refuses, the other answers
    other = _nodes([f"127.0.0.1:{spawn.free_port()}"])
    _store_lost(other, by=0)  # node 0's verdict, read from the store: it was reachable
    assert not other.store_unreachable()


def test_node_0_of_a_new_job_starts_its_cluster_at_once_where_nothing_listens():
    """The probe for a member already up at --master-addr (``_answers``): every endpoint
    refusing ends it at once for node 0 of a new job; any other probe gives members that
    listen the second they may need to elect a leader."""
    base = spawn.free_ports(2)
    dead = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    far = time.monotonic() + 60
    began = time.monotonic()
    assert not EtcdNodes._answers(dead, far, 1.0, refused_ends=True)
    assert time.monotonic() - began < 0.9
    began = time.monotonic()
    assert not EtcdNodes._answers(dead, far, 0.3)  # the restart's probe: it waits it out
    assert time.monotonic() - began >= 0.3
