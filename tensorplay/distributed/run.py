"""tensorplay-run: start N ranks of one Python program on this node, label their output, fail fast.

Standard library only, so the launcher starts quickly and never loads an engine. The children see
the same environment variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GROUP_RANK), so a script runs unchanged under either launcher.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from tensorplay.distributed.errors import ArgumentError, bad_argument, format_ranks

PROG = "tensorplay-run"
TAIL_LINES = 50
USAGE_ERROR = 2


def child_env(
    base_env: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """Return base_env plus the variables one rank needs to join the job (torchrun's names)."""
    env = dict(base_env)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(node_rank),
        NODE_RANK=str(node_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
        TENSORPLAY_LAUNCHER=PROG,
    )
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free right now on host (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """Describe the command line; every option accepts both dash and underscore spellings."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,  # else a script's own '--log' would be taken as ambiguous
        description="Start --nproc-per-node copies of a Python script, one per rank.",
    )

    def opt(name: str, **kw) -> None:
        p.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kw)

    opt("nproc-per-node", type=int, default=1, help="processes (ranks) on this node")
    opt("nnodes", type=int, default=1, help="number of nodes in the job")
    opt("node-rank", type=int, default=0, help="index of this node, 0..nnodes-1")
    opt("master-addr", default=None, help="address of rank 0 (default 127.0.0.1 on one node)")
    opt("master-port", type=int, default=None, help="port of rank 0 (default: a free port)")
    opt("log-ranks", default=None, help="show only these ranks' output, e.g. 0,3 or 0-3")
    opt("log-dir", default=None, help="also write DIR/rank_<r>.log for every rank")
    opt("stop-grace-s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("script", help="the Python script (or module with -m) every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script untouched")
    return p


def parse_rank_list(text: str, world_size: int) -> set[int]:
    """Read '0,3' or '0-2,5' into a set of ranks, each within 0..world_size-1."""
    ranks: set[int] = set()
    fix = f"list ranks in 0..{world_size - 1} separated by commas; ranges like 0-3 work too"
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            problem = f"{part!r} is not a rank or a range"
            raise bad_argument("--log-ranks", text, problem, fix) from None
        if not 0 <= first <= last < world_size:
            problem = f"{part.strip()!r} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})"
            raise bad_argument("--log-ranks", text, problem, fix)
        ranks.update(range(first, last + 1))
    return ranks


def check_args(a: argparse.Namespace) -> None:
    """Reject values that cannot start a job, naming the flag, the bad value and the fix."""
    if a.nproc_per_node < 1:
        raise bad_argument("--nproc-per-node", a.nproc_per_node, "must be at least 1",
                           "pass the number of processes to start on this node, e.g. 2")
    if a.nnodes < 1:
        raise bad_argument("--nnodes", a.nnodes, "must be at least 1", "pass the node count")
    if not 0 <= a.node_rank < a.nnodes:
        raise bad_argument("--node-rank", a.node_rank, f"must be in 0..{a.nnodes - 1}",
                           f"number the nodes 0..{a.nnodes - 1} (--nnodes is {a.nnodes})")
    for flag, value in (("--master-addr", a.master_addr), ("--master-port", a.master_port)):
        if a.nnodes > 1 and value is None:
            raise bad_argument(flag, value, f"missing; it is required with --nnodes {a.nnodes}",
                               f"pass the same {flag} (that of node 0) on every node")
    if a.master_port is not None and not 1 <= a.master_port <= 65535:
        raise bad_argument("--master-port", a.master_port, "must be in 1..65535",
                           "pick a free TCP port, or omit it on one node to get one")
    if a.stop_grace_s < 0:
        raise bad_argument("--stop-grace-s", a.stop_grace_s, "must be >= 0", "pass e.g. 5")
    if not a.module and not Path(a.script).is_file():
        raise bad_argument("script", a.script, "no such file",
                           "check the path, or use -m package.module to run a module")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and validate the command line; fill in the master address and port on one node."""
    a = build_parser().parse_args(argv)
    check_args(a)
    a.world_size = a.nnodes * a.nproc_per_node
    a.shown = None if a.log_ranks is None else parse_rank_list(a.log_ranks, a.world_size)
    a.master_addr = a.master_addr or "127.0.0.1"
    a.master_port = a.master_port or free_port()
    return a


# ----------------------------------------------------------------------------- output


def _write(stream: IO[str], data: bytes) -> None:
    """Write raw bytes to a text stream (through its buffer when it has one) and flush."""
    buf = getattr(stream, "buffer", None)
    if buf is None:
        stream.write(data.decode("utf-8", errors="replace"))
    else:
        stream.flush()
        buf.write(data)
        buf.flush()
    stream.flush()


class Output:
    """Route children's lines to the terminal (prefixed, filtered), log files and tail buffers."""

    def __init__(self, shown: set[int] | None, log_dir: str | None, ranks: Iterable[int]):
        self.shown = shown
        self.lock = threading.Lock()
        self.tails = {r: deque(maxlen=TAIL_LINES) for r in ranks}
        self.files: dict[int, IO[bytes]] = {}
        if log_dir is not None:
            self._open_logs(Path(log_dir))

    def _open_logs(self, log_dir: Path) -> None:
        """Create log_dir and one rank_<r>.log per rank; an unusable directory is a usage error."""
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            for r in self.tails:
                self.files[r] = open(log_dir / f"rank_{r}.log", "wb")  # noqa: SIM115 (kept open)
        except OSError as exc:
            self.close()
            raise bad_argument("--log-dir", str(log_dir), f"cannot write there ({exc.strerror})",
                               "pass a directory you can create and write to") from None

    def line(self, rank: int, to_stderr: bool, data: bytes) -> None:
        """Record one child line; a partial last line gets its newline here."""
        data = data if data.endswith(b"\n") else data + b"\n"
        with self.lock:
            self.tails[rank].append(data)
            if rank in self.files:
                self.files[rank].write(data)
                self.files[rank].flush()
            if self.shown is None or rank in self.shown:
                _write(sys.stderr if to_stderr else sys.stdout, b"[rank %d] %s" % (rank, data))

    def say(self, text: str) -> None:
        """Print one launcher message on stderr."""
        with self.lock:
            _write(sys.stderr, f"{PROG}: {text}\n".encode())

    def show_tail(self, rank: int) -> None:
        """Show a failed rank's last lines if the filter hid them."""
        if self.shown is None or rank in self.shown or not self.tails[rank]:
            return
        self.say(f"last {len(self.tails[rank])} lines of rank {rank} (hidden by --log-ranks):")
        with self.lock:
            _write(sys.stderr, b"".join(b"[rank %d] %s" % (rank, d) for d in self.tails[rank]))

    def close(self) -> None:
        """Close the log files (readers still running just stop writing to them)."""
        with self.lock:
            for f in self.files.values():
                f.close()
            self.files = {}


# ----------------------------------------------------------------------------- processes


Events = queue.SimpleQueue  # ("exit", rank, returncode) from waiters, ("signal", signum, 0)
Threads = dict[int, list[threading.Thread]]


def _pump(pipe: IO[bytes], rank: int, to_stderr: bool, out: Output) -> None:
    """Reader thread: forward one child stream line by line until it closes."""
    with pipe:
        for data in iter(pipe.readline, b""):
            out.line(rank, to_stderr, data)


def _reap(proc: subprocess.Popen, rank: int, events: Events) -> None:
    """Waiter thread: report the child's exit status as soon as it has one."""
    events.put(("exit", rank, proc.wait()))


def _start(
    a: argparse.Namespace, local_rank: int, out: Output, events: Events, threads: Threads
) -> subprocess.Popen:
    """Start one rank in its own process group, with a reader per stream and a waiter."""
    rank = a.node_rank * a.nproc_per_node + local_rank
    env = child_env(os.environ, rank=rank, local_rank=local_rank, world_size=a.world_size,
                    local_world_size=a.nproc_per_node, node_rank=a.node_rank,
                    master_addr=a.master_addr, master_port=a.master_port)
    target = ["-m", a.script] if a.module else [a.script]
    proc = subprocess.Popen([sys.executable, *target, *a.script_args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    readers = [threading.Thread(target=_pump, args=(proc.stdout, rank, False, out), daemon=True),
               threading.Thread(target=_pump, args=(proc.stderr, rank, True, out), daemon=True)]
    threads[rank] = readers
    for t in [*readers, threading.Thread(target=_reap, args=(proc, rank, events), daemon=True)]:
        t.start()
    return proc


def _signal_groups(procs: Mapping[int, subprocess.Popen], ranks: Iterable[int], sig: int) -> None:
    """Send sig to each rank's whole process group (the rank and anything it spawned)."""
    for r in ranks:
        with suppress(OSError):  # the group is already gone
            os.killpg(procs[r].pid, sig)


def _stop(procs: Mapping[int, subprocess.Popen], ranks: Iterable[int], grace_s: float,
         events: Events) -> None:
    """SIGTERM the given ranks, wait up to grace_s (a new signal cuts it short), SIGKILL all."""
    pending = set(ranks)
    _signal_groups(procs, pending, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if event[0] == "signal":
            break
        pending.discard(event[1])
    _signal_groups(procs, procs, signal.SIGKILL)
    for proc in procs.values():
        proc.wait()


def describe(code: int) -> str:
    """Word a Popen return code: 'exit code 1' or 'killed by signal SIGKILL'."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _join(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Wait for reader threads to drain, but never longer than timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _supervise(
    a: argparse.Namespace, procs: dict[int, subprocess.Popen], events: Events, out: Output,
    threads: Threads,
) -> int:
    """Wait for the ranks; on the first failure or a signal stop the rest and return the code."""
    running = set(procs)
    while running:
        try:
            kind, who, code = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "signal":
            _stop(procs, running, a.stop_grace_s, events)
            out.say(f"got {signal.Signals(who).name}; stopped ranks {format_ranks(running)}.")
            return 128 + who
        running.discard(who)
        if code != 0:
            _stop(procs, running, a.stop_grace_s, events)
            _join(threads[who], 2.0)
            out.show_tail(who)
            others = "no other rank was still running"
            if running:
                others = f"stopped ranks {format_ranks(running)}"
            out.say(f"rank {who} failed first ({describe(code)}); {others}.")
            return code if code > 0 else 128 - code
    return 0


@contextmanager
def _signals_to(events: Events):
    """While active, SIGINT/SIGTERM to the launcher become events (SimpleQueue is reentrant)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda num, _frame: events.put(("signal", num, 0))) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def launch(a: argparse.Namespace) -> int:
    """Start this node's ranks, supervise them, and leave no child behind on any path."""
    first = a.node_rank * a.nproc_per_node
    out = Output(a.shown, a.log_dir, range(first, first + a.nproc_per_node))
    events: Events = queue.SimpleQueue()
    procs: dict[int, subprocess.Popen] = {}
    threads: Threads = {}
    with _signals_to(events):
        try:
            for local_rank in range(a.nproc_per_node):
                procs[first + local_rank] = _start(a, local_rank, out, events, threads)
            code = _supervise(a, procs, events, out, threads)
            _join([t for ts in threads.values() for t in ts], 2.0)
            return code
        finally:
            alive = [r for r, p in procs.items() if p.returncode is None]
            if alive:  # only on an unexpected error: never leave a child behind
                _stop(procs, alive, a.stop_grace_s, events)
            out.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of tensorplay-run; returns the exit code (2 for usage errors)."""
    try:
        return launch(parse_args(argv))
    except SystemExit as exc:  # argparse: --help (0) or a malformed command line (2)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except ArgumentError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
