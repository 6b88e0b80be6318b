"""Node 0's link watch: a launcher whose connection closes without a goodbye is gone at once;
a goodbye is a clean end; a bug in the watch is said on stderr (launcher/links.py)."""

from __future__ import annotations

import queue
import socket
import time

from tensorplay.distributed.launcher.links import Link, Links
from tests import timing


def test_a_launcher_gone_without_a_goodbye_is_seen_and_one_that_said_bye_is_not():
    gone: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    bugs: list[str] = []
    links = Links("127.0.0.1", lambda node, claim: gone.put((node, claim)),
                  lambda where, err: bugs.append(where))
    try:
        Link("127.0.0.1", links.port, 2, 1, 5.0).bye()
        killed = socket.create_connection(("127.0.0.1", links.port))
        killed.sendall(b"1 3\n")
        killed.close()
        assert gone.get(timeout=timing.guard(10)) == (1, 3)
        time.sleep(0.2)
        assert gone.empty() and not bugs
    finally:
        links.close()


def test_a_bug_in_the_link_watch_is_said_on_stderr_and_handed_on(capfd):
    seen: queue.SimpleQueue[str] = queue.SimpleQueue()

    def gone(node: int, claim: int) -> None:
        raise IndexError(f"no node {node}")

    links = Links("127.0.0.1", gone, lambda where, err: seen.put(f"{where}: {err!r}"))
    try:
        with socket.create_connection(("127.0.0.1", links.port)) as conn:
            conn.sendall(b"7 1\n")
        assert seen.get(timeout=timing.guard(10)) == "node 0's link watch: IndexError('no node 7')"
    finally:
        links.close()
    err = capfd.readouterr().err
    assert err.startswith("tensorplay-run: internal error in node 0's link watch: Traceback")
    assert err.rstrip().endswith("IndexError: no node 7"), err
