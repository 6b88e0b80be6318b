"""backends/etcd.py against a real etcd member on 127.0.0.1 (tests/etcd.py): the store's verbs
as torch's TCPStore has them, leases that take their keys with them, a watch that sees it, and
failures read as "gone" or "timeout"."""

from __future__ import annotations

import threading
import time

import pytest

from tensorplay.distributed.backends.etcd import Etcd, EtcdFailed, failure, health
from tests import etcd, spawn, timing

pytestmark = pytest.mark.slow  # starts an etcd daemon


@pytest.fixture(scope="module")
def member():
    with etcd.Member() as m:
        yield m


@pytest.fixture
def store(member, request):
    s = Etcd([member.endpoint], timeout_s=timing.guard(5), prefix=f"{request.node.name}/")
    yield s
    s.delete_prefix()


def test_counters_and_compare_set_behave_as_torch_tcpstore_does(store):
    assert store.add("beat", 1) == 1
    assert store.add("beat", 2) == 3
    assert store.add("beat", 0) == 3
    assert store.compare_set("verdict", "", "lost") == b"lost"  # missing: set
    assert store.compare_set("verdict", "", "other") == b"lost"  # the first word stands
    assert store.compare_set("verdict", "lost", "next") == b"next"
    assert store.compare_set("missing", "x", "y") == b"x"  # missing, expected given
    assert store.check(["verdict", "beat"]) and not store.check(["verdict", "nokey"])


def test_concurrent_adds_lose_no_increment(store):
    threads = [threading.Thread(target=lambda: [store.clone().add("n", 1) for _ in range(10)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timing.guard(60))
    assert store.value("n") == b"40"


def test_get_waits_for_the_write_and_a_missing_key_times_out_as_timeout(store):
    def later():
        time.sleep(0.2)
        store.clone().set("late", "yes")

    threading.Thread(target=later).start()
    assert store.get("late") == b"yes"
    with pytest.raises(EtcdFailed) as caught:
        store.wait_for(["never"], 0.3)
    assert failure(caught.value) == "timeout" and "never" in str(caught.value)


def test_a_leased_key_vanishes_when_its_lease_is_not_kept_alive_and_a_watch_sees_it(store):
    lease = store.lease(2)
    store.put("alive/1", "pid 1", lease=lease)
    assert store.keepalive(lease) == 2
    found, revision = store.listing("alive/")
    assert found == {"alive/1": b"pid 1"}
    seen = []
    deadline = time.monotonic() + timing.guard(20)
    while not seen and time.monotonic() < deadline:
        events = list(store.watch("alive/", revision + 1, 5.0))
        assert events[0].kind == "CREATED"
        seen = [e for e in events if e.kind == "DELETE"][:1]
    assert seen and seen[0].key == "alive/1"
    assert store.listing("alive/")[0] == {}
    assert store.keepalive(lease) == 0  # expired


def test_revoke_deletes_the_leased_keys_at_once(store):
    lease = store.lease(30)
    store.put("alive/2", "x", lease=lease)
    store.revoke(lease)
    assert not store.check(["alive/2"])


def test_a_dead_endpoint_is_passed_over_and_none_alive_is_gone(member):
    dead = f"127.0.0.1:{spawn.free_port()}"
    both = Etcd([dead, member.endpoint], timeout_s=timing.guard(5), prefix="failover/")
    assert both.add("x", 1) == 1 and both.endpoints[both._at] == member.endpoint
    both.delete_prefix()
    with pytest.raises(EtcdFailed) as caught:
        Etcd([dead], timeout_s=1.0).set("a", "b")
    assert failure(caught.value) == "gone"
    assert f"{dead}: Connection refused" in str(caught.value)
    assert failure(ValueError("a bug")) is None


def test_health_and_members_name_the_member(member):
    assert health(member.endpoint, 2.0) is None
    assert health(f"127.0.0.1:{spawn.free_port()}", 1.0) == "Connection refused"
    (one,) = Etcd([member.endpoint], 5.0).members()
    assert one.name == "m0" and one.client_urls == (f"http://{member.endpoint}",)
