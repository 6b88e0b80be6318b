"""Training on after a whole host is lost: elastic tensorplay-run against torchrun's restart.

    python bench/recovery_hosts.py               # 2 runs of each side; ~3 min on 2 cores
    python bench/recovery_hosts.py --repeat 1    # one of each
    python bench/recovery.py --host-loss         # the same, from the rank-loss benchmark

Needs root (network namespaces, as the multi-host tests: ``tests/netns.py``); elsewhere it
says so and exits 2. Two hosts, A (198.18.0.1, node 0, serving the job's store) and B
(198.18.0.2), each with its own host name, 4 gloo ranks each: the (2, 4) "dp" x "tp" job of
bench/recovery.py. Once rank 0 has done --kill-step steps, host B is lost whole: its launcher
and every process below it SIGKILLed at once, as a kernel panic leaves a machine.

- **ours**: ``tensorplay-run --nnodes 2 --node-rank i --nproc-per-node 4 --max-restarts 1
  examples/train_elastic.py --verbose ...`` on each host, every setting at its default
  (--node-grace-s 10). Host A's ranks shrink the mesh to (1, 4) and train on; once the first
  step on (1, 4) is seen, host B's launcher is started again with the same flags (a
  replacement host), its ranks join, and the mesh grows back to (2, 4);
- **theirs**: ``torchrun --nnodes 2 --nproc-per-node 4 --max-restarts 1 --rdzv-backend c10d
  --rdzv-endpoint 198.18.0.1:PORT bench/recovery_job_torch.py`` on each host, a checkpoint
  saved by every rank after every step (one folder both hosts see) and loaded at start; host
  B's torchrun is started again at once after the kill (the best case for a restart: the new
  host is there as soon as the old one is gone). Host A's torchrun sees its workers fail,
  stops them, and the two agents start all 8 again from the checkpoint. Set for it:
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it torch 2.13's restarts die in
  ``init_process_group``: bench/recovery.py) and ``GLOO_SOCKET_IFNAME`` (the host's one
  link: gloo does not find it from an unresolvable host name), and its flags ``--rdzv-conf
  is_host=1`` on host A (``0`` on B) and ``--local-addr`` (torchrun otherwise resolves the
  host name to decide who serves the rendezvous and where the workers meet); tensorplay-run
  needs nothing of the kind.

- **etcd** (``--sides ours,theirs`` leaves it out): ``tensorplay-run --store etcd`` on three hosts
  (each runs one etcd member of the job's store), the (3, 4) mesh; host A, node 0, is the
  host lost whole, and once the first step on (2, 4) is seen node 0's launcher is started
  again on host A with the same flags; the mesh grows back to (3, 4) (measured to the
  ``mesh grew back`` line: with --wait-full-s, the members wait for it after their last step).

Measured from the kill (this process's clock) to the ``t=<unix time>`` of the step lines both
jobs print, "less one step" as in bench/recovery.py (each step sleeps --step-s, standing in
for compute): ours, the loss to the first step on the shrunk (1, 4) mesh, and to the first
step on (2, 4) again after the replacement host joined; theirs, the loss to the first step
after the restart. Both hosts' outputs are read: torchrun may give rank 0 to either host
after its restart.

Goal (issue): the first step on the shrunk mesh within the node grace (10 s) plus 2 s of the
loss, in the slowest run, and at least 5x faster than torchrun's restart (median of the
ratios within each pair of runs). Every run is bounded (--limit-s) and leaves nothing behind
(every process started is killed by pid, the namespaces deleted, the checkpoints removed).
The tables are printed and written to bench/results/recovery_hosts.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, ROOT, descendants, fmt_time, machine, paired, pythonpath, tree_state
from _results import add_out, recorded

from tests import netns

NPROC = 4  # ranks per host
PORT = 29531
GRACE_S = 10.0  # tensorplay-run's default --node-grace-s
GOAL_SLACK_S = 2.0
GOAL_RATIO = 5.0
POLL_S = 0.1
T = r"\s+t=(?P<t>\d+\.\d+)"
THEIR_STEP = re.compile(r"step (?P<k>\d+)/\d+\s+mesh \(\d+, \d+\)\s+attempt (?P<a>\d+)\s+"
                        r"loss [\d.]+" + T)


def _ours(hosts: netns.Hosts, node: int, a: argparse.Namespace, store: str = "tcp"
          ) -> list[str]:
    wait = ["--wait-full-s", "120"] if store == "etcd" else []  # node 0 back before the end
    return [sys.executable, "-m", "tensorplay.distributed.run", "--store", store,
            "--nnodes", str(hosts.count), "--node-rank", str(node),
            "--nproc-per-node", str(NPROC), "--max-restarts", "1",
            "--master-addr", hosts.address(1), "--master-port", str(PORT),
            os.path.join(ROOT, "examples", "train_elastic.py"), "--steps", str(a.steps),
            "--step-s", str(a.step_s), "--verbose", *wait]


def _theirs(hosts: netns.Hosts, node: int, ckpt: Path, a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", str(NPROC), "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts.address(1)}:{PORT}", "--rdzv-id", "bench",
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", hosts.address(node + 1),
            os.path.join(BENCH, "recovery_job_torch.py"), "--ckpt-dir", str(ckpt),
            "--steps", str(a.steps), "--step-s", str(a.step_s), "--kill=-1@0"]


def _text(logs: list[Path]) -> str:
    return "\n".join(p.read_text(errors="replace") for p in logs if p.exists())


def _await(logs: list[Path], pattern: re.Pattern, since: float, deadline: float,
           hosts: netns.Hosts, watched: int = 0) -> float | None:
    """The unix time on the first line matching ``pattern`` at or after ``since`` (its ``t``),
    waiting until ``deadline`` (monotonic); None when it never came or the launcher
    ``watched`` (host A's; under etcd, where host A is the one lost, host B's) ended first."""
    while time.monotonic() < deadline:
        found = [float(m["t"]) for m in pattern.finditer(_text(logs)) if float(m["t"]) >= since]
        if found:
            return min(found)
        if hosts.procs[watched].poll() is not None:
            return None
        time.sleep(POLL_S)
    return None


def _kill_whole(pid: int) -> None:
    """SIGKILL a launcher and everything below it: the host lost whole (pids this run
    started, found through /proc)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _step_pattern(side: str, k: int) -> re.Pattern:
    if side != "theirs":
        return re.compile(rf"\[rank 0\] step {k}/\d+\s" + r".*" + T)
    return re.compile(rf"step {k}/\d+\s+mesh \(\d+, \d+\)\s+attempt 0\s" + r".*" + T)


def run_once(side: str, a: argparse.Namespace, tmp: Path, index: int) -> dict:
    """One run of one side on two fresh hosts; its figures (seconds, or None) and notes."""
    etcd = side == "etcd"  # three hosts, host A (node 0) lost
    victim, watched = (0, 1) if etcd else (1, 0)
    names = ("A", "B", "C", "A-again") if etcd else ("A", "B", "B-again")
    logs = [tmp / f"{side}-{index}-{name}.log" for name in names]
    ckpt = tmp / f"ckpt-{index}"
    ckpt.mkdir()
    fig: dict = {"side": side, "note": ""}
    print(f"  {side} #{index}: starting (load average {os.getloadavg()[0]:.1f})",
          file=sys.stderr, flush=True)
    began = time.monotonic()
    deadline = began + a.limit_s
    with netns.Hosts(3 if etcd else 2) as hosts:
        def start(node: int, log: Path) -> None:
            env = {"PYTHONPATH": pythonpath(), "TMPDIR": str(tmp)}
            if side != "theirs":
                hosts.start(node + 1, _ours(hosts, node, a, "etcd" if etcd else "tcp"), log,
                            env=env)
            else:
                env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                           GLOO_SOCKET_IFNAME=hosts.ns(node + 1), OMP_NUM_THREADS="1")
                hosts.start(node + 1, _theirs(hosts, node, ckpt, a), log, env=env)

        start(0, logs[0])
        time.sleep(1.0)  # host A's agent first: it serves the rendezvous (theirs)
        for node in range(1, hosts.count):
            start(node, logs[node])
        if _await(logs, _step_pattern(side, a.kill_step), 0.0, deadline, hosts) is None:
            fig["note"] = f"no step {a.kill_step} before the limit"
        else:
            killed = time.time()
            _kill_whole(hosts.procs[victim].pid)
            if etcd:
                shrunk = _await(logs, re.compile(r"\[rank \d+\] step \d+/\d+\s+mesh \(2, 4\)"
                                                 r".*" + T), killed, deadline, hosts, watched)
                fig["loss_step"] = None if shrunk is None else shrunk - killed - a.step_s
                start(0, logs[3])
                full = _await(logs, re.compile(r"mesh grew back to \(3, 4\).*" + T), killed,
                              deadline, hosts, watched)  # maybe after the last step: no step
                fig["loss_full"] = None if full is None else full - killed  # line on (3, 4)
            elif side == "theirs":
                start(1, logs[2])
                first = _await(logs, re.compile(THEIR_STEP.pattern.replace(
                    r"(?P<a>\d+)", r"(?P<a>[1-9]\d*)")), killed, deadline, hosts)
                fig["loss_step"] = None if first is None else first - killed - a.step_s
            else:
                shrunk = _await(logs, re.compile(r"\[rank 0\] step \d+/\d+\s+mesh \(1, 4\)"
                                                 r".*" + T), killed, deadline, hosts)
                fig["loss_step"] = None if shrunk is None else shrunk - killed - a.step_s
                start(1, logs[2])
                full = _await(logs, re.compile(r"\[rank 0\] step \d+/\d+\s+mesh \(2, 4\)"
                                               r" epoch [1-9]\d*.*" + T), killed, deadline, hosts)
                fig["loss_full"] = None if full is None else full - killed - a.step_s
            left = max(deadline - time.monotonic(), 1.0)
            codes = hosts.wait_all(timeout=left)
            fig["codes"] = codes
            text = _text(logs)
            if side != "theirs" and "OK: matches single-process training" not in text:
                fig["note"] = "no 'matches single-process training' line"
            if codes[watched] != 0:
                fig["note"] = (fig["note"] + "; " if fig["note"] else "") + \
                    f"host {'AB'[watched]}'s launcher exit {codes[watched]}"
        if a.keep_logs is not None:
            a.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in logs:
                if log.exists():
                    shutil.copy(log, a.keep_logs / log.name)
    shutil.rmtree(ckpt, ignore_errors=True)
    fig["wall_s"] = time.monotonic() - began
    shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in fig.items()}
    print(f"    {side} #{index}: {shown}", file=sys.stderr, flush=True)
    return fig


def _cell(runs: list[dict], key: str) -> str:
    have = [r[key] for r in runs if r.get(key) is not None]
    if not have:
        return "- (never)"
    text = fmt_time(statistics.median(have))
    if len(have) > 1:
        text += f" ({fmt_time(min(have))} - {fmt_time(max(have))})"
    if len(have) < len(runs):
        text += f", missing in {len(runs) - len(have)} of {len(runs)}"
    return text


def report(results: dict[str, list[dict]], a: argparse.Namespace) -> None:
    n = len(results["ours"])
    print(f"\n### Host B (4 of 8 gloo ranks) lost whole after step {a.kill_step} "
          f"((2, 4) mesh over 2 network-namespace hosts, {a.steps} steps of {a.step_s:g} s + "
          f"compute; median (min - max) of {n} run(s) each)\n")
    print("| side | interval | time |")
    print("|---|---|---:|")
    print(f"| tensorplay-run (elastic, --max-restarts 1) | **host lost -> first step on the "
          f"shrunk (1, 4) mesh**, less one step | {_cell(results['ours'], 'loss_step')} |")
    print(f"| tensorplay-run (elastic, --max-restarts 1) | host lost -> first step on (2, 4) "
          f"again (replacement host started after the first shrunk step), less one step | "
          f"{_cell(results['ours'], 'loss_full')} |")
    if results.get("etcd"):
        print(f"| tensorplay-run --store etcd, 3 hosts, (3, 4) mesh | **node 0's host (A) lost "
              f"-> first step on the shrunk (2, 4) mesh**, less one step | "
              f"{_cell(results['etcd'], 'loss_step')} |")
        print(f"| tensorplay-run --store etcd, 3 hosts, (3, 4) mesh | node 0's host lost -> "
              f"the mesh grown back to (3, 4) (node 0 started again on host A after the first "
              f"shrunk step) | {_cell(results['etcd'], 'loss_full')} |")
    print(f"| torchrun (restart-the-world, replacement host started at once) | **host lost -> "
          f"first step after the restart**, less one step | "
          f"{_cell(results['theirs'], 'loss_step')} |")
    print("\nPer run:\n")
    print("| run | side | exit codes (A, B, B again; etcd: A, B, C, A again) | wall | note |")
    print("|---:|---|---|---:|---|")
    for i in range(n):
        for side in results:
            r = results[side][i]
            print(f"| {i + 1} | {side} | {r.get('codes', '-')} | {r['wall_s']:.0f} s | "
                  f"{r['note']} |")
    ours = [r.get("loss_step") for r in results.get("ours", [])]
    theirs = [r.get("loss_step") for r in results.get("theirs", [])]
    ratio = None if None in ours or None in theirs else paired(theirs, ours)
    worst = None if None in ours else max(ours)
    bound = GRACE_S + GOAL_SLACK_S
    ok1 = worst is not None and worst <= bound
    ok2 = ratio is not None and ratio >= GOAL_RATIO
    print(f"\n```\nGoal: host loss to the first step on the shrunk mesh within the node grace "
          f"plus {GOAL_SLACK_S:g} s ({bound:g} s; slowest run), >= {GOAL_RATIO:g}x faster than "
          f"torchrun's restart.")
    print(f"  host lost -> first shrunk step: {'missing' if worst is None else fmt_time(worst)}"
          f" [{'ok' if ok1 else 'MISSED'}]")
    print(f"  theirs/ours: {'-' if ratio is None else f'{ratio:.1f}x'} "
          f"[{'ok' if ok2 else 'MISSED'}]")
    print(f"Goal met: {'YES' if ok1 and ok2 else 'NO'}\n```")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2, help="runs of each side (default 2)")
    p.add_argument("--steps", type=int, default=14, help="training steps (default 14)")
    p.add_argument("--kill-step", type=int, default=4,
                   help="host B is lost once rank 0 did this many steps (default 4)")
    p.add_argument("--step-s", type=float, default=0.5,
                   help="sleep before each step's compute (default 0.5)")
    p.add_argument("--limit-s", type=float, default=240.0,
                   help="cap on one run's wall time (default 240)")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the run logs here")
    p.add_argument("--sides", default="ours,theirs,etcd",
                   help="which sides to run, in turns (default ours,theirs,etcd; etcd: "
                        "--store etcd, node 0 lost, three hosts)")
    add_out(p, __file__)
    a = p.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        print("recovery_hosts: needs root, ip (iproute2) and unshare (util-linux) to make "
              "network-namespace hosts; nothing was run", file=sys.stderr)
        sys.exit(2)
    if "ours" not in a.sides.split(",") or "theirs" not in a.sides.split(","):
        p.error("--sides must hold ours and theirs (the goal's ratio); etcd is optional")
    if not 0 < a.kill_step < a.steps - 2:
        p.error("--kill-step must be between 1 and --steps - 3")
    with recorded(__file__, a.out):
        began = time.monotonic()
        print(f"recovery_hosts: tensorplay at {tree_state()}; {machine()}; "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
        shown = argv if argv is not None else sys.argv[1:]
        print(f"command: {' '.join(['python', 'bench/recovery_hosts.py', *shown])}", flush=True)
        sides = tuple(x for x in ("ours", "theirs", "etcd") if x in a.sides.split(","))
        results: dict[str, list[dict]] = {side: [] for side in sides}
        tmp = Path(tempfile.mkdtemp(prefix="recovery-hosts-"))
        try:
            for i in range(a.repeat):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    results[side].append(run_once(side, a, tmp, i + 1))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        report(results, a)
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; wall time of this run: "
              f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
