"""Jobs across hosts: network namespaces with their own addresses and host names (tests/netns.py).

Each test starts one `tensorplay-run` per host, as a user would on two machines, with no
network variables set, and asserts what every launcher printed and how long it took.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests import netns

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
                    env={"PYTHONPATH": str(ROOT), **(env or {}).get(i, {})})
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
    assert took < 45  # seconds (most of it importing torch on 4 ranks), not a timeout


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
