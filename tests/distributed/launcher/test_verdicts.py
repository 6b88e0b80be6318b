"""The one verdict of a job across nodes (here all on 127.0.0.1): a failure on one node stops the
others, and a node whose first failure is a consequence lets the cause's node post first;
in this process, the first verdict posted wins (launcher/verdicts.py)."""

from __future__ import annotations

import pytest

from tensorplay.distributed.launcher.verdicts import Verdict, Verdicts
from tests.distributed.launcher.memory_store import MemoryStore, client
from tests.distributed.launcher.test_nodes import Nodes, job


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
def test_a_failure_on_one_node_stops_the_other_nodes_ranks(tmp_path):
    script = job(tmp_path, """
        if RANK == 3:
            sys.exit(3)
        print('up', flush=True)
        time.sleep(120)
    """)
    with Nodes(tmp_path, 2, "--nproc-per-node", "2") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script)
        codes = [nodes.wait(a, 60), nodes.wait(b, 60)]
        texts = [nodes.text(0), nodes.text(1)]
    assert codes == [1, 3], texts
    assert "rank 3 failed first (exit code 3); stopped rank 2." in texts[1]
    if "up" in texts[0]:  # node 0 had started its ranks when node 1's verdict came
        assert "ranks 0-1 had not finished their script (stopped)." in texts[0], texts[0]
        assert "tensorplay-run: the job stopped because node 1 (" in texts[0]
    else:  # rank 3 failed so fast that node 0 was still meeting the others: no rank started
        assert "tensorplay-run: error: node 1 (" in texts[0], texts[0]
    assert ") failed: rank 3: exit code 3." in texts[0]


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_a_node_whose_first_failure_is_a_consequence_names_the_cause_on_the_other_node(tmp_path):
    # node 0's rank 0 raises RankFailedError (a peer died: a consequence) as soon as both ranks
    # run; node 1's rank 1 then exits with code 3 (the cause), which node 1 posts. Node 0 waits
    # for that verdict instead of posting its own consequence first
    script = job(tmp_path, """
        from pathlib import Path
        here = Path(__file__).parent
        (here / f"up_{RANK}").write_text("")
        while len(list(here.glob("up_*"))) < 2:
            time.sleep(0.02)
        if RANK == 0:
            (here / "raised").write_text("")
            from tensorplay.distributed.errors import RankFailedError
            raise RankFailedError("all_reduce() failed: a peer on another host died")
        while not (here / "raised").exists():
            time.sleep(0.02)
        sys.exit(3)
    """)
    with Nodes(tmp_path, 2, "--nproc-per-node", "1") as nodes:
        a, b = nodes.start(0, script), nodes.start(1, script, "--settle-s", "0")
        codes = [nodes.wait(a, 60), nodes.wait(b, 60)]
        texts = [nodes.text(0), nodes.text(1)]
    assert codes == [1, 3], texts
    assert "rank 1 failed first (exit code 3)" in texts[1], texts[1]
    assert texts[0].strip().splitlines()[-1].startswith(
        "tensorplay-run: the job stopped because node 1 ("), texts[0]
    assert ") failed: rank 1: exit code 3." in texts[0], texts[0]


def test_verdicts_travel_as_json():
    verdict = Verdict("lost", 0, "node 1 (hostB, ranks 4-7) went silent")
    assert Verdict.loads(verdict.dumps()) == verdict


def test_the_first_verdict_posted_stands_for_every_launcher():
    raw = MemoryStore()
    first, second = Verdicts(1), Verdicts(0)
    mine = first.post(client(raw), "failed", "node 1 (hostB) failed: rank 3: exit code 3")
    theirs = second.post(client(raw), "lost", "node 1 (hostB, ranks 2-3) went silent", lost=1)
    assert theirs == mine == Verdict("failed", 1, "node 1 (hostB) failed: rank 3: exit code 3")
    assert Verdicts(0).await_verdict(client(raw), 0.0) == mine


def test_a_launcher_that_cannot_reach_the_store_keeps_its_own_word():
    raw = MemoryStore()
    raw.kill()
    alone = Verdicts(1)
    assert alone.post(client(raw), "failed", "node 1 failed") == Verdict("failed", 1,
                                                                          "node 1 failed")
    assert Verdicts(1).post(None, "bug", "no client") == Verdict("bug", 1, "no client")
    assert Verdicts(0).await_verdict(client(raw), 5.0) is None  # at once: nobody else will say
