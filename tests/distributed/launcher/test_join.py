"""Launchers of one job meeting in its store (here all on 127.0.0.1): a node index claimed
twice, flags that differ, a node that never arrives and a missing node 0 are each one verdict
every launcher prints, naming the nodes, before any rank starts (launcher/join.py)."""

from __future__ import annotations

import time

import pytest

from tensorplay.distributed.launcher import join
from tests import spawn, timing
from tests.distributed.launcher.test_nodes import Nodes, job


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
def test_nodes_that_disagree_on_nproc_per_node_all_fail_naming_each_node(tmp_path):
    script = job(tmp_path, "print('ran')\n")
    with Nodes(tmp_path, 2) as nodes:
        a = nodes.start(0, script, "--nproc-per-node", "2")
        b = nodes.start(1, script, "--nproc-per-node", "1")
        codes = [nodes.wait(a, 60), nodes.wait(b, 60)]
        texts = [nodes.text(0), nodes.text(1)]
    assert codes == [1, 1], texts
    for text in texts:
        assert ("tensorplay-run: error: nodes disagree on --nproc-per-node: node 0 (") in text
        assert ") 2, node 1 (" in text and ") 1. Fix: pass the same --nproc-per-node on every " \
                                           "node." in text
        assert "ran" not in text  # no rank started


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_a_node_index_claimed_twice_fails_every_launcher_naming_it(tmp_path):
    script = job(tmp_path, "print('ran')\n")
    with Nodes(tmp_path, 3, "--nproc-per-node", "1", "--join-timeout-s", "60") as nodes:
        first = [nodes.start(0, script), nodes.start(1, script)]
        time.sleep(3)  # both have claimed; node 2 never comes, so the job cannot start
        dup = nodes.start(1, script)
        codes = [nodes.wait(p, 60) for p in [*first, dup]]
        texts = [nodes.text(i) for i in range(3)]
    assert codes == [1, 1, 1], texts
    for text in texts:
        assert "tensorplay-run: error: node 1 was claimed twice (--node-rank 1 on " in text, text
        assert "Fix: give each machine its own --node-rank in 0..2." in text


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_a_node_that_never_arrives_is_named_within_the_join_timeout(tmp_path):
    script = job(tmp_path, "print('ran')\n")
    with Nodes(tmp_path, 2, "--nproc-per-node", "1", "--join-timeout-s", "3") as nodes:
        start = time.monotonic()
        code = nodes.wait(nodes.start(0, script), 60)
        took = time.monotonic() - start
        text = nodes.text(0)
    assert code == 1, text
    assert "tensorplay-run: error: node 1 never arrived within 3 s (arrived: 0 (" in text, text
    assert ("Fix: start tensorplay-run with --node-rank 1 on its machine, or pass --nnodes 1."
            in text)
    assert took < timing.bound(3, 17), (took, timing.describe())  # --join-timeout-s 3


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
def test_without_node_0_the_others_say_so_without_a_cpp_trace(tmp_path):
    script = job(tmp_path, "print('ran')\n")
    with Nodes(tmp_path, 2, "--nproc-per-node", "1", "--join-timeout-s", "2") as nodes:
        code = nodes.wait(nodes.start(1, script), 60)
        text = nodes.text(0)
    assert code == 1, text
    assert (f"tensorplay-run: error: node 0 (the job's store at 127.0.0.1:{nodes.port}) never "
            f"answered within 2 s (Connection refused).") in text, text
    assert "Exception raised from" not in text and "frame #" not in text


def test_a_refusal_with_no_store_to_tell_says_node_0_waits():
    port = spawn.free_port()
    said = join.refuse("127.0.0.1", port, 1, "node 1 refused to join: --node-rank=0", 0.3)
    assert said.startswith(f"node 0's store at 127.0.0.1:{port} was not reached within 0.3 s (")
    assert said.endswith("node 0 waits for this node until its --join-timeout-s")
    assert join.refuse("h", None, 1, "x") == ("node 0 cannot be told (no --master-port): it "
                                              "waits --join-timeout-s")
