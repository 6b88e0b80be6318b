"""Elastic jobs across hosts: a host lost, the job goes on; the host started again, the mesh
grows back (network namespaces, tests/netns.py).

The (2, 4) "dp" x "tp" job of examples/train_elastic.py, elastic on "dp", runs under one
`tensorplay-run --max-restarts 1` per host (node 0 on host A serves the store). Every wait is
bounded by what the test configured plus a margin scaled to the machine's speed
(tests/timing.py); every process started is killed by pid and every namespace deleted on the
way out (netns.Hosts).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tests import netns, spawn, timing

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PORT = "29519"
GRACE_S = 10.0  # --node-grace-s's default: the hidden two-host case runs with the defaults
EXAMPLE = str(ROOT / "examples" / "train_elastic.py")


def _argv(hosts: netns.Hosts, node: int, script: list[str]) -> list[str]:
    return [sys.executable, "-m", "tensorplay.distributed.run", "--nnodes", str(hosts.count),
            "--node-rank", str(node), "--nproc-per-node", "4", "--max-restarts", "1",
            "--master-addr", hosts.address(1), "--master-port", PORT, *script]


def _start(hosts: netns.Hosts, node: int, script: list[str], log: Path) -> None:
    hosts.start(node + 1, _argv(hosts, node, script), log,
                env={"PYTHONPATH": spawn.pythonpath()})


def _kill_whole(pid: int) -> None:
    """SIGKILL a launcher and everything below it (its ranks, its warm process): a host
    lost whole, as a kernel panic leaves it (pids this test started, found through /proc)."""
    for p in [pid, *procfs.descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _kill_host_b_after_step_3(hosts: netns.Hosts, script: list[str], logs: dict[str, Path]
                              ) -> float:
    """Start the job on hosts A and B, kill host B whole once rank 0 did its third step; the
    time.monotonic() of the kill."""
    _start(hosts, 0, script, logs["hostA"])
    _start(hosts, 1, script, logs["hostB"])
    netns.await_line(logs["hostA"], r"^\[rank 0\] step 3/", hosts, timing.guard(240))
    killed = time.monotonic()
    _kill_whole(hosts.procs[1].pid)
    return killed


def test_a_host_killed_whole_the_other_trains_on_and_its_replacement_grows_the_mesh_back(
        tmp_path):
    netns.require()
    script = [EXAMPLE, "--steps", "8", "--step-s", "0.5", "--wait-full-s",
              str(timing.guard(240)), "--verbose"]
    logs = {name: tmp_path / f"{name}.log" for name in ("hostA", "hostB", "hostB-again")}
    with netns.Hosts(2) as hosts:
        killed = _kill_host_b_after_step_3(hosts, script, logs)
        shrunk = netns.await_line(logs["hostA"], r"^\[rank 0\] step \d+/8  mesh \(1, 4\)", hosts,
                             timing.guard(120))
        _start(hosts, 1, script, logs["hostB-again"])
        netns.await_line(logs["hostA"], r"mesh grew back to \(2, 4\)", hosts, timing.guard(240))
        codes = hosts.wait_all(timeout=timing.guard(180))
        text = netns.logs(tmp_path)
    a, again = logs["hostA"].read_text(), logs["hostB-again"].read_text()
    assert codes == [0, -signal.SIGKILL, 0], f"{codes}\n{text}"
    assert shrunk - killed < timing.bound(GRACE_S, 5), \
        f"{shrunk - killed:.1f} s ({timing.describe()})\n{text}"
    assert "[rank 0] OK: matches single-process training" in a, text
    assert ("tensorplay-run: node 1 (hostB, ranks 4-7) is lost: its launcher is gone" in a), a
    assert "elastic mode: ranks 0-3 on this node go on without its ranks 4-7." in a, a
    assert "tensorplay-run: this launcher takes back node 1, which the job declared lost" \
        in again, again
    assert re.search(r"^\[rank [4-7]\] rank [4-7] restarted at .* joined the mesh \(2, 4\)",
                     again, re.MULTILINE), again


def test_a_host_lost_below_elastic_min_ends_every_process_promptly_naming_it(tmp_path):
    netns.require()
    script = [EXAMPLE, "--steps", "40", "--step-s", "0.5", "--min-replicas", "2"]
    logs = {name: tmp_path / f"{name}.log" for name in ("hostA", "hostB")}
    with netns.Hosts(2) as hosts:
        killed = _kill_host_b_after_step_3(hosts, script, logs)
        code = hosts.procs[0].wait(timeout=timing.guard(120))
        took = time.monotonic() - killed
        text = netns.logs(tmp_path)
    a = logs["hostA"].read_text()
    assert code != 0, text
    assert took < timing.bound(GRACE_S, 10), f"{took:.1f} s ({timing.describe()})\n{text}"
    assert ("ShrinkError: mesh dim 'dp' would keep 1 of its 2 slices, below its minimum of 2: "
            "lost ranks 4-7 (host hostB) in slice 1") in a, a
    last = a.strip().splitlines()[-1]
    assert last.startswith("tensorplay-run: the job stopped after node 1 (hostB, ranks 4-7) "
                           "is lost: its launcher is gone"), a


CUT_GRACE_S = 3  # TENSORPLAY_NODE_GRACE_S here: a cut link is judged by the heartbeat alone


def test_a_host_cut_off_stops_itself_and_the_other_host_trains_on_to_the_end(tmp_path):
    netns.require()
    script = [EXAMPLE, "--steps", "8", "--step-s", "0.5"]  # as the frozen host's case: the
    # cut lands in step 4, which no rank ends before the recovery; steps 4-8 on (1, 4)
    logs = {name: tmp_path / f"{name}.log" for name in ("hostA", "hostB")}
    with netns.Hosts(2) as hosts:
        for node in (0, 1):
            hosts.start(node + 1, _argv(hosts, node, script), logs[f"host{'AB'[node]}"],
                        env={"PYTHONPATH": spawn.pythonpath(),
                             "TENSORPLAY_NODE_GRACE_S": str(CUT_GRACE_S)})
        netns.await_line(logs["hostA"], r"^\[rank 0\] step 3/8", hosts, timing.guard(240))
        cut = time.monotonic()
        hosts.cut(2)
        shrunk = netns.await_line(logs["hostA"], r"^\[rank 0\] step \d+/8  mesh \(1, 4\)", hosts,
                             timing.guard(120))
        codes = hosts.wait_all(timeout=timing.guard(180))
        text = netns.logs(tmp_path)
    a, b = logs["hostA"].read_text(), logs["hostB"].read_text()
    assert codes[0] == 0 and codes[1] not in (0, None), f"{codes}\n{text}"
    assert shrunk - cut < timing.bound(CUT_GRACE_S, 8), \
        f"{shrunk - cut:.1f} s ({timing.describe()})\n{text}"
    assert "[rank 0] OK: matches single-process training" in a, text
    assert "tensorplay-run: node 1 (hostB, ranks 4-7) is lost: went silent: no heartbeat for" \
        in a, a
    assert "tensorplay-run: this node, node 1 (hostB, ranks 4-7), lost the job's store at " \
        "198.18.0.1:" in b, b
    assert "to rejoin as a replacement" in b.strip().splitlines()[-1], b


def test_a_frozen_host_is_declared_lost_after_the_grace_and_the_other_trains_on(tmp_path):
    """Host B frozen whole (SIGSTOP to its launcher and ranks: a hung kernel, a machine that
    stops answering but closes nothing): node 0's launcher declares it lost when its heartbeat
    has been silent for the grace, host A's ranks shrink to (1, 4) and train to the end.
    Woken after host A ended, host B's launcher finds the job gone and stops its ranks."""
    netns.require()
    script = [EXAMPLE, "--steps", "8", "--step-s", "0.5"]
    logs = {name: tmp_path / f"{name}.log" for name in ("hostA", "hostB")}
    env = {"PYTHONPATH": spawn.pythonpath(), "TENSORPLAY_NODE_GRACE_S": str(CUT_GRACE_S)}
    with netns.Hosts(2) as hosts:
        for node in (0, 1):
            hosts.start(node + 1, _argv(hosts, node, script), logs[f"host{'AB'[node]}"], env=env)
        netns.await_line(logs["hostA"], r"^\[rank 0\] step 3/8", hosts, timing.guard(240))
        frozen = [hosts.procs[1].pid, *procfs.descendants(hosts.procs[1].pid)]
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        shrunk = netns.await_line(logs["hostA"], r"^\[rank 0\] step \d+/8  mesh \(1, 4\)", hosts,
                             timing.guard(120))
        code_a = hosts.procs[0].wait(timeout=timing.guard(180))
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        codes = hosts.wait_all(timeout=timing.guard(60))
        text = netns.logs(tmp_path)
    a, b = logs["hostA"].read_text(), logs["hostB"].read_text()
    assert code_a == 0 and codes[1] not in (0, None), f"{codes}\n{text}"
    assert shrunk - stopped < timing.bound(CUT_GRACE_S, 8), \
        f"{shrunk - stopped:.1f} s ({timing.describe()})\n{text}"
    assert "[rank 0] OK: matches single-process training" in a, text
    assert "tensorplay-run: node 1 (hostB, ranks 4-7) is lost: went silent: no heartbeat for" \
        in a, a
    assert "elastic mode: ranks 0-3 on this node go on without its ranks 4-7." in a, a
    assert "tensorplay-run: this node, node 1 (hostB, ranks 4-7), lost the job's store at " \
        "198.18.0.1:" in b, b


def test_a_host_lost_during_a_recovery_costs_nothing_more_and_the_rest_train_on(tmp_path):
    """Four hosts of 2 ranks: slice 0 of the (2, 4) mesh on hosts A and B, slice 1 on C and D.
    Rank 4 (host C) dies at its step 4; as soon as host C's launcher says so, host D is lost
    whole, while the survivors recover from rank 4's loss (they notice it at their next
    collective, up to one step later). The recovery counts ranks 6-7 lost too (or the next
    one drops nothing more: slice 1 is out already), and hosts A and B train on (1, 4) to the
    end; the ranks left on host C end as ranks outside the mesh, cleanly."""
    netns.require()
    script = [EXAMPLE, "--steps", "7", "--step-s", "0.5", "--kill", "4@3"]
    names = ("hostA", "hostB", "hostC", "hostD")
    logs = {name: tmp_path / f"{name}.log" for name in names}
    with netns.Hosts(4) as hosts:
        for node in range(4):
            argv = _argv(hosts, node, script)
            argv[argv.index("--nproc-per-node") + 1] = "2"
            hosts.start(node + 1, argv, logs[names[node]],
                        env={"PYTHONPATH": spawn.pythonpath()})
        netns.await_line(logs["hostC"],
                         r"^tensorplay-run: rank 4 lost \(killed by signal SIGKILL\)", hosts,
                         timing.guard(240))
        _kill_whole(hosts.procs[3].pid)
        codes = hosts.wait_all(timeout=timing.guard(180))
        text = netns.logs(tmp_path)
    a = logs["hostA"].read_text()
    assert codes[:2] == [0, 0] and codes[3] == -signal.SIGKILL, f"{codes}\n{text}"
    assert codes[2] == 0, f"{codes}\n{text}"
    assert "[rank 0] OK: matches single-process training" in a, text
    assert re.search(r"^\[rank 0\] step 7/7  mesh \(1, 4\)", a, re.MULTILINE), a
    assert "tensorplay-run: node 3 (hostD, ranks 6-7) is lost: its launcher is gone" in a, a
