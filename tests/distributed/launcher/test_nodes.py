"""Launchers of one job on several nodes (here all on 127.0.0.1): checks at join, heartbeats,
a failure on one node stopping the others, and the store served by node 0's launcher."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tensorplay.distributed import _keys
from tensorplay.distributed.launcher import job as _job
from tensorplay.distributed.launcher import nodes as _nodes
from tensorplay.distributed.launcher import store
from tensorplay.distributed.launcher.options import SETTLE_S
from tensorplay.distributed.launcher.store import Client
from tests import spawn, timing
from tests.distributed.launcher.memory_store import MemoryStore
from tests.spawn import free_port

LAUNCHER = [sys.executable, "-m", "tensorplay.distributed.run"]


class Nodes:
    """Launchers started by a test, each writing to its own log; all killed (by pid) at exit."""

    def __init__(self, tmp: Path, nnodes: int, *flags: str):
        self.tmp, self.nnodes, self.flags = tmp, nnodes, flags
        self.port = str(free_port())
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, node_rank: int, script: Path, *extra: str,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.tmp / f"node{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*LAUNCHER, "--nnodes", str(self.nnodes), "--node-rank", str(node_rank),
                 "--master-addr", "127.0.0.1", "--master-port", self.port, *self.flags, *extra,
                 str(script)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": spawn.pythonpath(), "OMP_NUM_THREADS": "1",
                     **(env or {})})
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float) -> int | None:
        """Its exit code, or None if it has not exited within ``timeout`` (a hang guard:
        scaled on a busy machine)."""
        try:
            return proc.wait(timeout=timing.guard(timeout))
        except subprocess.TimeoutExpired:
            return None

    def text(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def await_up(self, ranks: int, within_s: float) -> None:
        """Return once ``ranks`` ranks in all have printed "up" (fail after ``within_s``)."""
        deadline = time.monotonic() + within_s
        while sum(self.text(i).count("up") for i in range(len(self.logs))) < ranks:
            assert time.monotonic() < deadline, [self.text(i) for i in range(len(self.logs))]
            time.sleep(0.1)

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:  # the launcher's group: itself and its ranks
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            proc.wait(timeout=30)


def job(tmp: Path, body: str) -> Path:
    path = tmp / "job.py"
    path.write_text("import os, signal, sys, time\nRANK = int(os.environ['RANK'])\n"
                    + textwrap.dedent(body))
    return path


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


PLAIN_TORCH = '''
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
if dist.get_rank() == 0:
    store.wait(["joined"])  # rank 1 is past init (gloo's connections made): then rank 0
    os._exit(0)  # leaves at once; under tensorplay-run it does not serve the store
store.set("joined", "1")
time.sleep(1.0)
store.set("after", "rank 0 left")
print("store still served:", store.get("after").decode(), flush=True)
'''


@pytest.mark.slow  # starts launchers that load torch
@pytest.mark.warm_ranks
def test_the_launcher_serves_the_store_so_it_outlives_rank_0(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TORCH)
    try:
        res = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", str(script)],
                             capture_output=True, text=True, timeout=timing.guard(120),
                             env={**os.environ, "PYTHONPATH": spawn.pythonpath()})
    except subprocess.TimeoutExpired as hung:  # seen once under load: say what it printed
        pytest.fail(f"the job ran past {hung.timeout:.0f} s ({timing.describe()});\n"
                    f"stdout: {hung.stdout!r}\nstderr: {hung.stderr!r}")
    assert res.returncode == 0, res.stderr
    assert "[rank 1] store still served: rank 0 left" in res.stdout


def test_verdicts_travel_as_json():
    verdict = _nodes.Verdict("lost", 0, "node 1 (hostB, ranks 4-7) went silent")
    assert _nodes.Verdict.loads(verdict.dumps()) == verdict
    assert _nodes.Node(1, "hostB", 4, 2).name() == "node 1 (hostB, ranks 4-7)"
    assert _nodes.Node(2, "hostC", 1, 3).name() == "node 2 (hostC, rank 2)"


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


def test_a_bug_in_the_heartbeat_thread_is_said_on_stderr_and_stops_the_job_on_every_node(
        monkeypatch, capfd):
    raw = MemoryStore()
    raw.broken["add"] = ZeroDivisionError("division by zero")  # node 1's beat is an add
    monkeypatch.setattr(store, "connect", lambda *args: Client(raw))
    board = _nodes.Board(nnodes=2, node_rank=1, nproc=1, host="hostB", addr="127.0.0.1",
                         port=1, grace_s=10.0, join_timeout_s=5.0)
    verdicts: queue.SimpleQueue[_nodes.Verdict] = queue.SimpleQueue()
    board.watch(verdicts.put)
    try:
        verdict = verdicts.get(timeout=timing.guard(30))
    finally:
        board.close()
    err = capfd.readouterr().err
    assert err.startswith("tensorplay-run: internal error in the heartbeat: Traceback (most "
                          "recent call last):"), err
    assert err.rstrip().endswith("ZeroDivisionError: division by zero"), err
    assert err.count("internal error") == 1, err  # said once
    assert verdict == _nodes.Verdict(
        "bug", 1, "node 1 (hostB, rank 1)'s launcher failed: internal error in the heartbeat "
                  "(ZeroDivisionError: division by zero; traceback above)")
    assert _nodes.Verdict.loads(raw.kv[_keys.NODES_VERDICT]) == verdict  # the others stop too
    assert verdicts.empty()
