"""Agreement on the lost ranks: real processes, one real store (served apart from the ranks,
as tensorplay-run serves it), every survivor gets the same answer or the same refusal."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest

from tests import spawn

pytestmark = [pytest.mark.slow, pytest.mark.faults]  # five fresh processes; absent, late ranks


def _rounds(rank: int, port: int) -> dict[str, object]:
    import torch.distributed as tdist

    from tensorplay.distributed import ShrinkError, StaleEpochError
    from tensorplay.distributed._control_store import StoreBoard
    from tensorplay.distributed.elastic.survivors import agree_lost

    board = StoreBoard(tdist.TCPStore("127.0.0.1", port, None, False,
                                      timeout=timedelta(seconds=30)))
    members = range(5)
    out: dict[str, object] = {}
    rounds = ["one lost", "none lost", "late", "no majority"]  # each in an epoch of its own

    def attempt(name: str, suspects=(), **kw) -> None:
        start = time.monotonic()
        try:
            out[name] = agree_lost(board, rounds.index(name), rank, members, suspects, **kw)
        except (ShrinkError, StaleEpochError) as err:
            out[name] = f"{type(err).__name__}: {err}"
        out[name + " s"] = time.monotonic() - start

    if rank != 3:  # rank 3 never comes: its peers 2 and 4 saw it go
        attempt("one lost", {3} if rank in (2, 4) else (), wait_s=5)
    attempt("none lost", {2} if rank == 1 else (), wait_s=5)  # 2 is alive after all
    if rank == 4:
        time.sleep(2)
    attempt("late", wait_s=1)
    if rank < 2:
        attempt("no majority", timeout_s=2)
    return out


def test_survivors_agree_on_the_lost_and_refuse_without_a_majority():
    import torch.distributed as tdist

    server = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    results = spawn.run(_rounds, 5, server.port, init=False, timeout=90)
    for rank, got in enumerate(results):
        if rank != 3:
            assert got["one lost"] == [3], (rank, got)
            assert got["one lost s"] < 4, (rank, got)  # suspected: no wait_s (5 s) spent on it
        assert got["none lost"] == [], (rank, got)
        if rank != 4:
            assert got["late"] == [4], (rank, got)
    assert re.fullmatch(
        r"StaleEpochError: rank 4 reached the recovery after the others had agreed it was lost "
        r"\(lost: 4; decided by rank [0-3] after 1\.\d s, the wait ran out; seen dead: none; "
        r"suspected: none\); it must leave the job\. Fix: make it reach the recovery sooner, or "
        r"raise the wait", got["late"]), got["late"]
    for rank in (0, 1):
        assert re.fullmatch(
            r"ShrinkError: only ranks 0-1 of 5 members came to the recovery \(decided by rank "
            r"[01] after 2\.\d s, the wait ran out; seen dead: none; suspected: none\): no "
            r"majority of the members not seen dead, so no part of the job may go on alone\. "
            r"Fix: restart the job from its last checkpoint", results[rank]["no majority"]
        ), results[rank]
