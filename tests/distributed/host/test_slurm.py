"""host/slurm.py: Slurm's node lists, its srun step, and what scontrol says of a job's end.

The expected expansions are what ``scontrol show hostnames`` (Slurm 22.05) printed for each list;
tests/distributed/launcher/test_under_slurm.py asks a running scontrol the same, where one runs.
"""

from __future__ import annotations

import itertools
import os
import re
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorplay.distributed.host import slurm
from tensorplay.distributed.host.slurm import Step, ending, first_host, hostnames, seconds, step

# --- node lists -------------------------------------------------------------------------------

SCONTROL_SAYS = {  # node list -> scontrol show hostnames, Slurm 22.05
    "node[01-04,07],gpu5": "node01 node02 node03 node04 node07 gpu5",
    "a[1-2]b[3-4]": "a1b3 a1b4 a2b3 a2b4",
    "x[008-010]": "x008 x009 x010",
    "rack1-[1-2],rack2-3": "rack1-1 rack1-2 rack2-3",
    "n[9-11]": "n9 n10 n11",
    "n[01-2]": "n01 n02",
    "n[1-02]": "n1 n2",
    "n[1,1]": "n1 n1",
    "a,,b": "a b",
    "n[1-2][3-4]": "n13 n14 n23 n24",
    "n[1- 2]": "n1 n2",
    "rack[1-2]-n[1-2]": "rack1-n1 rack1-n2 rack2-n1 rack2-n2",
}


@pytest.mark.parametrize(("nodelist", "expected"), SCONTROL_SAYS.items())
def test_hostnames_as_scontrol_expands_them(nodelist, expected):
    assert list(hostnames(nodelist)) == expected.split()


@pytest.mark.parametrize("nodelist", ["n[3-1]", "n[a-b]", "n[]", "node[01-04", "node]1",
                                      "n[[1]]", "", " , "])
def test_hostnames_refuses_what_scontrol_refuses(nodelist):
    with pytest.raises(ValueError):
        list(hostnames(nodelist))


def test_a_malformed_list_is_refused_before_any_name():
    names = hostnames("good[1-2],bad[2-1]")
    with pytest.raises(ValueError, match="counts down"):
        next(names)


def test_hostnames_is_lazy_on_a_list_of_a_million_hosts():
    first_three = list(itertools.islice(hostnames("nid[0000000-0999999]"), 3))
    assert first_three == ["nid0000000", "nid0000001", "nid0000002"]


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node[01-04,07],gpu5", "node01"),
        ("a1,b2", "a1"),
        ("host-[3-5]-ib", "host-3-ib"),
        ("single", "single"),
        ("nid[000123]", "nid000123"),
        ("gpu[7,1-3]", "gpu7"),
        ("rack[2-3]-node[010-012],login", "rack2-node010"),
        ("n[0009-0011]", "n0009"),
        ("cpu12,gpu[01-02]", "cpu12"),
        ("10.1.2.[5-6]", "10.1.2.5"),
    ],
)
def test_first_host(nodelist, expected):
    assert first_host(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["", ",a1", "node[01-04", "node]1", "node[a-b]", "n[[1]]"])
def test_first_host_rejects_malformed(nodelist):
    with pytest.raises(ValueError):
        first_host(nodelist)


def expand(nodelist: str) -> list[str]:
    """Reference expansion of a Slurm node list, written for clarity, not speed."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        pieces = [""]
        for text, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            options = [""]
            if body:
                options = []
                for part in body.split(","):
                    lo, _, hi = part.partition("-")
                    hi = hi or lo
                    options += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
            pieces = [p + text + o for p in pieces for o in options]
        hosts += pieces
    return hosts


ranges = st.tuples(st.integers(0, 500), st.integers(0, 3), st.integers(1, 4)).map(
    lambda t: f"{t[0]:0{t[2]}d}" + (f"-{t[0] + t[1]:0{t[2]}d}" if t[1] else "")
)
words = st.text("abcxyz-.", min_size=1, max_size=5).filter(lambda w: not w[0].isdigit())
groups = st.lists(ranges, min_size=1, max_size=3).map(lambda rs: "[" + ",".join(rs) + "]")
hosts = st.lists(st.one_of(words, groups), min_size=1, max_size=4).map("".join)


@given(st.lists(hosts, min_size=1, max_size=4).map(",".join))
def test_hostnames_and_first_host_match_the_reference_expansion(nodelist):
    names = expand(nodelist)
    assert list(hostnames(nodelist)) == names
    assert first_host(nodelist) == names[0]


# --- the srun step ----------------------------------------------------------------------------

TASK_1 = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
          "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[01-02]",
          "SLURMD_NODENAME": "node02"}


def test_step_of_an_srun_task():
    found = step(TASK_1)
    assert found == Step(job_id=41, step_id=0, task=1, tasks=2, nodelist="node[01-02]",
                         node="node02")
    assert found is not None and found.name == "41.0"


def test_a_batch_script_without_srun_is_no_step():
    batch = {k: v for k, v in TASK_1.items() if k not in ("SLURM_STEP_NUM_TASKS",
                                                          "SLURM_STEP_ID")}
    batch |= {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert step(batch) is None


@pytest.mark.parametrize("name", ["SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
                                  "SLURM_STEP_NODELIST"])
def test_no_step_without_each_of_its_variables(name):
    assert step({k: v for k, v in TASK_1.items() if k != name}) is None
    assert step(TASK_1 | {name: ""}) is None


def test_a_step_without_a_step_id_is_named_by_its_job():
    found = step({k: v for k, v in TASK_1.items() if k != "SLURM_STEP_ID"})
    assert found is not None and found.name == "41" and found.step_id is None


@pytest.mark.parametrize(("clock", "expected"), [("1-02:03:04", 93784), ("00:01:00", 60),
                                                 ("05:00", 300), ("00:01:11", 71),
                                                 ("UNLIMITED", None), ("", None)])
def test_seconds_of_slurm_durations(clock, expected):
    assert seconds(clock) == expected


# --- why Slurm ends a job (scontrol's answer, from a stand-in on PATH) ------------------------


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """Put a stand-in scontrol first on PATH that prints one line of job fields, or (exit
    code not 0) an error on stderr, as scontrol does."""

    def says(fields: str, code: int = 0) -> None:
        script = tmp_path / "scontrol"
        out = "" if code == 0 else " >&2"
        script.write_text(f"#!/bin/sh\necho '{fields}'{out}\nexit {code}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return says


def test_ending_of_a_cancelled_job(scontrol):
    scontrol("JobId=41 JobName=t JobState=COMPLETING Reason=None RunTime=00:00:03 "
             "TimeLimit=00:10:00 ExitCode=0:15")
    assert ending(41) == "Slurm cancelled job 41 (scancel), 3 s after it started"


@pytest.mark.parametrize("fields", [
    "JobId=41 JobState=COMPLETING Reason=TimeLimit RunTime=00:01:11 TimeLimit=00:01:00",
    "JobId=41 JobState=TIMEOUT Reason=None RunTime=00:01:02 TimeLimit=00:01:00",
    "JobId=41 JobState=COMPLETING Reason=None RunTime=00:01:31 TimeLimit=00:01:00",
])
def test_ending_at_the_time_limit(scontrol, fields):
    scontrol(fields)
    assert ending(41) == "job 41 reached its time limit (00:01:00)"


def test_ending_of_a_job_slurm_still_runs(scontrol):
    scontrol("JobId=41 JobState=RUNNING Reason=None RunTime=00:00:09 TimeLimit=UNLIMITED")
    assert ending(41) == "not a scancel or the time limit: job 41 is still RUNNING"


def test_ending_when_scontrol_fails_says_so(scontrol):
    scontrol("slurm_load_jobs error: Invalid job id specified", code=1)
    words = ending(41)
    assert words.startswith("Slurm's job 41: its state is unknown (scontrol exited 1")
    assert "Invalid job id" in words


def test_ending_without_scontrol_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ending(41) == "Slurm's job 41: its state is unknown (scontrol is not on PATH)"


def test_job_fields_bounds_a_scontrol_that_does_not_answer(tmp_path, monkeypatch):
    script = tmp_path / "scontrol"
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(OSError, match="did not answer within 0.2 s"):
        slurm.job_fields(41, timeout_s=0.2)
