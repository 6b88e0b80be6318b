"""The record of what an epoch change cost, and its way to tensorplay-run's summary."""

from __future__ import annotations

import json
import os

import pytest

from tensorplay.distributed.host import wire
from tensorplay.distributed.host.wire import Recovery
from tensorplay.distributed.launcher.events import Recovered, from_report_line

SHRINK = Recovery(epoch=1, kind="shrink", shape=(1, 4), lost_ranks=(5,), lost_hosts=("hostA",),
                  joined_ranks=(), detect_s=0.04, agree_s=0.113, rebuild_s=0.09)


def test_a_shrink_says_what_was_lost_and_each_measured_phase():
    assert SHRINK.line() == ("epoch 1, shrink to (1, 4): lost rank 5 (host hostA); "
                             "detect 0.04 s, agree 0.11 s, rebuild 0.09 s")
    assert SHRINK.total_s == pytest.approx(0.243)


def test_a_grow_names_the_joined_ranks_and_its_sync():
    grow = Recovery(epoch=2, kind="grow", shape=(2, 4), lost_ranks=(), lost_hosts=(),
                    joined_ranks=(4, 5, 6, 7), detect_s=None, agree_s=0.01, rebuild_s=0.2,
                    sync_s=0.005)
    assert grow.line() == ("epoch 2, grow to (2, 4): joined ranks 4-7; agree 0.01 s, "
                           "rebuild 0.20 s, sync 0.01 s")
    assert grow.total_s == pytest.approx(0.215)


def test_the_record_reaches_the_launcher_as_an_event_unchanged():
    raw = json.dumps({"event": "recovery", "record": SHRINK.to_json()}).encode()
    assert from_report_line(3, raw) == Recovered(3, SHRINK)
    with pytest.raises(ValueError, match="not a recovery record"):
        from_report_line(3, b'{"event": "recovery", "record": {"epoch": 1}}')


def test_tell_launcher_writes_one_line_only_from_the_process_it_was_set_for(monkeypatch):
    r, w = os.pipe()
    try:
        monkeypatch.setenv(wire.TENSORPLAY_RUN_NOTES, f"{os.getpid() + 1}:{w}")
        assert wire.tell_launcher("recovery", record={"epoch": 1}) is False  # another pid's
        monkeypatch.setenv(wire.TENSORPLAY_RUN_NOTES, f"{os.getpid()}:{w}")
        assert wire.tell_launcher("recovery", record={"epoch": 1}) is True
        assert json.loads(os.read(r, 4096)) == {"event": "recovery", "record": {"epoch": 1}}
        monkeypatch.delenv(wire.TENSORPLAY_RUN_NOTES)
        assert wire.tell_launcher("recovery") is False
    finally:
        os.close(r)
        os.close(w)
