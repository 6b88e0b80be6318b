"""The trust model, checked on a real 2-rank gloo job.

1. The rendezvous store listens on the given address only (127.0.0.1 here), never on every
   interface (0.0.0.0 or ::), read from the kernel's socket table while the job runs. With
   GLOO_SOCKET_IFNAME=lo gloo's own data sockets stay on the loopback too.
2. Cross-rank validation (the checks of init_device_mesh, DeviceMesh, flatten, unflatten, and
   their mismatch reports) moves no pickles: with every pickle entry point made to raise
   inside the ranks, those calls still work and still report a mismatch.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import time
from pathlib import Path

import pytest

from tests import spawn

N = 2
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> str:
    """'0100007F' -> '127.0.0.1'; 32 hex digits (four little-endian words) -> an IPv6 text."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def listening_sockets() -> list[dict]:
    """Every TCP socket in LISTEN state in this network namespace: address, port, inode."""
    found = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net", table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            addr, port = fields[1].split(":")
            found.append({"table": table, "address": _address(addr), "port": int(port, 16),
                          "inode": fields[9]})
    return found


def _barrier(tmp: str, tag: str, rank: int) -> None:
    Path(tmp, f"{tag}.{rank}").write_text("")
    deadline = time.monotonic() + 120
    while not all(Path(tmp, f"{tag}.{r}").exists() for r in range(N)):
        assert time.monotonic() < deadline, f"the ranks never all reached {tag}"
        time.sleep(0.02)


def _forbid_pickles(monkeypatch) -> None:
    """Make every way to pickle or unpickle raise, torch's object collectives included."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    def refuse(*args, **kwargs):
        raise AssertionError("cross-rank validation must not pickle or unpickle")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for name in ("_pickler", "_unpickler"):
        if hasattr(distributed_c10d, name):
            monkeypatch.setattr(distributed_c10d, name, refuse)
    for name in ("all_gather_object", "broadcast_object_list", "gather_object",
                 "scatter_object_list", "send_object_list", "recv_object_list"):
        monkeypatch.setattr(tdist, name, refuse)
        monkeypatch.setattr(distributed_c10d, name, refuse)


def trust_job(rank: int, tmp: str) -> dict:
    import torch

    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
    from tensorplay.distributed.errors import MeshMismatchError

    _barrier(tmp, "ready", rank)
    dist.init_process_group("gloo", timeout=20)
    out: dict = {"pid": os.getpid(), "master_port": int(os.environ["MASTER_PORT"])}
    _barrier(tmp, "joined", rank)
    if rank == 0:  # the job is running: read the kernel's table of listening sockets
        out["listening"] = listening_sockets()
        out["mine"] = sorted(_socket_inodes(os.getpid()))

    with pytest.MonkeyPatch.context() as patch:
        _forbid_pickles(patch)
        try:
            pickle.dumps(1)
            out["forbidden"] = False
        except AssertionError:
            out["forbidden"] = True
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        flat = mesh.flatten("dp_tp")
        split = flat.unflatten("dp_tp", (1, 2), ("a", "b"))
        explicit = DeviceMesh("cpu", [1, 0], mesh_dim_names=("r",))
        try:
            init_device_mesh("cpu", (2,), mesh_dim_names=("x" if rank else "y",))
            out["mismatch"] = None
        except MeshMismatchError as err:
            out["mismatch"] = err.values
        x = torch.tensor([1.0])
        dist.all_reduce(x, group=split.get_group("b"))
        out["checked"] = [mesh.shape, flat.shape, split.shape, explicit.get_local_rank(),
                          x.item()]
    _barrier(tmp, "done", rank)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("trust"))
    return spawn.run(trust_job, N, tmp, init=False, timeout=120,
                     env={"GLOO_SOCKET_IFNAME": "lo"})


def test_store_listens_on_the_given_address_only(job):
    info = job[0]
    on_port = [s for s in info["listening"] if s["port"] == info["master_port"]]
    assert on_port, f"nothing listens on MASTER_PORT {info['master_port']}"
    assert {s["address"] for s in on_port} == {"127.0.0.1"}, on_port
    assert not [s for s in on_port if s["address"] in ("0.0.0.0", "::")]
    assert {s["inode"] for s in on_port} <= set(info["mine"])  # rank 0 holds it


def test_no_socket_of_rank_0_listens_beyond_the_loopback(job):
    info = job[0]
    mine = [s for s in info["listening"] if s["inode"] in set(info["mine"])]
    assert len(mine) >= 2  # the store and gloo's own listener
    assert {s["address"] for s in mine} == {"127.0.0.1"}, mine


def test_cross_rank_checks_move_no_pickles(job):
    for rank, out in enumerate(job):
        assert out["forbidden"]  # pickling really was refused inside the ranks
        assert out["checked"] == [(2, 1), (2,), (1, 2), 1 - rank, 2.0]
        assert out["mismatch"] == {"('y',)": [0], "('x',)": [1]}
