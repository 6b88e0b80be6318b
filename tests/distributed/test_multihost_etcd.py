"""Every host equal: three hosts under ``tensorplay-run --store etcd`` (network namespaces,
tests/netns.py), where node 0 is just another host to lose.

The job is examples/train_elastic.py on a (3, 4) "dp" x "tp" mesh, elastic on "dp", one
launcher of 4 ranks per host with --max-restarts 1; the launchers of the three hosts each run
one etcd member of the job's store. Each host has its own TMPDIR, so the members' data is
checked gone at the end. Every wait is bounded by what the test configured plus a margin
scaled to the machine's speed (tests/timing.py); every process started is killed by pid and
every namespace deleted on the way out (netns.Hosts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tests import etcd, netns, spawn, timing

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PORT = "29539"
GRACE_S = 3.0  # TENSORPLAY_NODE_GRACE_S: a frozen or cut-off host is judged by its lease alone
EXAMPLE = str(ROOT / "examples" / "train_elastic.py")
NAMES = ("hostA", "hostB", "hostC")


def _start(hosts: netns.Hosts, node: int, script: list[str], log: Path, tmp: Path,
           master: int = 1) -> None:
    home = tmp / f"tmp-{NAMES[node]}"
    home.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "tensorplay.distributed.run", "--store", "etcd",
            "--nnodes", "3", "--node-rank", str(node), "--nproc-per-node", "4",
            "--max-restarts", "1", "--master-addr", hosts.address(master),
            "--master-port", PORT, *script]
    hosts.start(node + 1, argv, log, env={"PYTHONPATH": spawn.pythonpath(), "TMPDIR": str(home),
                                          "TENSORPLAY_NODE_GRACE_S": str(GRACE_S)})


def _signal_tree(pid: int, signum: int) -> list[int]:
    """Send ``signum`` to a launcher and everything below it (its ranks, warm process and
    etcd member: pids this test started, found through /proc); the pids signalled."""
    pids = [pid, *procfs.descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signum)
    return pids


def _etcd_pid(launcher: int) -> int:
    """The etcd member below ``launcher``."""
    for p in procfs.descendants(launcher):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:2] == [b"--name"]:
                return p
    raise AssertionError(f"no etcd member below launcher {launcher}")


def _no_member_data_left(tmp: Path) -> list[str]:
    return [str(p) for p in tmp.glob("tmp-*/tensorplay-run-*/etcd-*")]


def _first_steps(hosts: netns.Hosts, tmp: Path, script: list[str]) -> dict[str, Path]:
    logs = {name: tmp / f"{name}.log" for name in NAMES}
    for node in range(3):
        _start(hosts, node, script, logs[NAMES[node]], tmp)
    netns.await_line(logs["hostA"], r"^\[rank 0\] step 3/", hosts, timing.guard(240))
    return logs


def _require() -> None:
    netns.require()
    etcd.require()


def test_node_0_killed_whole_the_others_train_on_and_node_0_started_again_grows_it_back(
        tmp_path):
    """Host A (node 0: rank 0, the first etcd member) SIGKILLed whole mid-run: hosts B and C
    see its launcher gone at once, train on (2, 4) and, once node 0's launcher is started
    again on host A with the same flags, grow back to (3, 4); exit 0, weights as one process."""
    _require()
    script = [EXAMPLE, "--steps", "10", "--step-s", "0.5", "--wait-full-s",
              str(timing.guard(240)), "--verbose"]
    with netns.Hosts(3) as hosts:
        logs = _first_steps(hosts, tmp_path, script)
        killed = time.monotonic()
        _signal_tree(hosts.procs[0].pid, signal.SIGKILL)
        shrunk = netns.await_line(logs["hostB"], r"^\[rank 4\] step \d+/10  mesh \(2, 4\)",
                                  hosts, timing.guard(120), watched=1)  # host A is the one lost
        again = tmp_path / "hostA-again.log"
        _start(hosts, 0, script, again, tmp_path)
        netns.await_line(logs["hostB"], r"mesh grew back to \(3, 4\)", hosts, timing.guard(240),
                         watched=1)
        codes = hosts.wait_all(timeout=timing.guard(180))
        text = netns.logs(tmp_path)
    b, back = logs["hostB"].read_text(), again.read_text()
    assert codes == [-signal.SIGKILL, 0, 0, 0], f"{codes}\n{text}"
    assert shrunk - killed < timing.bound(GRACE_S, 5), \
        f"{shrunk - killed:.1f} s ({timing.describe()})\n{text}"
    assert "[rank 0] OK: matches single-process training" in back, text  # (0, 0) again
    assert "tensorplay-run: node 0 (hostA, ranks 0-3) is lost: its launcher is gone" in b, b
    assert "epoch 2, grow to (3, 4): joined ranks 0-3" in b, b
    assert "tensorplay-run: this launcher takes back node 0, which the job declared lost" \
        in back, back
    assert not _no_member_data_left(tmp_path), _no_member_data_left(tmp_path)


def test_node_0_frozen_is_lost_within_the_grace_and_the_others_train_on(tmp_path):
    """Host A frozen whole (SIGSTOP to its launcher, ranks and etcd member): its lease runs
    out and hosts B and C train on (2, 4) within the grace plus a margin; woken after they
    ended, host A's launcher finds itself dropped and stops its ranks (exit 1)."""
    _require()
    script = [EXAMPLE, "--steps", "8", "--step-s", "0.5"]  # the freeze lands in step 4,
    # which no rank ends before the recovery: steps 4-8 on (2, 4)
    with netns.Hosts(3) as hosts:
        logs = _first_steps(hosts, tmp_path, script)
        frozen = _signal_tree(hosts.procs[0].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        shrunk = netns.await_line(logs["hostB"], r"^\[rank 4\] step \d+/8  mesh \(2, 4\)",
                                  hosts, timing.guard(120), watched=1)  # host A is the one lost
        codes_bc = [p.wait(timeout=timing.guard(180)) for p in hosts.procs[1:]]
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        codes = hosts.wait_all(timeout=timing.guard(60))
        text = netns.logs(tmp_path)
    b = logs["hostB"].read_text()
    assert codes_bc == [0, 0] and codes[0] not in (0, None), f"{codes}\n{text}"
    assert shrunk - stopped < timing.bound(GRACE_S + 2, 6), \
        f"{shrunk - stopped:.1f} s ({timing.describe()})\n{text}"
    assert "[rank 4] OK: matches single-process training" in b, text
    assert "tensorplay-run: node 0 (hostA, ranks 0-3) is lost: went silent: its lease" in b, b


def test_node_0_cut_off_stops_itself_the_others_train_on_until_they_lose_the_majority_too(
        tmp_path):
    """Host A's link cut (node 0: rank 0, the first etcd member): its member is a minority of
    one, so its launcher stops its ranks (exit 1, naming the store's lost majority) while hosts
    B and C, a majority, declare node 0 lost and train on (2, 4). Then host B's etcd member is
    frozen too (SIGSTOP to that one process): 2 of the 3 members are lost, no launcher reaches
    a majority, and hosts B and C stop their ranks within the grace plus a margin, exit 1,
    naming the lost majority."""
    _require()
    script = [EXAMPLE, "--steps", "400", "--step-s", "0.5"]
    with netns.Hosts(3) as hosts:
        logs = _first_steps(hosts, tmp_path, script)
        cut = time.monotonic()
        hosts.cut(1)
        shrunk = netns.await_line(logs["hostB"], r"^\[rank 4\] step \d+/400  mesh \(2, 4\)",
                                  hosts, timing.guard(120), watched=1)  # host A is the one cut
        code_a = hosts.procs[0].wait(timeout=timing.bound(GRACE_S, 60))
        member = _etcd_pid(hosts.procs[1].pid)
        os.kill(member, signal.SIGSTOP)
        stopped = time.monotonic()
        codes = hosts.wait_all(timeout=timing.bound(GRACE_S, 60))
        took = time.monotonic() - stopped
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGCONT)
        text = netns.logs(tmp_path)
    a, b, c = (logs[name].read_text() for name in NAMES)
    assert code_a == 1 and codes == [1, 1, 1], f"{codes}\n{text}"
    assert shrunk - cut < timing.bound(GRACE_S, 8), \
        f"{shrunk - cut:.1f} s ({timing.describe()})\n{text}"
    assert "tensorplay-run: node 0 (hostA, ranks 0-3) is lost" in b, b
    assert took < timing.bound(GRACE_S, 30), f"{took:.1f} s ({timing.describe()})\n{text}"
    for log in (a, b, c):
        assert "The store lost its majority as seen from here" in log, log
    assert f"member 1 (hostB, {hosts.address(2)}:" in c and "): no answer" in c, c
    assert not _no_member_data_left(tmp_path), _no_member_data_left(tmp_path)
