"""What Slurm says to a process it started: the node list, the srun step, and why it stops us.

Three things, each read here once:

- ``hostnames(nodelist)``: Slurm's compressed node list, expanded in Slurm's order, lazily
  (``scontrol show hostnames`` does the same): ``"node[01-03,07],gpu5"`` -> node01, node02,
  node03, node07, gpu5; ``"rack[1-2]-n[1-2]"`` -> rack1-n1, rack1-n2, rack2-n1, rack2-n2 (the
  last bracket varies fastest); a low bound's leading zeros set the width (``n[08-10]`` ->
  n08, n09, n10; ``n[8-10]`` -> n8, n9, n10). ``first_host`` is its first name, in O(length
  of the text) however many hosts the list holds.
- ``step(env)``: the srun step this process is a task of (``Step``: job, step, task, tasks,
  node list), or None outside one. A batch script run without srun is no step: it inherits
  SLURM_PROCID=0 and the job's SLURM_NTASKS, which describe the allocation, not this process.
- ``ending(job_id)``: why Slurm ends a job, asked of ``scontrol`` when a task gets SIGTERM.
  While Slurm stops a job it shows ``JobState=COMPLETING`` with ``Reason=None`` both for an
  ``scancel`` and for the time limit (seen with Slurm 22.05; only the time limit adds
  ``Reason=TimeLimit``), so the time limit is told by that reason or by the run time (71 s
  into a limit of 00:01:00: slurmctld checks the limits every 30 s); anything else is a
  cancel. A job still RUNNING was not cancelled: srun passed on a Ctrl-C, or someone sent the
  signal by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_PROCID = "SLURM_PROCID"
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURMD_NODENAME = "SLURMD_NODENAME"
SCONTROL_S = 5.0  # how long ``ending`` waits for scontrol's answer

_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")
_FIELD = re.compile(r"(\w+)=(\S*)")
_CLOCK = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")


Range = tuple[int, int, int]  # low, high, width: '08-10' -> (8, 10, 2)


def _ranges(body: str, at: int) -> list[Range]:
    """One bracket's body as its ranges, checked: '01-03,7' -> [(1, 3, 2), (7, 7, 1)]."""
    ranges: list[Range] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"'[{body}]' at position {at} is not a list of numbers or ranges "
                             f"like 01-04")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise ValueError(f"'{part.strip()}' in '[{body}]' at position {at} counts down")
        ranges.append((low, high, len(match[1])))
    return ranges


Piece = str | list[Range]  # a literal, or a bracket's ranges


def _pieces(item: str, offset: int) -> list[Piece]:
    """One comma-free host pattern as its literal and bracketed pieces:
    'rack[1-2]-n7' -> ['rack', [(1, 2, 1)], '-n7']."""
    pieces: list[Piece] = []
    text = ""
    i = 0
    while i < len(item):
        ch = item[i]
        if ch == "]":
            raise ValueError(f"']' at position {offset + i} closes no '['")
        if ch != "[":
            text += ch
            i += 1
            continue
        end = item.find("]", i)
        if end < 0 or "[" in item[i + 1:end]:
            raise ValueError(f"'[' at position {offset + i} is not closed")
        pieces += [text, _ranges(item[i + 1:end], offset + i)]
        text = ""
        i = end + 1
    return pieces + [text]


def _names(pieces: list[Piece]) -> Iterator[str]:
    """Every name of one pattern, the last bracket varying fastest, made one at a time (a
    bracket of a million numbers is never held as a million strings)."""
    if not pieces:
        yield ""
        return
    head, rest = pieces[0], pieces[1:]
    firsts: Iterator[str] = iter([head]) if isinstance(head, str) else (
        str(n).zfill(width) for low, high, width in head for n in range(low, high + 1))
    for first in firsts:
        for tail in _names(rest):
            yield first + tail


def _items(nodelist: str) -> Iterator[tuple[str, int]]:
    """The comma-separated host patterns (a comma inside brackets belongs to them), each with
    its position: 'a[1,2],b' -> ('a[1,2]', 0), ('b', 7)."""
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth <= 0:
            yield nodelist[start:i], start
            depth, start = 0, i + 1


def hostnames(nodelist: str) -> Iterator[str]:
    """Expand a Slurm node list, lazily, in Slurm's order (see the module). A malformed list
    raises ValueError saying where, before any name is given (each pattern is read whole
    first); blank items between commas are skipped, as Slurm does ('a,,b' -> a, b)."""
    patterns = [_pieces(item.strip(), at) for item, at in _items(nodelist) if item.strip()]
    if not patterns:
        raise ValueError("no host in it")
    for pieces in patterns:
        yield from _names(pieces)


def first_host(nodelist: str) -> str:
    """The first host of a node list: 'node[01-04,07],gpu5' -> 'node01' (ValueError when it is
    malformed, or when its first item is empty: ',a1')."""
    if not nodelist.strip() or not nodelist.split(",", 1)[0].strip():
        raise ValueError("no host before the first ','")
    return next(hostnames(nodelist))


@dataclass(frozen=True)
class Step:
    """One task's view of its srun step: job 41, step 0, task 1 of 2 on 'node[01-02]'."""

    job_id: int
    step_id: int | None
    task: int
    tasks: int
    nodelist: str
    node: str | None  # SLURMD_NODENAME: the node this task runs on

    @property
    def name(self) -> str:
        """Slurm's name of the step: '41.0' (job 41, step 0), or '41' without a step id."""
        return str(self.job_id) if self.step_id is None else f"{self.job_id}.{self.step_id}"


def _number(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    return int(text) if text.isdigit() else None


def step(env: Mapping[str, str]) -> Step | None:
    """The srun step this process is a task of, or None: outside Slurm, in a batch script run
    without srun (no SLURM_STEP_NUM_TASKS), or where a variable is not a number."""
    job, task, tasks = (_number(env, n) for n in (SLURM_JOB_ID, SLURM_PROCID,
                                                   SLURM_STEP_NUM_TASKS))
    nodelist = env.get(SLURM_STEP_NODELIST, "").strip()
    if job is None or task is None or tasks is None or not nodelist:
        return None
    return Step(job, _number(env, SLURM_STEP_ID), task, tasks, nodelist,
                env.get(SLURMD_NODENAME, "").strip() or None)


def seconds(clock: str) -> int | None:
    """Slurm's durations: '1-02:03:04' -> 93784, '00:01:00' -> 60, '05:00' -> 300; None for
    'UNLIMITED' or anything else."""
    match = _CLOCK.fullmatch(clock.strip())
    if match is None:
        return None
    days, hours, minutes, secs = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def job_fields(job_id: int, timeout_s: float = SCONTROL_S) -> dict[str, str]:
    """``scontrol show job -o JOB``'s fields (JobState, RunTime, TimeLimit, ...). Raises
    OSError when scontrol is missing, fails or does not answer within ``timeout_s``.

    While Slurm stops a step it sends SIGTERM to every process of the step more than once,
    and a scontrol started meanwhile would die of it (seen: exit -15): it runs with SIGTERM
    ignored (a shell's ``trap`` before ``exec``), asked again should a signal still get it
    before the trap (up to 3 tries); Slurm's SIGKILL after KillWait ends it all the same."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise OSError("scontrol is not on PATH")
    argv = ["sh", "-c", 'trap "" TERM; exec "$0" "$@"', scontrol, "show", "job", "-o",
            str(job_id)]
    deadline = time.monotonic() + timeout_s
    for _ in range(3):
        try:
            done = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            raise OSError(f"scontrol did not answer within {timeout_s:g} s") from None
        if done.returncode >= 0:
            break
    if done.returncode != 0:
        raise OSError(f"scontrol exited {done.returncode}: {done.stderr.strip()}")
    return dict(_FIELD.findall(done.stdout))


def ending(job_id: int, timeout_s: float = SCONTROL_S) -> str:
    """Why Slurm stops job ``job_id``, in words for a last line (see the module):
    'Slurm cancelled job 41 (scancel), 3 s after it started', 'job 41 reached its time limit
    (00:01:00)', 'not a scancel or the time limit: job 41 is still RUNNING' (srun passing
    on a Ctrl-C, or a kill by hand), or what kept scontrol from saying."""
    try:
        fields = job_fields(job_id, timeout_s)
    except OSError as err:
        return f"Slurm's job {job_id}: its state is unknown ({err})"
    state = fields.get("JobState", "?")
    limit_text = fields.get("TimeLimit", "?")
    run, limit = seconds(fields.get("RunTime", "")), seconds(limit_text)
    if state in ("RUNNING", "PENDING", "SUSPENDED"):
        return f"not a scancel or the time limit: job {job_id} is still {state}"
    reason = fields.get("Reason", "")
    timed_out = run is not None and limit is not None and run >= limit
    if state == "TIMEOUT" or reason == "TimeLimit" or timed_out:
        return f"job {job_id} reached its time limit ({limit_text})"
    if state in ("CANCELLED", "COMPLETING"):
        after = "" if run is None else f", {run} s after it started"
        return f"Slurm cancelled job {job_id} (scancel){after}"
    return f"Slurm ends job {job_id} (JobState={state})"
