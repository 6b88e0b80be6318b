"""The launcher's summary line, from made-up rank ends (no process is started)."""

from __future__ import annotations

import pytest

from tensorplay.distributed.launcher.rank_ends import (
    RankEnd,
    RankReport,
    blank_varying,
    shorten,
    summarize,
)


def raised(t: float, what: str, code: int = 1) -> RankReport:
    return RankReport.from_json({"event": "raised", "t": t, "code": code, "what": what,
                                 "first": "Traceback ..."})


def exited(t: float, code: int, what: str | None = None) -> RankReport:
    return RankReport.from_json({"event": "exit", "t": t, "code": code, "what": what})


def returned(t: float) -> RankReport:
    return RankReport.from_json({"event": "returned", "t": t})


def end(rank, report=None, code=None, exit_t=None, stop_t=None) -> RankEnd:
    return RankEnd(rank, report, code, exit_t, stop_t)


CASES = {
    "one rank raised, the others stopped": (
        [end(0, code=-15, stop_t=5.0), end(1, raised(4.0, "ValueError: bad lr"), 1, 4.2),
         end(2, code=-15, stop_t=5.0), end(3, code=-15, stop_t=5.0)],
        "rank 1 failed first (exit code 1): ValueError: bad lr; stopped ranks 0, 2-3.", 1),
    "sys.exit(3) keeps today's line": (
        [end(0, code=-15, stop_t=5.0), end(1, exited(4.0, 3), 3, 4.1),
         end(2, code=-9, stop_t=5.0), end(3, code=-15, stop_t=5.0)],
        "rank 1 failed first (exit code 3); stopped ranks 0, 2-3.", 3),
    "the earlier raise is the cause, not the earlier exit": (
        [end(0, exited(4.5, 3), 3, 4.6), end(1, raised(4.0, "ValueError: bad lr"), -15, None, 5.6),
         end(2, code=-15, stop_t=5.6)],
        "rank 1 failed first (stopped while exiting): ValueError: bad lr; then rank 0 failed "
        "too; stopped rank 2.", 1),
    "all ranks alike, pids and addresses differing": (
        [end(r, raised(4.0 + r / 10, f"RankFailedError: peer [127.0.0.1]:{9000 + r} (pid "
                                     f"{100 + r}) died"), 1, 5.0) for r in (2, 0, 3, 1)],
        "all 4 ranks failed alike (exit code 1): RankFailedError: peer [127.0.0.1]:9000 (pid "
        "100) died.", 1),
    "all alike by the code their scripts chose, the first stopped while exiting": (
        [end(0, exited(4.0, 1), -15, stop_t=5.0), end(1, exited(4.1, 1), 1, 4.5)],
        "all 2 ranks failed alike (exit code 1).", 1),
    "a group alike first, another rank later": (
        [end(0, raised(4.0, "E: x"), 1, 4.5), end(1, raised(4.1, "E: x"), 1, 4.5),
         end(2, raised(4.2, "F: y"), 1, 4.5), end(3, code=0, exit_t=3.0, report=returned(2.9))],
        "ranks 0-1 failed first, alike (exit code 1): E: x; then rank 2 failed too.", 1),
    "killed during its script (no report)": (
        [end(0, code=-9, exit_t=4.0), end(1, code=-15, stop_t=5.0)],
        "rank 0 failed first (killed by signal SIGKILL); stopped rank 1.", 137),
    "the rank that raised is named; those that died after finishing are not the cause": (
        [end(0, raised(6.0, "RankFailedError: all_reduce() failed: a peer rank died"), 1, 6.2),
         *[end(r, returned(5.0), -6, 5.5) for r in (1, 2, 3)]],
        "rank 0 failed first (exit code 1): RankFailedError: all_reduce() failed: a peer rank "
        "died; ranks 1-3 finished their script, then died at exit (killed by signal SIGABRT).", 1),
    "only deaths after finishing: they are the news, the rank still in its script is named": (
        [end(0, code=-15, stop_t=7.0), *[end(r, returned(5.0), -6, 5.5 + r) for r in (3, 1, 2)]],
        "ranks 1-3 finished their script, then died at exit (killed by signal SIGABRT); rank 0 "
        "had not finished its script (stopped).", 134),
    "hung at exit after finishing": (
        [end(0, exited(4.0, 2), 2, 4.1), end(1, returned(3.0), -15, stop_t=5.0)],
        "rank 0 failed first (exit code 2); rank 1 finished its script, then did not exit "
        "(stopped).", 2),
    "a report sent after the stop does not count": (
        [end(0, code=1, exit_t=4.0), end(1, raised(5.5, "KeyboardInterrupt"), 1, stop_t=5.0)],
        "rank 0 failed first (exit code 1); stopped rank 1.", 1),
    "the others had finished": (
        [end(0, returned(1.0), 0, 1.1), end(1, exited(2.0, 1, "rank 1 broke"), 1, 2.1)],
        "rank 1 failed first (exit code 1): rank 1 broke; no other rank was still running.", 1),
}


@pytest.mark.parametrize("case", CASES)
def test_summary(case):
    ends, line, code = CASES[case]
    assert summarize(ends) == (line, code)


def test_summary_on_one_node_of_several_says_so():
    ends = [end(r, raised(1.0, "E: x"), 1, 2.0) for r in (4, 5)]
    assert summarize(ends, node_ranks="ranks on this node")[0] == (
        "all 2 ranks on this node failed alike (exit code 1): E: x.")


def test_blank_varying_keeps_ranks_and_blanks_pids_addresses_pointers():
    assert blank_varying("rank 3 (pid 1234) at 10.0.0.1:29500, [::1]:80, obj at 0x7f3a") == (
        "rank 3 (pid N) at ADDR, ADDR, obj at 0x?")
    assert blank_varying("rank 3 is not in the group") != blank_varying("rank 5 is not in the "
                                                                        "group")


def test_shorten_drops_the_fix_and_cuts_at_a_word():
    assert shorten("MeshMismatchError: ranks disagree: (2, 2): by 0-2; Fix: make it so.") == (
        "MeshMismatchError: ranks disagree: (2, 2): by 0-2")
    assert shorten("E: timed out. Fix: raise the limit.") == "E: timed out"
    long = shorten("E: " + "word " * 100)
    assert long.endswith("word ...") and len(long) <= 244


def test_a_rank_failed_error_is_the_cause_only_when_nothing_else_failed():
    # rank 5's SIGKILL was seen after rank 4 reported the RankFailedError it caused
    killed = RankEnd(5, None, -9, exit_t=10.3)
    told = RankEnd(4, RankReport("raised", 10.1, 1,
                                 "RankFailedError: all_reduce() failed: rank 5 died"), 1, 10.2)
    text, code = summarize([told, killed])
    assert text == ("rank 5 failed first (killed by signal SIGKILL); then rank 4 failed too.")
    assert code == 137
    text, _ = summarize([told, RankEnd(6, None, 0, exit_t=11.0)])  # only a consequence
    assert text.startswith("rank 4 failed first (exit code 1): RankFailedError: ")


def test_a_report_is_read_from_its_json_and_a_bad_one_refused():
    assert RankReport.from_json({"event": "exit", "t": 2, "code": 3, "what": None}) == (
        RankReport("exit", 2.0, 3, None, None))
    assert not RankReport.from_json({"event": "returned", "t": 1.5}).failed
    with pytest.raises(ValueError, match="not a rank report"):
        RankReport.from_json({"event": "returned"})
