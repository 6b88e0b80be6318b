"""Jobs across hosts: network namespaces with their own addresses and host names (tests/netns.py).

Each test starts one `tensorplay-run` per host, as a user would on two machines, with no
network variables set, and asserts what every launcher printed and how long it took.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tensorplay.distributed.launcher.rank_main import COMM_PREFIX
from tests import netns, spawn, timing

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PORT = "29517"


def _launch(hosts: netns.Hosts, script: list[str], tmp: Path, nproc: int = 4,
            env: dict[int, dict[str, str]] | None = None) -> list[Path]:
    """One launcher per host, node 0 on host 1; returns their log files."""
    logs = []
    for i in range(1, hosts.count + 1):
        log = tmp / f"{hosts.hostname(i)}.log"
        hosts.start(i, [sys.executable, "-m", "tensorplay.distributed.run",
                        "--nnodes", str(hosts.count), "--node-rank", str(i - 1),
                        "--nproc-per-node", str(nproc), "--master-addr", hosts.address(1),
                        "--master-port", PORT, *script], log,
                    env={"PYTHONPATH": spawn.pythonpath(), **(env or {}).get(i, {})})
        logs.append(log)
    return logs


def test_the_main_job_runs_across_two_hosts_with_no_network_settings(tmp_path):
    netns.require()
    with netns.Hosts(2) as hosts:
        logs = _launch(hosts, [str(ROOT / "examples" / "train_dp_tp.py"), "--steps", "2"],
                       tmp_path)
        codes = hosts.wait_all(timeout=180)
        texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    assert "[rank 0] OK: matches single-process training" in texts[0]
    assert "remote=[127.0.0.1]" not in texts[0] + texts[1]


def test_a_loopback_interface_across_hosts_fails_at_once_naming_the_host(tmp_path):
    netns.require()
    with netns.Hosts(2) as hosts:
        start = time.monotonic()
        logs = _launch(hosts, [str(ROOT / "examples" / "train_dp_tp.py")], tmp_path,
                       env={2: {"GLOO_SOCKET_IFNAME": "lo"}})
        code = hosts.procs[1].wait(timeout=60)
        took = time.monotonic() - start
        text = logs[1].read_text()
    assert code != 0, text
    assert ("BackendError: host hostB: GLOO_SOCKET_IFNAME=lo makes gloo advertise a loopback "
            "address, which ranks on other hosts cannot reach") in text, text
    assert "Fix: unset GLOO_SOCKET_IFNAME, or set GLOO_SOCKET_IFNAME=" in text
    assert took < timing.bound(0, 45)  # seconds (most of it importing torch on 4 ranks), not a
    # timeout


KILLED_JOB = '''
import os, signal, time
import torch
import tensorplay.distributed as dist
from tensorplay.distributed import init_device_mesh

dist.init_process_group(timeout=60)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
for step in range(200):
    if dist.get_rank() == 5 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4), group=mesh.get_group("dp"))
    dist.all_reduce(torch.ones(4), group=mesh.get_group("tp"))
    time.sleep(0.05)
dist.destroy_process_group()
'''


def test_a_rank_killed_on_one_host_stops_both_launchers_quickly(tmp_path):
    netns.require()
    script = tmp_path / "killed.py"
    script.write_text(KILLED_JOB)
    with netns.Hosts(2) as hosts:
        logs = _launch(hosts, [str(script)], tmp_path)
        codes = hosts.wait_all(timeout=120)
        texts = [log.read_text() for log in logs]
    assert all(code not in (0, None) for code in codes), (codes, texts)
    assert "rank 5 failed first (killed by signal SIGKILL)" in texts[1], texts[1]
    assert "RankFailedError" in texts[0], texts[0]  # host A's ranks were told, not hung
    assert "the job stopped because node 1 (hostB) failed: rank 5: killed by signal SIGKILL" \
        in texts[0], texts[0]
    _assert_clean(texts)


LOOP_JOB = '''
import os, time
import torch
import tensorplay.distributed as dist

dist.init_process_group(timeout=120)
for step in range(100000):
    dist.all_reduce(torch.ones(4))
    if int(os.environ["LOCAL_RANK"]) == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.1)
'''
GRACE_S = 3  # TENSORPLAY_NODE_GRACE_S for these tests (default 10; bench/failover.py runs
# the same faults with the defaults, against the 15 s goal)
WITHIN_S = 5  # and every launcher has exited GRACE_S + this after the fault on a quiet machine


def _within_s() -> float:
    """The bound on each launcher's exit after the fault: the grace, plus WITHIN_S scaled to
    the machine's speed (tests/timing.py)."""
    return timing.bound(GRACE_S, WITHIN_S)


def _running_loop(hosts: netns.Hosts, tmp: Path) -> list[Path]:
    """Every host runs LOOP_JOB with 2 ranks; returns once each has made a few steps."""
    script = tmp / "loop.py"
    script.write_text(LOOP_JOB)
    logs = _launch(hosts, [str(script)], tmp, nproc=2,
                   env={i: {"TENSORPLAY_NODE_GRACE_S": str(GRACE_S)}
                        for i in range(1, hosts.count + 1)})
    deadline = time.monotonic() + 150
    while not all("step 3\n" in log.read_text(errors="replace") for log in logs):
        assert time.monotonic() < deadline, [log.read_text() for log in logs]
        assert all(p.poll() is None for p in hosts.procs), [log.read_text() for log in logs]
        time.sleep(0.2)
    return logs


def _exit_times(hosts: netns.Hosts, since: float, limit: float) -> list[float | None]:
    """Seconds from ``since`` until each launcher exited (None: still running at ``limit``)."""
    took: list[float | None] = [None] * len(hosts.procs)
    while time.monotonic() - since < limit and None in took:
        for i, proc in enumerate(hosts.procs):
            if took[i] is None and proc.poll() is not None:
                took[i] = time.monotonic() - since
        time.sleep(0.05)
    return took


def _after_fault(hosts: netns.Hosts, tmp: Path, inject: Callable[[], None]
                 ) -> tuple[list[float | None], list[str]]:
    """Run LOOP_JOB on every host, ``inject()`` a fault once each made a few steps; return
    each launcher's seconds from the fault to its exit (None: alive after 60 s) and its log."""
    logs = _running_loop(hosts, tmp)
    start = time.monotonic()
    inject()
    took = _exit_times(hosts, start, limit=60)
    return took, [log.read_text(errors="replace") for log in logs]


def _assert_clean(texts: list[str]) -> None:
    """An expected failure shows no C++ trace, abort or core dump."""
    for text in texts:
        for sign in ("SIGABRT", "core dumped", "terminate called", "Exception raised from"):
            assert sign not in text, (sign, text)


@pytest.mark.faults
def test_a_frozen_host_has_its_ranks_killed_as_hung_and_both_launchers_stop(tmp_path):
    netns.require()

    def freeze_host_b() -> None:
        ranks_b = [pid for pid in procfs.descendants(hosts.procs[1].pid)
                   if (procfs.comm(pid) or "").startswith(COMM_PREFIX)]
        assert len(ranks_b) == 2, ranks_b
        for pid in ranks_b:
            os.kill(pid, signal.SIGSTOP)

    with netns.Hosts(2) as hosts:
        took, texts = _after_fault(hosts, tmp_path, freeze_host_b)
    assert all(t is not None and t < _within_s() for t in took), (took, timing.describe(), texts)
    assert "tensorplay-run: rank 2 hung on host hostB: its process was stopped (SIGSTOP) for " \
        in texts[1], texts[1]
    assert "tensorplay-run: the job stopped because node 1 (hostB) failed: rank " in texts[0], \
        texts[0]
    _assert_clean(texts)


@pytest.mark.faults
def test_the_host_serving_the_store_killed_stops_the_other_host_quickly(tmp_path):
    netns.require()

    def kill_host_a() -> None:
        launcher_a = hosts.procs[0].pid
        for pid in [launcher_a, *procfs.descendants(launcher_a)]:
            os.kill(pid, signal.SIGKILL)

    with netns.Hosts(2) as hosts:
        took, texts = _after_fault(hosts, tmp_path, kill_host_a)
    text = texts[1]
    assert took[1] is not None and took[1] < _within_s(), (took, timing.describe(), text)
    assert hosts.procs[1].returncode not in (0, None)
    assert "RankFailedError" in text or "the job stopped because node 0 (hostA" in text, text
    _assert_clean([text])


@pytest.mark.faults
def test_a_cut_link_among_three_hosts_stops_every_launcher_naming_it(tmp_path):
    netns.require()
    with netns.Hosts(3) as hosts:
        took, texts = _after_fault(hosts, tmp_path, lambda: hosts.cut(3))
    assert all(t is not None and t < _within_s() for t in took), (took, timing.describe(), texts)
    for text in texts[:2]:  # hosts A and B: node 0 posted the verdict, B read it
        assert ("the job stopped because node 2 (hostC, ranks 4-5) went silent: no heartbeat "
                "for ") in text, text
        assert "(limit 3 s, --node-grace-s)" in text  # TENSORPLAY_NODE_GRACE_S=3
    assert "the job stopped because node 0 (hostA, ranks 0-1), which serves" in texts[2]
    _assert_clean(texts)
