"""The ranks' output: torch's own rank tag dropped from their lines."""

from __future__ import annotations

from tensorplay.distributed.launcher.output import untag


def test_untag_drops_torchs_rank_tag_of_the_same_rank_only():
    assert untag(2, b"[rank2]: Traceback (most recent call last):\n") == (
        b"Traceback (most recent call last):\n")
    assert untag(2, b"[rank2]:[W1203 06:00:00] warning\n") == b"[W1203 06:00:00] warning\n"
    assert untag(2, b"[rank3]: not mine\n") == b"[rank3]: not mine\n"
    assert untag(2, b"plain\n") == b"plain\n"
