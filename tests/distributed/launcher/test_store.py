"""The launcher's store: every failure of a store call is one StoreGone, classified once
(refused or not); anything else a call raises is a bug and goes up as it is, even from a call
given up on (launcher/store.py)."""

from __future__ import annotations

import time

import pytest

from tensorplay.distributed.launcher import store
from tensorplay.distributed.launcher.store import Client, StoreGone
from tests.distributed.launcher.memory_store import MemoryStore, client
from tests.spawn import free_port


def test_the_stores_own_failures_are_store_gone_in_one_line_and_not_refused():
    """Read as torch's store's are (``torch_store.failure``): a RuntimeError or OSError is
    the store gone."""
    from tensorplay.distributed.backends import torch_store

    raw = MemoryStore()
    client = Client(raw, torch_store.failure)
    assert client.add("k", 2) == 2 and client.check(["k"]) and client.get("k") == b"2"
    raw.kill()
    with pytest.raises(StoreGone) as gone:
        client.add("k", 1)
    assert str(gone.value) == "Connection reset by peer" and not gone.value.refused
    assert isinstance(gone.value.__cause__, RuntimeError)
    raw.broken["get"] = OSError("Broken pipe\nException raised from recvBytes at ...")
    with pytest.raises(StoreGone, match=r"^Broken pipe$"):
        client.get("k")


def test_anything_else_a_store_call_raises_is_a_bug_and_goes_up_as_it_is():
    raw = MemoryStore()
    raw.broken["compare_set"] = TypeError("compare_set() takes 3 arguments")
    from tensorplay.distributed.backends import torch_store

    with pytest.raises(TypeError):
        Client(raw, torch_store.failure).compare_set("k", "", "v")
    with pytest.raises(TypeError):
        client(raw).compare_set("k", "", "v")


def test_a_store_whose_address_refuses_connections_is_gone_and_refused():
    port = free_port()  # nobody listens there: the probe is refused before torch is loaded
    start = time.monotonic()
    with pytest.raises(StoreGone) as gone:
        store.connect("127.0.0.1", port, time.monotonic() + 0.2, store.CALL_S)
    assert gone.value.refused and str(gone.value) == "Connection refused"
    assert time.monotonic() - start < 5


def test_a_bounded_call_gives_up_as_store_gone_and_hands_back_what_it_raised():
    with pytest.raises(StoreGone, match="the store did not answer within 0.1 s"):
        store.bounded(lambda: time.sleep(1), 0.1)
    assert store.bounded(lambda: 7, 1.0) == 7

    def bug() -> None:
        raise KeyError("node 3")

    with pytest.raises(KeyError):
        store.bounded(bug, 1.0)


def test_a_bug_raised_by_a_call_given_up_on_is_still_said_on_stderr(capfd):
    def late_bug() -> None:
        time.sleep(0.3)
        raise ZeroDivisionError("division by zero")

    with pytest.raises(StoreGone):
        store.bounded(late_bug, 0.05)
    deadline = time.monotonic() + 10
    err = ""
    while "ZeroDivisionError" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    assert err.startswith("tensorplay-run: internal error in a store call given up on: "
                          "Traceback (most recent call last):"), err
    assert err.rstrip().endswith("ZeroDivisionError: division by zero"), err


def test_a_store_failure_after_the_call_was_given_up_on_is_dropped_with_it(capfd):
    def late_failure() -> None:
        time.sleep(0.2)
        raise StoreGone("Connection reset by peer")

    with pytest.raises(StoreGone, match="did not answer"):
        store.bounded(late_failure, 0.05)
    time.sleep(0.4)
    assert capfd.readouterr().err == ""
