"""The ranks' output: torch's own rank tag dropped from their lines."""

from __future__ import annotations

from tensorplay.distributed.launcher.output import untag


def test_untag_drops_torchs_rank_tag_of_the_same_rank_only():
    assert untag(2, b"[rank2]: Traceback (most recent call last):\n") == (
        b"Traceback (most recent call last):\n")
    assert untag(2, b"[rank2]:[W1203 06:00:00] warning\n") == b"[W1203 06:00:00] warning\n"
    assert untag(2, b"[rank3]: not mine\n") == b"[rank3]: not mine\n"
    assert untag(2, b"plain\n") == b"plain\n"


def test_a_hidden_ranks_stderr_line_survives_a_stdout_reader_that_lags(capsys):
    # the two readers do not run in step: the stderr message can be read before 60 stdout
    # lines that the rank printed earlier; the tail must still show it
    from tensorplay.distributed.launcher.output import TAIL_LINES, Output

    out = Output(shown={0}, log_dir=None, ranks=[0, 1])
    out.line(1, True, b"rank 1 broke\n")
    for i in range(TAIL_LINES + 10):
        out.line(1, False, b"line %d\n" % i)
    out.show_tail(1)
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "[rank 1] rank 1 broke"
    assert f"[rank 1] line {TAIL_LINES + 9}" in err
    assert "[rank 1] line 9" not in err and "[rank 1] line 10" in err
    assert f"{TAIL_LINES} of its stdout, then 1 of its stderr" in err[0]
