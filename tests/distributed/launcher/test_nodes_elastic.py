"""Launchers of one elastic job (--max-restarts) on several nodes, here all on 127.0.0.1: a node
whose launcher died is lost at once and the job goes on; a new launcher takes the node back;
a second claim of a live node is still refused (launcher/join.py, heartbeat.py, links.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests import timing
from tests.distributed.launcher.test_nodes import Nodes, job

pytestmark = [pytest.mark.slow, pytest.mark.faults]  # launchers that load torch
GRACE_S = 30  # far longer than the test's bounds: a loss seen sooner was not the heartbeat's

# every rank says "up" with what its launcher told it, then runs until the file "stop" (beside
# the script) exists;
# node 0's rank then prints the launcher's losses file
BODY = """
from pathlib import Path
stop = Path(__file__).parent / "stop"
print(f"up rank {RANK} restart {os.environ.get('TENSORPLAY_RESTART_COUNT', '0')} instance "
      f"{os.environ.get('TENSORPLAY_NODE_INSTANCE')}", flush=True)
while not stop.exists():
    time.sleep(0.1)
losses = os.environ.get("TENSORPLAY_RUN_LOSSES_FILE")
if RANK == 0 and losses and Path(losses).exists():
    print("losses " + Path(losses).read_text(), flush=True)
"""


def _await(nodes: Nodes, i: int, text: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while text not in nodes.text(i):
        assert time.monotonic() < deadline, (text, timing.describe(),
                                             [nodes.text(k) for k in range(len(nodes.logs))])
        assert nodes.procs[0].poll() is None, [nodes.text(k) for k in range(len(nodes.logs))]
        time.sleep(0.1)


def test_a_node_whose_launcher_died_is_lost_at_once_and_a_new_launcher_takes_it_back(tmp_path):
    script, stop = job(tmp_path, BODY), tmp_path / "stop"
    env = {"TENSORPLAY_NODE_GRACE_S": str(GRACE_S)}
    with Nodes(tmp_path, 2, "--nproc-per-node", "1", "--max-restarts", "1") as nodes:
        nodes.start(0, script, env=env)
        first = nodes.start(1, script, env=env)
        nodes.await_up(2, timing.guard(120))
        os.killpg(first.pid, signal.SIGKILL)  # node 1's launcher; its rank dies with it
        killed = time.monotonic()
        _await(nodes, 0, "tensorplay-run: node 1 (", timing.guard(60))
        seen = time.monotonic() - killed
        again = nodes.start(1, script, env=env)
        _await(nodes, 2, "up rank 1 restart 1 instance 1.2", timing.guard(120))
        _await(nodes, 0, "node 1 is back: a new launcher on ", timing.guard(30))  # read at its
        stop.touch()  # next beat
        codes = [nodes.wait(p, 120) for p in (nodes.procs[0], again)]
        texts = [nodes.text(i) for i in range(3)]
    assert seen < GRACE_S, (seen, timing.describe(), texts)  # not the heartbeat's verdict
    assert codes == [0, 0], f"{codes}\n" + "\n----\n".join(texts)
    assert first.returncode == -signal.SIGKILL
    a = texts[0]
    assert "up rank 0 restart 0 instance 0.1" in a, a
    assert (", rank 1) is lost: its launcher is gone (its connection to node 0 closed without "
            "a goodbye); elastic mode: rank 0 on this node goes on without its rank 1.") in a, a
    assert "node 1 is back: a new launcher on " in a, a
    assert "its ranks join the elastic mesh at the members' next grow()." in a, a
    losses = json.loads(a.split("losses ", 1)[1].splitlines()[0])
    assert [(x["node"], x["claim"], x["ranks"], x["replaced"]) for x in losses] == \
        [(1, 1, [1], True)], losses
    assert a.strip().splitlines()[-1].startswith("tensorplay-run: elastic: node 1 ("), a
    assert "(taken back by a new launcher); the job went on to its end." in a, a
    assert "this launcher takes back node 1, which the job declared lost" in texts[2], texts[2]


def test_a_second_claim_of_a_live_node_is_refused_after_the_grace_and_the_job_goes_on(tmp_path):
    script, stop = job(tmp_path, BODY), tmp_path / "stop"
    # the refusal comes after the grace; a short one on a loaded machine declares live nodes
    # lost (a store call takes seconds there), so it grows with the machine's slowness
    env = {"TENSORPLAY_NODE_GRACE_S": f"{max(4.0, 2.5 * timing.factor()):.1f}"}
    with Nodes(tmp_path, 2, "--nproc-per-node", "1", "--max-restarts", "1") as nodes:
        nodes.start(0, script, env=env)
        nodes.start(1, script, env=env)
        nodes.await_up(2, timing.guard(120))
        dup = nodes.start(1, script, env=env)
        code = nodes.wait(dup, 120)
        stop.touch()
        codes = [nodes.wait(p, 120) for p in nodes.procs[:2]]
        texts = [nodes.text(i) for i in range(3)]
    assert code == 1, texts
    assert "tensorplay-run: error: node 1 was claimed twice (--node-rank 1 on " in texts[2]
    assert "is alive: the job goes on without this launcher." in texts[2], texts[2]
    assert codes == [0, 0], f"{codes}\n" + "\n----\n".join(texts)
    assert "up rank" not in texts[2], texts[2]
