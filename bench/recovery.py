"""Training on after a rank dies: elastic recovery (tensorplay-run) against restart-the-world.

    python bench/recovery.py                # 3 runs of each of 4 sides; ~7 min on 2 cores
    python bench/recovery.py --repeat 1     # one of each (~2 min)
    python bench/recovery.py --host-loss    # a whole host lost instead: recovery_hosts.py

Ours, as tensorplay-run runs it (``python -m tensorplay.distributed.run`` is tensorplay-run):

    tensorplay-run --nproc-per-node 8 --max-restarts 1 \
        examples/train_elastic.py --steps 16 --kill 5@4 --step-s 1.0

with ranks started cold (``--no-warm``: fresh interpreters, as torchrun starts them); the same
with ``--max-restarts 0`` ("shrink": nobody is restarted, so the first step after the kill is
always on the shrunk mesh; with a replacement that is back within about 2 s the mesh often grows
again before that step, and that run has no step on (1, 4) to time); and "warm", tensorplay-run
as it starts by default: every rank, the replacement too, forked from one process that has
imported torch.

Theirs, restart-the-world: the same training on plain torch.distributed (gloo, torch's own
``init_device_mesh``), a checkpoint saved by every rank after every step and loaded at start:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 8 --max-restarts 1 \
        bench/recovery_job_torch.py --ckpt-dir TMP --steps 16 --kill 5@4 --step-s 1.0

Both run the (2, 4) "dp" x "tp" MLP of examples/train_dp_tp.py with the same weights and
batches (so the same losses), each step sleeping --step-s before its compute (standing in for
a real model's compute); rank 5 SIGKILLs itself as it starts step 5 (after --kill-step steps),
on the first run only. torchrun keeps its defaults: rendezvous c10d on a free local port (what
it picks for one node with no --master-port), --monitor-interval 0.1 s, SIGTERM then SIGKILL
after 30 s to stop the other workers, then all 8 started again. One environment variable is
set for it: in torch 2.13 torchrun's default shared rendezvous store keeps the gloo addresses
of the first attempt, and every restart we tried died in ``init_process_group`` ("Gloo
connectFullMesh failed ... Connection refused", both tries here; pytorch/pytorch#135712);
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch's documented opt-out, makes it work.
``--torch-shared-store`` runs it without that, to see the failure.

Measured from the ``t=<unix time>`` on the lines the jobs print (rank 0's, and the killed or
restarted rank's). "less one step": the step's --step-s sleep is taken off the time to that
step's end, so the figure is the time until the job had trained again had the step been its
real compute only (the sleep stands in for a model's compute, which is not what is measured):

- ours, kill -> shrunk mesh: the kill to rank 0's "recovered: mesh (1, 4)" (the survivors
  agreed on the loss and built the shrunk mesh). Includes the survivors finishing the sleep of
  the step they were in: they notice the loss only when their next collective fails;
- ours, kill -> first step on the shrunk mesh, less one step (the issue's goal: <= 3 s);
- ours, kill -> the replacement's process start (tensorplay-run's reaction); from that start
  to its ``main()`` (interpreter and imports), to its ``init_device_mesh`` returning (joined),
  and to the first step on the regrown (2, 4) mesh, less one step (the issue's second figure);
  kill -> first step on (2, 4) again, less one step; the same, and kill -> joined, warm;
- theirs, kill -> first step after the restart, less one step, and its parts: kill -> rank 0's
  new process start (torchrun's reaction), that start -> checkpoint loaded (interpreter, torch
  imports, ``init_process_group``, mesh, ``torch.load``).

A process's start is read from /proc while the job runs (its ``starttime``, about 10 ms
resolution), which rank and which run of it from its environment (RANK, and
TENSORPLAY_RESTART_COUNT or TORCHELASTIC_RESTART_COUNT).

Goals (issue): the first step on the shrunk mesh within 3 s of the kill (the slowest run
counts), kill -> first step at least 10x faster than restart-the-world (median over repeats of
theirs/ours within each pair of runs), and warm, kill -> first step on the regrown mesh, less
one step, within 1 s (slowest run). Each run also checks its result: ours
prints "OK" when its weights match one-process training, and both print each step's loss.

Every run is bounded (--limit-s, and --exit-grace-s after the last step) and leaves nothing
behind, even on Ctrl-C: this process is the child subreaper, so ranks whose launcher ends are
its descendants and are killed by pid at the end of each run; the logs, the checkpoints and
whatever the jobs put in TMPDIR (torchrun's torchelastic_* folder, which it does not remove)
live in a temporary folder removed at the end (--keep-logs copies the logs first).

The tables and the goal block are printed and written to bench/results/recovery.json and .md
(--out to change it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    BENCH,
    ROOT,
    become_subreaper,
    descendants,
    fmt_time,
    live,
    machine,
    no_interrupts,
    on_sigterm,
    paired,
    pythonpath,
    reap_orphans,
    send,
    tree_state,
)
from _results import add_out, recorded

from tensorplay.distributed.host import procfs

NPROC = 8
KILL_RANK = 5
POLL_S = 0.1
STOP_GRACE_S = 5.0  # after SIGTERM to a launcher, before SIGKILL to everything below us
GOAL_SHRINK_S = 3.0
GOAL_RATIO = 10.0
GOAL_BACK_S = 1.0  # warm: kill -> the replacement back in the full mesh
# the sides run by tensorplay-run ("torch" is torchrun's): "ours" and "shrink" start their ranks
# cold (--no-warm), as torchrun does; "warm" forks them (the replacement too) from a warm process
OURS = ("ours", "warm", "shrink")
RESTARTING = ("ours", "warm")
NAMES = {"ours": "tensorplay-run (elastic, --max-restarts 1)",
         "warm": "tensorplay-run warm (elastic, --max-restarts 1)",
         "shrink": "tensorplay-run (elastic, --max-restarts 0)",
         "torch": "torchrun (restart-the-world)"}

T = r"\s+t=(?P<t>\d+\.\d+)"
KILL = re.compile(r"rank (?P<rank>\d+) kills itself at step (?P<step>\d+)" + T)
RECOVERED = re.compile(r"rank \d+ recovered: mesh \((?P<dp>\d+), (?P<tp>\d+)\) at epoch "
                       r"(?P<epoch>\d+).*?" + T)
OUR_STEP = re.compile(r"step (?P<k>\d+)/(?P<n>\d+)\s+mesh \((?P<dp>\d+), (?P<tp>\d+)\) epoch "
                      r"(?P<epoch>\d+)\s+loss (?P<loss>[\d.]+)" + T)
JOINED = re.compile(r"rank (?P<rank>\d+) restarted at t=(?P<start>\d+\.\d+), joined the mesh "
                    r"\((?P<dp>\d+), (?P<tp>\d+)\) at epoch (?P<epoch>\d+)" + T)
ATTEMPT = re.compile(r"attempt (?P<a>\d+) started at t=(?P<start>\d+\.\d+), resumed at step "
                     r"(?P<step>\d+)" + T)
THEIR_STEP = re.compile(r"step (?P<k>\d+)/(?P<n>\d+)\s+mesh \((?P<dp>\d+), (?P<tp>\d+)\)\s+"
                        r"attempt (?P<a>\d+)\s+loss (?P<loss>[\d.]+)" + T)


@dataclass
class Run:
    """One run of one side: its exit and the figures read off its log (seconds, or None)."""

    side: str
    code: int | None = None  # launcher exit code (negative: its signal); None: stopped by us
    note: str = ""  # what went wrong, if anything
    wall_s: float = 0.0
    left_behind: int = 0  # processes below this one alive after the launcher exited
    final_loss: str = "-"
    ok_line: str = ""  # ours: the OK / MISMATCH line
    fig: dict[str, float | None] = field(default_factory=dict)


# -- processes --------------------------------------------------------------------------------

class RankStarts:
    """The wall-clock start of every rank process below this one, read from /proc while the
    job runs (``starttime`` against /proc/uptime: ~10 ms resolution), with its RANK and
    restart count from its environment: a restarted rank's start is when the launcher started
    its process, before the interpreter and its imports."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int, float] | None] = {}  # pid -> (rank, restart, t)
        self.tick = os.sysconf("SC_CLK_TCK")

    def scan(self) -> None:
        for pid in live(descendants(os.getpid())):
            if pid in self.seen:
                continue
            fields, env = procfs.stat_fields(pid), procfs.environ(pid)
            if fields is None:
                continue  # gone meanwhile
            try:
                started = int(fields[19])
                uptime = float(Path("/proc/uptime").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue
            now = time.time()
            if "RANK" not in env or "LOCAL_RANK" not in env:
                self.seen[pid] = None  # a launcher, or a helper process
                continue
            restart = env.get("TENSORPLAY_RESTART_COUNT") or env.get(
                "TORCHELASTIC_RESTART_COUNT") or "0"
            self.seen[pid] = (int(env["RANK"]), int(restart), now - (uptime - started / self.tick))

    def start(self, rank: int, restart: int) -> float | None:
        """When the process of ``rank``'s ``restart``-th run started (unix time), if seen."""
        return next((t for v in self.seen.values() if v is not None
                     for r, n, t in [v] if r == rank and n == restart), None)


# -- one run ----------------------------------------------------------------------------------

def _argv(side: str, a: argparse.Namespace, ckpt: Path) -> tuple[list[str], dict[str, str]]:
    job = ["--steps", str(a.steps), "--kill", f"{KILL_RANK}@{a.kill_step}",
           "--step-s", str(a.step_s)]
    env = dict(os.environ, PYTHONPATH=pythonpath(),
               TMPDIR=str(ckpt.parent))  # torchrun makes a torchelastic_* folder and keeps it
    if side in OURS:  # "shrink" restarts nobody: its first step after the kill is on (1, 4)
        # --no-warm: ranks as fresh interpreters, as torchrun's, found by their environment
        cold = [] if side == "warm" else ["--no-warm"]
        return ([sys.executable, "-m", "tensorplay.distributed.run", *cold,
                 "--nproc-per-node", str(NPROC),
                 "--max-restarts", "1" if side in RESTARTING else "0",
                 os.path.join(ROOT, "examples", "train_elastic.py"), *job], env)
    if not a.torch_shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
             "--max-restarts", "1", os.path.join(BENCH, "recovery_job_torch.py"),
             "--ckpt-dir", str(ckpt), *job], env)


def _finished(side: str, text: str, steps: int) -> bool:
    """Whether the log shows the end of training (ours: its check's verdict)."""
    if side in OURS:
        return "OK: matches" in text or "MISMATCH" in text
    return any(int(m["k"]) == steps for m in THEIR_STEP.finditer(text))


def run_once(side: str, a: argparse.Namespace, tmp: Path, index: int) -> Run:
    """One launcher run, bounded; every process below this one is gone when it returns."""
    run = Run(side)
    log = tmp / f"{side}-{index}.log"
    ckpt = tmp / f"ckpt-{index}"
    ckpt.mkdir()
    argv, env = _argv(side, a, ckpt)
    print(f"  {side} #{index}: starting (load average {os.getloadavg()[0]:.1f})",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    starts = RankStarts()
    try:
        finished_at = None
        while proc.poll() is None:
            starts.scan()
            now = time.monotonic()
            if finished_at is None and _finished(side, log.read_text(errors="replace"),
                                                 a.steps):
                finished_at = now
            if now - start > a.limit_s:
                run.note = f"still running at the {a.limit_s:g} s limit; stopped"
                break
            if finished_at is not None and now - finished_at > a.exit_grace_s:
                run.note = (f"training done, but the launcher had not exited "
                            f"{a.exit_grace_s:g} s later; stopped")
                break
            time.sleep(POLL_S)
        run.code = proc.poll()
        run.wall_s = time.monotonic() - start
        if run.code is not None:
            time.sleep(1.0)
            run.left_behind = len(live(descendants(os.getpid())))
    finally:
        with no_interrupts():
            if proc.poll() is None:  # the launcher stops its ranks on SIGTERM; then no mercy
                send([proc.pid], signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_GRACE_S)
            send(live(descendants(os.getpid())), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            reap_orphans(skip=[proc.pid])
    text = log.read_text(errors="replace")
    (_read_ours if side in OURS else _read_theirs)(run, text, a, starts)
    if run.code not in (0, None) and not run.note:
        run.note = f"launcher exit code {run.code}"
    if a.keep_logs is not None:
        a.keep_logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, a.keep_logs / log.name)
    shutil.rmtree(ckpt, ignore_errors=True)
    shown = {k: (None if v is None else round(v, 2)) for k, v in run.fig.items()}
    print(f"    {side} #{index}: exit {run.code}, {run.wall_s:.0f} s; {shown}"
          + (f"; {run.note}" if run.note else ""), file=sys.stderr, flush=True)
    return run


def _since(t: float | None, t0: float | None, less: float = 0.0) -> float | None:
    return None if t is None or t0 is None else t - t0 - less


def _read_ours(run: Run, text: str, a: argparse.Namespace, starts: RankStarts) -> None:
    kill = next((float(m["t"]) for m in KILL.finditer(text)), None)
    recovered = next((m for m in RECOVERED.finditer(text) if int(m["dp"]) < 2), None)
    steps = list(OUR_STEP.finditer(text))
    shrunk = next((m for m in steps if int(m["dp"]) < 2 and kill is not None
                   and float(m["t"]) > kill), None)
    joined = next((m for m in JOINED.finditer(text) if int(m["rank"]) == KILL_RANK), None)
    regrown = next((m for m in steps if int(m["dp"]) == 2 and int(m["epoch"]) >= 2
                    and kill is not None and float(m["t"]) > kill), None)
    t = {"kill": kill, "recovered": recovered and float(recovered["t"]),
         "shrunk": shrunk and float(shrunk["t"]), "start": starts.start(KILL_RANK, 1),
         "main": joined and float(joined["start"]), "joined": joined and float(joined["t"]),
         "regrown": regrown and float(regrown["t"])}
    s = a.step_s
    run.fig = {"kill_agreed": _since(t["recovered"], t["kill"]),
               "kill_step": _since(t["shrunk"], t["kill"], s),
               "kill_start": _since(t["start"], t["kill"]),
               "start_main": _since(t["main"], t["start"]),
               "start_joined": _since(t["joined"], t["start"]),
               "start_regrown": _since(t["regrown"], t["start"], s),
               "kill_joined": _since(t["joined"], t["kill"]),
               "kill_regrown": _since(t["regrown"], t["kill"], s)}
    if joined is not None and int(joined["dp"]) < 2:
        run.note = (f"rank {KILL_RANK}'s replacement joined as a spare (mesh ({joined['dp']}, "
                    f"{joined['tp']})), "
                    + ("never on a regrown mesh" if regrown is None else "then grew back"))
    elif joined is None and run.side in RESTARTING:  # "shrink" restarts nobody
        run.note = f"rank {KILL_RANK}'s replacement never joined"
    if recovered is None:
        run.note = "; ".join([*_ours_trouble(text), run.note])
    run.final_loss = steps[-1]["loss"] if steps else "-"
    run.ok_line = next((line for line in text.splitlines()
                        if "OK: matches" in line or "MISMATCH" in line), "")


def _ours_trouble(text: str) -> list[str]:
    """Why ours did not recover: tensorplay-run's lines on other ranks lost, and the first
    error other than the expected RankFailedError (a ShrinkError, ...), each cut short."""
    lost = [line.strip() for line in text.splitlines()
            if line.startswith("tensorplay-run: rank") and " lost (" in line
            and not line.startswith(f"tensorplay-run: rank {KILL_RANK} ")]
    error = next((m.group(0) for m in re.finditer(r"\b(?!RankFailedError)\w+Error: [^\n]*", text)),
                 None)
    return [line[:160] for line in [*lost[:2], *([error] if error else [])]]


def _read_theirs(run: Run, text: str, a: argparse.Namespace, starts: RankStarts) -> None:
    kill = next((float(m["t"]) for m in KILL.finditer(text)), None)
    again = next((m for m in ATTEMPT.finditer(text) if int(m["a"]) >= 1), None)
    steps = list(THEIR_STEP.finditer(text))
    first = next((m for m in steps if int(m["a"]) >= 1), None)
    start = starts.start(0, 1)
    run.fig = {"kill_step": _since(first and float(first["t"]), kill, a.step_s),
               "kill_start": _since(start, kill),
               "start_main": _since(again and float(again["start"]), start),
               "start_loaded": _since(again and float(again["t"]), start)}
    if again is None:
        run.note = "no restarted attempt reached its checkpoint"
        failed = next((line.strip() for line in text.splitlines()
                       if "connectFullMesh failed" in line or "Error:" in line), "")
        if failed:
            run.note += f": {failed[:160]}"
    run.final_loss = steps[-1]["loss"] if steps else "-"


# -- report -----------------------------------------------------------------------------------

def _cell(runs: list[Run], key: str) -> str:
    """'median (min-max)' over the runs that have the figure, or what is missing."""
    values = [r.fig.get(key) for r in runs]
    have = [v for v in values if v is not None]
    if not have:
        return "- (never)"
    text = fmt_time(statistics.median(have))
    if len(have) > 1:
        text += f" ({fmt_time(min(have))} - {fmt_time(max(have))})"
    if len(have) < len(values):
        text += f", missing in {len(values) - len(have)} of {len(values)}"
    return text


ROWS = [
    ("ours", "kill_agreed", "kill -> shrunk mesh agreed (\"recovered: mesh (1, 4)\")"),
    ("shrink", "kill_agreed", "kill -> shrunk mesh agreed (\"recovered: mesh (1, 4)\")"),
    ("shrink", "kill_step", "**kill -> first step on the shrunk mesh**, less one step"),
    ("ours", "kill_step", "kill -> first step on the shrunk mesh, less one step (none when "
                          "the replacement was back first: the mesh grew before that step)"),
    ("ours", "kill_start", "kill -> replacement's process start"),
    ("ours", "start_main", "replacement's start -> its main() began (interpreter, imports of "
                           "torch and tensorplay)"),
    ("ours", "start_joined", "replacement's start -> joined (init_device_mesh returned)"),
    ("ours", "start_regrown", "replacement's start -> first step on the regrown (2, 4) mesh, "
                              "less one step"),
    ("ours", "kill_joined", "kill -> replacement joined the full mesh (init_device_mesh "
                            "returned)"),
    ("ours", "kill_regrown", "kill -> first step on the regrown (2, 4) mesh, less one step"),
    ("warm", "kill_joined", "kill -> replacement joined the full mesh (forked from the warm "
                            "process; its process start is not read from /proc)"),
    ("warm", "kill_regrown", "**kill -> first step on the regrown (2, 4) mesh**, less one "
                             "step"),
    ("torch", "kill_start", "kill -> restarted rank 0's process start"),
    ("torch", "start_loaded", "restarted rank 0's start -> checkpoint loaded (+ torch imports, "
                              "init_process_group, mesh, torch.load)"),
    ("torch", "kill_step", "**kill -> first step after the restart**, less one step"),
]


def _sides(i: int) -> tuple[str, ...]:
    """The order of the sides in repeat i: alternating, so neither always runs first."""
    return (("ours", "warm", "shrink", "torch") if i % 2 == 0
            else ("torch", "shrink", "warm", "ours"))


def report(results: dict[str, list[Run]], a: argparse.Namespace) -> None:
    n = len(results["ours"])
    print(f"\n### Recovery after rank {KILL_RANK} is SIGKILLed at step {a.kill_step + 1} "
          f"(8 gloo ranks, (2, 4) mesh, {a.steps} steps of {a.step_s:g} s + compute; "
          f"median (min - max) of {n} run(s) each)\n")
    print("| side | interval | time |")
    print("|---|---|---:|")
    for side, key, label in ROWS:
        name = NAMES[side]
        print(f"| {name} | {label} | {_cell(results[side], key)} |")
    ours = [r.fig.get("kill_step") for r in results["shrink"]]
    theirs = [r.fig.get("kill_step") for r in results["torch"]]
    ratio = None
    if None not in ours and None not in theirs:
        ratio = paired(theirs, ours)
        print(f"\nkill -> first step, theirs/ours: {ratio:.1f}x (median over the {n} pairs of "
              f"runs of the ratio within each pair; per pair: "
              + ", ".join(f"{t / o:.1f}x" for t, o in zip(theirs, ours, strict=True)) + ")")
        raw = paired([t + a.step_s for t in theirs], [o + a.step_s for o in ours])
        print(f"With the step's {a.step_s:g} s sleep left in (kill -> the step's end): ours "
              f"{fmt_time(statistics.median(ours) + a.step_s)}, theirs "
              f"{fmt_time(statistics.median(theirs) + a.step_s)}, theirs/ours {raw:.1f}x.")
    print("\nPer run (in run order):\n")
    print("| run | side | exit code | wall | final loss | processes left behind | note |")
    print("|---:|---|---:|---:|---|---:|---|")
    order = [(side, i) for i in range(n) for side in _sides(i)]
    for side, i in order:
        r = results[side][i]
        code = "stopped" if r.code is None else str(r.code)
        note = r.note or (r.ok_line.split("] ", 1)[-1].split("  t=")[0] if r.ok_line else "")
        print(f"| {i + 1} | {side} | {code} | {r.wall_s:.0f} s | {r.final_loss} | "
              f"{r.left_behind} | {note.replace('|', '/')} |")
    goal(results, ratio)


def goal(results: dict[str, list[Run]], ratio: float | None) -> None:
    shrink = [r.fig.get("kill_step") for r in results["shrink"]]
    worst = None if None in shrink else max(shrink)
    ok1 = worst is not None and worst <= GOAL_SHRINK_S
    ok2 = ratio is not None and ratio >= GOAL_RATIO
    back = [r.fig.get("kill_regrown") for r in results["warm"]]
    back_worst = None if not back or None in back else max(back)
    ok3 = back_worst is not None and back_worst <= GOAL_BACK_S
    print(f"\n```\nGoal: first step on the shrunk mesh within {GOAL_SHRINK_S:g} s of the kill "
          f"(slowest run), >= {GOAL_RATIO:g}x faster than restart-the-world, and warm, the "
          f"replacement back in the full mesh within {GOAL_BACK_S:g} s of the kill.")
    print(f"  kill -> first shrunk step: "
          f"{'missing' if worst is None else fmt_time(worst)} [{'ok' if ok1 else 'MISSED'}]")
    print(f"  theirs/ours: {'-' if ratio is None else f'{ratio:.1f}x'} "
          f"[{'ok' if ok2 else 'MISSED'}]")
    print(f"  warm: kill -> first step on the regrown mesh (slowest run): "
          f"{'missing' if back_worst is None else fmt_time(back_worst)} "
          f"[{'ok' if ok3 else 'MISSED'}]")
    print(f"Goal met: {'YES' if ok1 and ok2 and ok3 else 'NO'}\n```")


def main() -> None:
    if "--host-loss" in sys.argv[1:]:  # a whole host lost: bench/recovery_hosts.py
        import recovery_hosts

        recovery_hosts.main([arg for arg in sys.argv[1:] if arg != "--host-loss"])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host-loss", action="store_true",
                   help="measure the loss of a whole host instead (bench/recovery_hosts.py, "
                        "its own options; needs root)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each side (default 3)")
    p.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    p.add_argument("--kill-step", type=int, default=4,
                   help=f"rank {KILL_RANK} kills itself after this many steps (default 4)")
    p.add_argument("--step-s", type=float, default=1.0,
                   help="sleep before each step's compute (default 1.0)")
    p.add_argument("--limit-s", type=float, default=180.0,
                   help="cap on one run's wall time (default 180)")
    p.add_argument("--exit-grace-s", type=float, default=30.0,
                   help="after the last step, how long a launcher may take to exit (default 30)")
    p.add_argument("--torch-shared-store", action="store_true",
                   help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset (torch's restart fails)")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the run logs here")
    add_out(p, __file__)
    a = p.parse_args()
    if not 0 < a.kill_step < a.steps:
        p.error("--kill-step must be between 1 and --steps - 1")
    become_subreaper()
    signal.signal(signal.SIGTERM, on_sigterm)
    with recorded(__file__, a.out):
        began = time.monotonic()
        print(f"recovery: tensorplay at {tree_state()}; {machine()}; "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
        print(f"command: {' '.join(['python', 'bench/recovery.py', *sys.argv[1:]])}",
              flush=True)
        results: dict[str, list[Run]] = {"ours": [], "warm": [], "shrink": [], "torch": []}
        tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
        try:
            for i in range(a.repeat):
                for side in _sides(i):
                    results[side].append(run_once(side, a, tmp, i + 1))
        except KeyboardInterrupt:
            print("recovery: interrupted; the run under way was stopped and cleaned up",
                  file=sys.stderr)
            sys.exit(130)
        finally:
            with no_interrupts():
                shutil.rmtree(tmp, ignore_errors=True)
        report(results, a)
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; wall time of this run: "
              f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
