"""Launchers of one job on several nodes (here all on 127.0.0.1), as ``JobNodes`` ties them: the
helpers the other multi-node tests use (``Nodes``, ``job``), the store served by the launcher
so that it outlives rank 0, and a bug in a launcher thread said on stderr and stopping the job
(launcher/nodes.py). The join, the heartbeat and the verdicts have files of their own."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tensorplay.distributed.launcher import keys, store
from tensorplay.distributed.launcher.nodes import JobNodes
from tensorplay.distributed.launcher.roster import NodeFlags
from tensorplay.distributed.launcher.verdicts import Verdict
from tests import spawn, timing
from tests.distributed.launcher.memory_store import MemoryStore, client
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
                     "TMPDIR": str(self.tmp), **(env or {})})  # a launcher killed here
                # leaves its work directory in the test's tmp_path, not in /tmp
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


def test_a_bug_in_the_heartbeat_thread_is_said_on_stderr_and_stops_the_job_on_every_node(
        monkeypatch, capfd):
    raw = MemoryStore()
    raw.broken["add"] = ZeroDivisionError("division by zero")  # node 1's beat is an add
    monkeypatch.setattr(store, "connect", lambda *args: client(raw))
    nodes = JobNodes(NodeFlags(nnodes=2, index=1, nproc=1, host="hostB", addr="127.0.0.1",
                               port=1, grace_s=10.0, join_timeout_s=5.0, elastic=False))
    verdicts: queue.SimpleQueue[Verdict] = queue.SimpleQueue()
    nodes.watch(verdicts.put)
    try:
        verdict = verdicts.get(timeout=timing.guard(30))
    finally:
        nodes.close()
    err = capfd.readouterr().err
    assert err.startswith("tensorplay-run: internal error in the heartbeat: Traceback (most "
                          "recent call last):"), err
    assert err.rstrip().endswith("ZeroDivisionError: division by zero"), err
    assert err.count("internal error") == 1, err  # said once
    assert verdict == Verdict("bug", 1, "node 1 (hostB, rank 1)'s launcher failed: internal "
                                        "error in the heartbeat (ZeroDivisionError: division by "
                                        "zero; traceback above)")
    assert Verdict.loads(raw.kv[keys.NODES_VERDICT]) == verdict  # posted: the others stop too
    assert verdicts.empty()
