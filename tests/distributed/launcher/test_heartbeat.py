"""Launchers of one job watching each other (here all on 127.0.0.1): a frozen node declared lost
at the grace, a dead launcher at once, the ranks told the lost node, node 0 serving the others
to their end; and, in this process, the heartbeat's judgements on an in-memory store
(launcher/heartbeat.py)."""

from __future__ import annotations

import os
import queue
import re
import signal
import time
from pathlib import Path

import pytest

from tensorplay.distributed.launcher import job as _job
from tensorplay.distributed.launcher import keys, store
from tensorplay.distributed.launcher.heartbeat import BEAT_S, DONE, Heartbeat
from tensorplay.distributed.launcher.options import SETTLE_S
from tensorplay.distributed.launcher.roster import Node, NodeChange, NodeFlags, Roster
from tensorplay.distributed.launcher.store import CALL_S, Client
from tensorplay.distributed.launcher.verdicts import Verdict, Verdicts
from tests import timing
from tests.distributed.launcher.memory_store import MemoryStore, client
from tests.distributed.launcher.test_nodes import Nodes, job
from tests.spawn import free_port


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
def test_a_frozen_node_is_declared_lost_and_the_other_node_stops_in_grace_plus_5_s(tmp_path):
    script = job(tmp_path, "print('up', flush=True)\ntime.sleep(120)\n")
    with Nodes(tmp_path, 2, "--nproc-per-node", "2", "--node-grace-s", "3") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script)
        nodes.await_up(4, within_s=60)
        os.killpg(b.pid, signal.SIGSTOP)  # node 1: its launcher and its ranks
        frozen = time.monotonic()
        code = nodes.wait(a, 30)
        took = time.monotonic() - frozen
        os.killpg(b.pid, signal.SIGCONT)  # node 1 wakes, reads the verdict, stops its ranks
        code_b = nodes.wait(b, 30)
        texts = [nodes.text(0), nodes.text(1)]
    assert code == 1 and code_b == 1, texts
    lost = "node 1 (" in texts[0] and ", ranks 2-3) went silent: no heartbeat for "
    assert lost, texts[0]
    assert "s (limit 3 s, --node-grace-s); stopping ranks 0-1 on this node." in texts[0]
    assert "tensorplay-run: the job stopped because node 1 (" in texts[0]
    assert took < timing.bound(3, 5), (took, timing.describe())  # --node-grace-s 3
    # node 1, woken, finds node 0 gone (it was not waited for: it had been declared lost)
    assert ("the job stopped because node 0 (" in texts[1] and "which serves the job's store at "
            f"127.0.0.1:{nodes.port}, is lost: the store " in texts[1]), texts[1]


def _node_1_frozen_while_node_0_waits(tmp: Path, source: str) -> tuple[int | None, str]:
    """Two nodes of 2 ranks run ``source``; once every rank printed "up", node 1 (launcher
    and ranks) is frozen. Returns node 0's exit code and output (grace 3 s)."""
    script = tmp / "job.py"
    script.write_text(source)
    with Nodes(tmp, 2, "--nproc-per-node", "2", "--node-grace-s", "3") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script)
        nodes.await_up(4, within_s=90)
        os.killpg(b.pid, signal.SIGSTOP)
        return nodes.wait(a, 30), nodes.text(0)


WAITS_IN_A_CHECK = '''
import os, time
import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh

dist.init_process_group(timeout=120)
print("up", flush=True)
if dist.get_rank() >= 2:
    time.sleep(5)  # node 1's ranks are frozen here by the test
init_device_mesh("cpu", (2, 2))
'''


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_ranks_waiting_in_a_cross_rank_check_raise_naming_the_lost_node(tmp_path):
    code, text = _node_1_frozen_while_node_0_waits(tmp_path, WAITS_IN_A_CHECK)
    assert code == 1, text
    assert ("RankFailedError: init_device_mesh() (cross-rank check #1) failed: node 1 (" in text
            and ", ranks 2-3) went silent: no heartbeat for " in text), text


WAITS_IN_GLOO = '''
import os, time
import tensorplay.distributed as dist

dist.init_process_group(timeout=120)
print("up", flush=True)
if dist.get_rank() == 0:
    dist.barrier()  # node 1's ranks never come: they are frozen
elif dist.get_rank() == 1:
    dist.new_group([1, 3])  # rank 3's rendezvous never comes
else:
    time.sleep(60)
'''


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_ranks_blocked_in_gloo_barrier_or_group_creation_raise_naming_the_lost_node(tmp_path):
    code, text = _node_1_frozen_while_node_0_waits(tmp_path, WAITS_IN_GLOO)
    assert code == 1, text
    assert ("RankFailedError: barrier() #1 on the world group [0-3] failed: node 1 (" in text
            and "ranks 2-3) went silent: no heartbeat for " in text), text
    assert ("RankFailedError: creating the group [1, 3] (new_group) failed: node 1 (" in text)
    assert "Exception raised from" not in text and "terminate called" not in text


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.warm_ranks
def test_node_0_serves_the_others_after_its_ranks_end_and_ctrl_c_still_stops_it(tmp_path):
    script = job(tmp_path, """
        print('up', flush=True)
        if RANK >= 1:
            time.sleep(60)
    """)
    with Nodes(tmp_path, 2, "--nproc-per-node", "1") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script)
        nodes.await_up(2, within_s=60)
        time.sleep(1.0)  # node 0's rank has ended; its launcher serves node 1's store
        assert a.poll() is None, nodes.text(0)
        a.send_signal(signal.SIGINT)
        code = nodes.wait(a, 20)
        code_b = nodes.wait(b, 30)
        texts = [nodes.text(0), nodes.text(1)]
    assert code == 130, texts
    assert ("tensorplay-run: got SIGINT while the other nodes still used the store this node "
            "serves; stopped serving it.") in texts[0]
    assert code_b == 1 and "which serves the job's store at 127.0.0.1:" in texts[1], texts[1]


CAUGHT_JOB = """
import torch
import tensorplay.distributed as dist
dist.init_process_group(timeout=60)
try:
    print('up', flush=True)
    while True:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
finally:  # as a user's script ends: call counts compared with the others
    dist.destroy_process_group()
"""


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_a_node_whose_launcher_died_is_named_as_a_node_and_node_0_ends_quickly(tmp_path):
    script = job(tmp_path, CAUGHT_JOB)
    with Nodes(tmp_path, 2, "--nproc-per-node", "2") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script)
        nodes.await_up(4, timing.guard(120))
        os.killpg(b.pid, signal.SIGKILL)  # node 1's launcher; its ranks die with it
        killed = time.monotonic()
        code = nodes.wait(a, 60)
        took = time.monotonic() - killed
        text = nodes.text(0)
    assert code not in (0, None), text
    # the loss is seen at once (node 1's connection closed), not after the grace; then the
    # ranks get --settle-s and STOP_FAST_S at most; the end of job waits for no lost rank
    assert took < timing.bound(SETTLE_S + _job.STOP_FAST_S, 3), (took, timing.describe(), text)
    assert re.fullmatch(r"tensorplay-run: the job stopped because node 1 \([^,()]+, ranks 2-3\) "
                        r"is lost: its launcher is gone \(its connection to node 0 closed "
                        r"without a goodbye\)\.", text.strip().splitlines()[-1]), text
    assert "not compared" not in text, text  # ranks 2-3 were lost: nothing was late


def _heartbeat(index: int, raw: MemoryStore | None = None, port: int = 1,
               elastic: bool = False, grace_s: float = 10.0) -> Heartbeat:
    """Node ``index`` of 2 nodes of 1 rank; its clients are of ``raw`` (None: connect to
    127.0.0.1:``port`` for real); a bug fails the test."""
    flags = NodeFlags(nnodes=2, index=index, nproc=1, host="hostA", addr="127.0.0.1",
                      port=port, grace_s=grace_s, join_timeout_s=5.0, elastic=elastic)
    roster = Roster(2, 1)
    roster.nodes = {0: Node(0, "hostA", 1, 2), 1: Node(1, "hostB", 1, 2)}

    def connect() -> Client:
        if raw is not None:
            return client(raw)
        return store.connect("127.0.0.1", port, time.monotonic() + CALL_S, CALL_S)

    def on_bug(where: str, err: BaseException) -> None:
        pytest.fail(f"a bug in {where}: {err!r}")

    return Heartbeat(flags, roster, Verdicts(index), connect, on_bug)


def test_a_node_refused_by_the_store_declares_node_0_lost_without_waiting_the_grace():
    port = free_port()  # nobody listens: node 0's launcher is gone
    beat = _heartbeat(1, port=port, grace_s=60.0)
    decided: queue.SimpleQueue[Verdict] = queue.SimpleQueue()
    beat.verdicts.on_verdict = decided.put
    start = time.monotonic()
    beat.start(1, lambda change: None)
    try:
        verdict = decided.get(timeout=timing.guard(30))
    finally:
        beat.stop()
    took = time.monotonic() - start
    assert verdict == Verdict("lost", 1, f"node 0 (hostA, rank 0), which serves the job's store "
                                         f"at 127.0.0.1:{port}, is lost: the store refused the "
                                         f"connection: its launcher is gone", 0)
    assert took < timing.bound(BEAT_S + CALL_S, 3), (took, timing.describe())  # not 60 s


def test_a_launcher_gone_is_a_verdict_or_in_elastic_mode_news_unless_it_had_finished():
    raw = MemoryStore()
    beat = _heartbeat(0, raw)
    beat.launcher_gone(1, 1)
    assert beat.verdicts.verdict == Verdict(
        "lost", 0, "node 1 (hostB, rank 1) is lost: its launcher is gone (its connection to "
                   "node 0 closed without a goodbye)", 1)

    raw = MemoryStore()
    elastic = _heartbeat(0, raw, elastic=True)
    changes: list[NodeChange] = []
    elastic.start(1, changes.append)
    try:
        elastic.launcher_gone(1, 2)  # not the claim that holds node 1: nothing
        elastic.launcher_gone(1, 1)
    finally:
        elastic.stop()
    assert elastic.verdicts.verdict is None and [(c.kind, c.node, c.claim) for c in changes] \
        == [("lost", 1, 1)]
    assert elastic.roster.lost == {1}
    assert NodeChange.loads(raw.kv[keys.NODE_NEWS_ITEM.format(n=1)]) == changes[0]

    raw = MemoryStore()
    done = _heartbeat(0, raw)
    raw.kv[keys.NODE_BEAT.format(node=1, claim=1)] = str(DONE + 5).encode()
    done.launcher_gone(1, 1)  # it had finished: a goodbye lost on the way
    assert done.verdicts.verdict is None


def test_node_0_waits_for_the_others_to_finish_and_names_its_own_store_if_that_fails():
    raw = MemoryStore()
    beat = _heartbeat(0, raw)
    client(raw).add(keys.NODE_BEAT.format(node=1, claim=1), DONE)
    assert beat.await_others(client(raw), lambda: False) is True

    raw.kill()
    assert beat.await_others(client(raw), lambda: False) is False
    assert beat.verdicts.verdict == Verdict(
        "store", 0, "this node's own store at 127.0.0.1:1 failed while it waited for the other "
                    "nodes to finish (Connection reset by peer)")


def test_a_bug_while_node_0_waits_for_the_others_is_raised_not_taken_for_a_failed_job():
    raw = MemoryStore()
    raw.broken["add"] = KeyError("tensorplay-run/beat/1/1")
    with pytest.raises(KeyError):
        _heartbeat(0, raw).await_others(client(raw), lambda: False)
