"""tensorplay-run: start N ranks of one Python program on this node, label their output, fail fast.

The children see the same environment variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK, and OMP_NUM_THREADS=1 unless set), so a
script runs unchanged under either launcher. As torchrun's agent does, the launcher of node 0
serves the job's store (``TORCHELASTIC_USE_AGENT_STORE=True`` tells the ranks): rank 0 is an
ordinary rank, and the store outlives any rank. It loads torch for that only when a rank first
connects (on one node), so a script that never uses the store starts as fast as before. Across
nodes, ``_nodes`` checks the launchers agree at start, and makes them watch each other (a node
silent for --node-grace-s is lost: every launcher stops its ranks); ``_hangs`` finds a rank
alive but stuck, which is killed and reported as hung.

Each rank runs its script through ``_rank_main``, which makes it die with the launcher (a
parent-death signal) and reports over a pipe how the script ended and when. From those reports
and the exit statuses, ``_rank_ends`` words the one summary line: the rank that failed first in
time, with its error; ranks that failed alike; ranks that died after their script finished.
A Python traceback that a rank's script ended with is held back and printed once at the end,
labelled with every rank that printed the same one.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import queue
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tensorplay.distributed import _env, _hangs, _rank_main, backends
from tensorplay.distributed._failures import VERDICT_FILE
from tensorplay.distributed._rank_ends import (
    RankEnd,
    blank_varying,
    describe,
    first_failure,
    ranks_phrase,
    shorten,
    summarize,
)
from tensorplay.distributed.errors import ArgumentError, bad_argument

if TYPE_CHECKING:
    from tensorplay.distributed._nodes import Board, Verdict

PROG = "tensorplay-run"
TAIL_LINES = 50
USAGE_ERROR = 2
SETTLE_S = 1.0  # default --settle-s
NODE_GRACE_S = 10.0  # default --node-grace-s
JOIN_TIMEOUT_S = 300.0  # default --join-timeout-s
NODE_GRACE_ENV = "TENSORPLAY_NODE_GRACE_S"
HANG_ENV = "TENSORPLAY_HANG_TIMEOUT_S"
JOIN_ENV = "TENSORPLAY_JOIN_TIMEOUT_S"
ELASTIC_TAIL_S = 10.0  # elastic: a restarted rank still waiting to join when all others ended
STOP_FAST_S = 2.0  # a node lost or stopped elsewhere: SIGTERM, then SIGKILL after at most this
LOST_SETTLE_S = 0.5  # a node lost: what is left of --settle-s for this node's ranks to end
OMP_NOTE = ("setting OMP_NUM_THREADS=1 for every rank, as torchrun does, so {n} ranks do not "
            "oversubscribe the cores (it was not set; set it to choose another value)")


def _env_float(name: str, default: float | None) -> float | None:
    """A flag's default from the environment (a bad value is a usage error, naming it)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise bad_argument(name, raw, "is not a number of seconds", f"set e.g. {name}=10"
                           ) from None


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
    agent_store: bool = False,
) -> dict[str, str]:
    """Return base_env plus the variables one rank needs to join the job (torchrun's names).

    With ``agent_store`` the launcher of node 0 serves the job's store on MASTER_PORT, and
    every rank, rank 0 too, is its client: torchrun's own two variables say so to torch."""
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
    if agent_store:
        env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    # c10d's C++ warnings carry C++ stack traces (a store send that fails as a peer goes) and
    # noise (a host name that does not resolve back); our errors say what failed instead
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if local_world_size > 1:  # torchrun's rule: one thread per rank unless the user chose
        env.setdefault("OMP_NUM_THREADS", "1")
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
    opt("node-grace-s", type=float, default=_env_float(NODE_GRACE_ENV, NODE_GRACE_S),
        help="a node whose launcher is silent this long is lost: every node stops "
             f"(default {NODE_GRACE_S:g}; or ${NODE_GRACE_ENV}). A rank stopped (SIGSTOP) this "
             "long is killed as hung")
    opt("hang-timeout-s", type=float, default=_env_float(HANG_ENV, None),
        help="kill a rank as hung when its main thread has not moved for this long (a "
             f"deadlock, a stuck call); default off (or ${HANG_ENV})")
    opt("join-timeout-s", type=float, default=_env_float(JOIN_ENV, JOIN_TIMEOUT_S),
        help=f"how long the nodes wait for each other at start (default {JOIN_TIMEOUT_S:g}; or "
             f"${JOIN_ENV})")
    opt("max-restarts", type=int, default=None,
        help="elastic mode: a rank lost (killed by a signal, or hung) does not stop the job; "
             "it is restarted, at most this many times per rank, and joins the running job's "
             "elastic mesh (init_device_mesh(..., elastic=...)); the others go on meanwhile. "
             "Default: off (the first failure stops every rank)")
    opt("settle-s", type=float, default=SETTLE_S,
        help="after the first failure, seconds the other ranks get to end on their own before "
             "they are stopped, so that ranks failing alike are all seen (default 1)")
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
    for flag, value in (("--node-grace-s", a.node_grace_s), ("--join-timeout-s",
                                                             a.join_timeout_s),
                        ("--hang-timeout-s", a.hang_timeout_s)):
        if value is not None and not value > 0:
            raise bad_argument(flag, value, "must be > 0", "pass a number of seconds, e.g. 10")
    if a.settle_s < 0:
        raise bad_argument("--settle-s", a.settle_s, "must be >= 0", "pass e.g. 1")
    if a.max_restarts is not None and a.max_restarts < 0:
        raise bad_argument("--max-restarts", a.max_restarts, "must be >= 0",
                           "pass how often one rank may be restarted, e.g. 1 (0: never, but "
                           "the others still go on without it)")
    if not a.module and not Path(a.script).is_file():
        raise bad_argument("script", a.script, "no such file",
                           "check the path, or use -m package.module to run a module")


def check_port_free(host: str, port: int) -> None:
    """Bind host:port the way rank 0's store will (SO_REUSEADDR, this address only) and let go.

    Run on node 0 before any rank starts, so a port already in use is one clear usage error
    instead of a rank 0 that fails in its rendezvous while the others wait for it. Only
    EADDRINUSE is judged here; any other problem is left to rank 0, which reports it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise bad_argument(
                    "--master-port", port,
                    f"is already in use on {host} (another program or job listens there), where "
                    f"rank 0 must serve the rendezvous store",
                    "pick another --master-port, or omit it on one node to get a free one",
                ) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and validate the command line; fill in the master address and port on one node."""
    a = build_parser().parse_args(argv)
    check_args(a)
    a.world_size = a.nnodes * a.nproc_per_node
    a.shown = None if a.log_ranks is None else parse_rank_list(a.log_ranks, a.world_size)
    a.master_addr = a.master_addr or "127.0.0.1"
    if a.master_port is None:
        a.master_port = free_port()
    elif a.node_rank == 0:  # rank 0, which serves the store, runs here
        check_port_free(a.master_addr, a.master_port)
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


def untag(rank: int, data: bytes) -> bytes:
    """data without torch's own rank tag ('[rank3]: ', which init_process_group's excepthook and
    c10d's C++ log put on a rank's lines), so that '[rank 3] ' is not said twice."""
    tag = b"[rank%d]:" % rank
    if not data.startswith(tag):
        return data
    data = data[len(tag):]
    return data[1:] if data.startswith(b" ") else data


def label(ranks: list[int]) -> bytes:
    """The prefix of lines that came from these ranks: b'[rank 3] ' or b'[ranks 0-7] '."""
    return b"[%s] " % ranks_phrase(ranks).encode()


class Output:
    """Route children's lines to the terminal (prefixed, filtered), log files and tail buffers.

    A rank's final traceback (its first line is announced by the rank's report, see
    ``expect``) is held back from the terminal from that line on; ``show_held`` prints each
    distinct one once, labelled with every rank that printed it. Log files get every line.
    """

    def __init__(self, shown: set[int] | None, log_dir: str | None, ranks: Iterable[int]):
        self.shown = shown
        self.lock = threading.Lock()
        self.tails = {r: deque(maxlen=TAIL_LINES) for r in ranks}
        self.files: dict[int, IO[bytes]] = {}
        self.first: dict[int, bytes] = {}  # rank -> first line of the traceback it will print
        self.held: dict[int, list[bytes]] = {}  # rank -> that traceback's lines so far
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

    def expect(self, rank: int, first_line: str) -> None:
        """The rank's script raised; its traceback, about to be printed, starts with this line."""
        with self.lock:
            self.first[rank] = first_line.encode("utf-8", errors="replace")

    def line(self, rank: int, to_stderr: bool, data: bytes) -> None:
        """Record one child line; a partial last line gets its newline here."""
        data = data if data.endswith(b"\n") else data + b"\n"
        text = untag(rank, data)
        with self.lock:
            if rank in self.files:
                self.files[rank].write(data)
                self.files[rank].flush()
            if rank in self.held:
                self.held[rank].append(text)
                return
            if to_stderr and rank in self.first and text.rstrip(b"\r\n") == self.first[rank]:
                self.held[rank] = [text]
                return
            self.tails[rank].append(text)
            if self.shown is None or rank in self.shown:
                _write(sys.stderr if to_stderr else sys.stdout, label([rank]) + text)

    def say(self, text: str) -> None:
        """Print one launcher message on stderr."""
        with self.lock:
            _write(sys.stderr, f"{PROG}: {text}\n".encode())

    def show_tail(self, rank: int) -> None:
        """Show a failed rank's last lines if the filter hid them (its traceback comes apart)."""
        if self.shown is None or rank in self.shown or not self.tails[rank]:
            return
        self.say(f"last {len(self.tails[rank])} lines of rank {rank} (hidden by --log-ranks):")
        with self.lock:
            _write(sys.stderr, b"".join(label([rank]) + d for d in self.tails[rank]))

    def show_held(self, order: list[int], also: Iterable[int] = ()) -> None:
        """Print the held tracebacks, each distinct one once (pids and addresses may differ),
        in the order of their first rank in ``order``; a block is shown when one of its ranks
        is shown (or is in ``also``)."""
        with self.lock:
            held = {r: b"".join(lines) for r, lines in self.held.items()}
        blocks: dict[str, list[int]] = {}
        for r in [*order, *sorted(set(held) - set(order))]:
            if r in held:
                blocks.setdefault(blank_varying(held[r].decode("utf-8", "replace")), []).append(r)
        visible = None if self.shown is None else self.shown | set(also)
        for ranks in blocks.values():
            if visible is None or visible & set(ranks):
                prefix = label(ranks)
                with self.lock:
                    _write(sys.stderr, b"".join(prefix + line for line in
                                                held[ranks[0]].splitlines(keepends=True)))

    def close(self) -> None:
        """Close the log files (readers still running just stop writing to them)."""
        with self.lock:
            for f in self.files.values():
                f.close()
            self.files = {}


# ----------------------------------------------------------------------------- processes

# ("exit", rank, returncode, time) from waiters, ("report", rank, dict) from the stderr readers,
# ("signal", signum) from the launcher's own handlers
Events = queue.SimpleQueue
Threads = dict[int, list[threading.Thread]]


def _pump(pipe: IO[bytes], rank: int, out: Output) -> None:
    """Reader thread: forward a child's stdout line by line until it closes."""
    with pipe:
        for data in iter(pipe.readline, b""):
            out.line(rank, False, data)


def _pump_stderr(pipe: IO[bytes], report_fd: int, rank: int, out: Output,
                 on_report: Callable[[int, dict], None]) -> None:
    """Reader thread: a child's stderr and its report pipe, in the order they were written.

    The rank writes its report before it prints its traceback. So after each read of stderr the
    report pipe is drained before those stderr lines are handled: a report written before them
    is always seen first, and the traceback is held from its first line.
    """
    sel = selectors.DefaultSelector()
    err_fd = pipe.fileno()
    os.set_blocking(report_fd, False)
    sel.register(err_fd, selectors.EVENT_READ)
    sel.register(report_fd, selectors.EVENT_READ)
    partial, pending = b"", b""

    def drain_reports() -> None:
        nonlocal pending
        while report_fd in sel.get_map():
            try:
                chunk = os.read(report_fd, 4096)
            except BlockingIOError:
                return
            if not chunk:
                sel.unregister(report_fd)
                return
            *done, pending = (pending + chunk).split(b"\n")
            for raw in done:
                with suppress(ValueError):
                    on_report(rank, json.loads(raw))

    try:
        while sel.get_map():
            for key, _ in sel.select():
                if key.fd != err_fd:
                    drain_reports()
                    continue
                chunk = os.read(err_fd, 65536)
                drain_reports()
                if not chunk:
                    sel.unregister(err_fd)
                    if partial:
                        out.line(rank, True, partial)
                    continue
                *lines, partial = (partial + chunk).split(b"\n")
                for data in lines:
                    out.line(rank, True, data + b"\n")
    finally:
        sel.close()
        pipe.close()
        os.close(report_fd)


def _reap(proc: subprocess.Popen, rank: int, events: Events) -> None:
    """Waiter thread: report the child's exit status as soon as it has one."""
    code = proc.wait()
    events.put(("exit", rank, code, time.monotonic()))


def rank_command(a: argparse.Namespace) -> list[str]:
    """The child's command line: the script under _rank_main, its arguments untouched."""
    target = ["--module" if a.module else "--file", a.script]
    return [sys.executable, "-c", _rank_main.loader_command(), *target, *a.script_args]


def _start(
    a: argparse.Namespace, local_rank: int, out: Output, events: Events, threads: Threads,
    restart: int = 0,
) -> subprocess.Popen:
    """Start one rank in its own process group, with its report pipe, two readers and a waiter.

    The rank's parent-death signal is tied to the thread that starts it, so call this from the
    thread that supervises the job (it lives as long as the launcher).
    """
    rank = a.node_rank * a.nproc_per_node + local_rank
    env = child_env(a.base_env, rank=rank, local_rank=local_rank, world_size=a.world_size,
                    local_world_size=a.nproc_per_node, node_rank=a.node_rank,
                    master_addr=a.master_addr, master_port=a.master_port,
                    agent_store=a.serve_store)
    if a.hang_timeout_s is not None:
        env[_rank_main.BEAT_S] = "1"
    if restart:  # elastic mode: this rank joins a running job's elastic mesh
        env[_env.TENSORPLAY_RESTART_COUNT] = str(restart)
    if a.verdict_file:
        env[VERDICT_FILE] = a.verdict_file
    report_r, report_w = os.pipe()
    env[_rank_main.REPORT_FD] = str(report_w)
    env[_rank_main.PARENT_PID] = str(os.getpid())
    try:
        proc = subprocess.Popen(rank_command(a), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(report_w,))
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)

    def on_report(r: int, record: dict) -> None:
        if record.get("event") == "raised" and record.get("first"):
            out.expect(r, record["first"])
        events.put(("report", r, record))

    readers = [threading.Thread(target=_pump, args=(proc.stdout, rank, out), daemon=True),
               threading.Thread(target=_pump_stderr, daemon=True,
                                args=(proc.stderr, report_r, rank, out, on_report))]
    threads.setdefault(rank, []).extend(readers)
    for t in [*readers, threading.Thread(target=_reap, args=(proc, rank, events), daemon=True)]:
        t.start()
    return proc


def _signal_groups(procs: Mapping[int, subprocess.Popen], ranks: Iterable[int], sig: int) -> None:
    """Send sig to each rank's whole process group (the rank and anything it spawned)."""
    for r in ranks:
        with suppress(OSError):  # the group is already gone
            os.killpg(procs[r].pid, sig)


def _stop(procs: Mapping[int, subprocess.Popen], ranks: Iterable[int], grace_s: float,
          events: Events, record: Callable[[tuple], None]) -> None:
    """SIGTERM the given ranks, wait up to grace_s (a new signal cuts it short), SIGKILL all.

    Exits and reports that arrive meanwhile go to ``record``.
    """
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
        record(event)
        if event[0] == "exit":
            pending.discard(event[1])
    _signal_groups(procs, procs, signal.SIGKILL)
    for proc in procs.values():
        proc.wait()


def _join(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Wait for reader threads to drain, but never longer than timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


class Job:
    """This node's ranks as the launcher sees them: processes, and how each one ended.

    ``board`` (several nodes) tells the other nodes when this node's ranks fail, and brings
    their verdicts (a node lost, a failure elsewhere) as ("verdict", Verdict) events.
    """

    def __init__(self, a: argparse.Namespace, out: Output, board: Board | None = None):
        self.a = a
        self.out = out
        self.board = board
        self.events: Events = queue.SimpleQueue()
        self.procs: dict[int, subprocess.Popen] = {}
        self.threads: Threads = {}
        self.ends: dict[int, RankEnd] = {}
        self.hangs = _hangs.HangWatch(a.node_grace_s, a.hang_timeout_s)
        self.verdict: Verdict | None = None  # why the job stopped, if another node said so
        self.restarts: dict[int, int] = {}  # elastic mode: rank -> times restarted
        self.lost: list[tuple[RankEnd, bool]] = []  # elastic: ends of lost ranks, restarted?

    def start(self) -> None:
        """Start every rank of this node."""
        first = self.a.node_rank * self.a.nproc_per_node
        for local_rank in range(self.a.nproc_per_node):
            self.ends[first + local_rank] = RankEnd(first + local_rank)
            self.procs[first + local_rank] = _start(self.a, local_rank, self.out, self.events,
                                                    self.threads)

    def record(self, event: tuple) -> None:
        """Note an exit or a report (the first report of a rank counts; beats are kept apart)."""
        end = self.ends[event[1]]
        if event[0] == "exit":
            end.code, end.exit_t = event[2], event[3]
        elif event[0] == "report" and event[2].get("event") == "beat":
            self.hangs.beat(event[1], event[2])
        elif event[0] == "report" and end.report is None:
            end.report = event[2]

    def failing(self, rank: int) -> bool:
        """Whether this rank's script failed or its process ended badly."""
        end = self.ends[rank]
        return bool(end.code) or (end.report is not None and end.report["event"] != "returned")

    def supervise(self) -> int | None:
        """Wait for the ranks. After the first failure let the others end on their own for
        --settle-s (so ranks that fail alike are all seen), then stop the rest; a verdict
        from another node counts as a failure, and the stop is quicker (STOP_FAST_S).
        Returns None, or the signal number that stopped the job."""
        running = set(self.procs)
        failed_at, fast = None, False
        while running:
            wait = 0.5 if failed_at is None else failed_at + self.a.settle_s - time.monotonic()
            if wait <= 0:
                break
            try:
                event = self.events.get(timeout=min(wait, 0.5))
            except queue.Empty:
                event = None
            if event is not None and event[0] == "signal":
                self.stop(running)
                return event[1]
            if event is not None and event[0] == "verdict":
                self.verdict = event[1]
                if failed_at is None:  # as for a failure here: the ranks may say more first
                    # (those in our own checks raise RankFailedError, told by tell_ranks)
                    self.out.say(f"{event[1].text}; stopping "
                                 f"{ranks_phrase(sorted(running))} on this node.")
                    self.tell_ranks(event[1])
                    failed_at, fast = time.monotonic(), True
                    if event[1].kind == "lost":  # most wait for the lost node: be quick
                        failed_at -= max(self.a.settle_s - LOST_SETTLE_S, 0.0)
                continue
            if event is not None:
                self.record(event)
                if event[0] == "exit":
                    running.discard(event[1])
                if failed_at is None and self.failing(event[1]):
                    failed_at = time.monotonic()
            if failed_at is None:
                failed_at = self.kill_hung(running) or failed_at
        if failed_at is not None:  # after --settle-s: the cause it names is the summary's
            self.tell_others()
        self.stop(running, fast)
        return None

    def supervise_elastic(self) -> int | None:
        """Elastic mode (--max-restarts): a rank lost to a signal (killed, or hung and killed
        here) is restarted while it has restarts left, and the others go on; any other end is
        final. The job ends when every rank has ended; restarted ranks still waiting to join
        ELASTIC_TAIL_S after all the others ended are stopped. Returns None, or the signal
        number that stopped the job."""
        running = set(self.procs)
        first = set(self.procs)  # ranks whose running process is the one started with the job
        tail_from = None
        while running:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                event = None
            if event is not None and event[0] == "signal":
                self.stop(running)
                return event[1]
            if event is not None and event[0] == "verdict":  # a node lost: the job is over
                self.verdict = event[1]
                self.out.say(f"{event[1].text}; stopping {ranks_phrase(sorted(running))} on "
                             f"this node.")
                self.tell_ranks(event[1])
                self.stop(running, fast=True)
                return None
            if event is not None:
                self.record(event)
                if event[0] == "exit":
                    running.discard(event[1])
                    if self.restart_if_lost(event[1]):
                        running.add(event[1])
                        first.discard(event[1])
            self.kill_hung(running)
            if running and not running & first:
                tail_from = tail_from or time.monotonic()
                if time.monotonic() - tail_from > ELASTIC_TAIL_S:
                    self.out.say(f"{ranks_phrase(sorted(running))} (restarted) still running "
                                 f"{ELASTIC_TAIL_S:g} s after every other rank ended: stopping.")
                    break
        self.stop(running)
        return None

    def restart_if_lost(self, rank: int) -> bool:
        """Elastic mode: restart ``rank`` if a signal ended it while its script ran (killed,
        or hung and killed here) and it has restarts left."""
        end = self.ends[rank]
        said = (end.report or {}).get("event")
        if end.code is None or end.code >= 0 or said not in (None, "hung"):
            return False  # its script ended (returned, raised, exited) before it died: final
        done = self.restarts.get(rank, 0)
        again = done < self.a.max_restarts
        self.lost.append((end, again))
        cause = end.report["what"] if said == "hung" else describe(end.code)
        if not again:
            self.out.say(f"rank {rank} lost ({cause}); not restarted (--max-restarts "
                         f"{self.a.max_restarts} used): the others go on without it.")
            return False
        self.restarts[rank] = done + 1
        self.out.say(f"rank {rank} lost ({cause}); elastic mode: restarting it (restart "
                     f"{done + 1} of {self.a.max_restarts}); the others go on.")
        self.ends[rank] = RankEnd(rank)
        local = rank - self.a.node_rank * self.a.nproc_per_node
        self.procs[rank] = _start(self.a, local, self.out, self.events, self.threads, done + 1)
        return True

    def conclude_elastic(self) -> int:
        """Elastic mode: 0 when the job went on to its end (some rank's script returned and
        none failed by itself), ranks lost on the way named; else the usual summary."""
        ends = list(self.ends.values())
        final_lost = [e for e in ends if e.code is not None and e.code < 0 and e.stop_t is None
                      and (e.report or {}).get("event") in (None, "hung")]  # not: died at exit
        by_script = [e for e in ends if e not in final_lost and e.stop_t is None
                     and self.failing(e.rank)]
        went_on = any(e.kind() == "ok" for e in ends)
        if not went_on:
            return self.conclude()
        if self.lost:
            restarted = sorted({e.rank for e, again in self.lost if again})
            gone = sorted(e.rank for e in final_lost)
            words = [f"{ranks_phrase(restarted)} restarted"] if restarted else []
            words += [f"{ranks_phrase(gone)} lost for good"] if gone else []
            self.out.say(f"elastic: {len(self.lost)} rank loss(es) survived ("
                         f"{'; '.join(words)}); the job went on to its end"
                         f"{', but a script failed:' if by_script else '.'}")
        return self.conclude([e for e in ends if e not in final_lost]) if by_script else 0

    def kill_hung(self, running: set[int]) -> float | None:
        """Kill the ranks that are hung (``_hangs``), recording why; when one was, the time."""
        hung = self.hangs.hung({r: self.procs[r].pid for r in running})
        if not hung:
            return None
        now = time.monotonic()
        for rank, why in sorted(hung.items()):
            _signal_groups(self.procs, [rank], signal.SIGKILL)
            text = f"hung on host {_env.hostname()}: {why}; {PROG} killed it"
            self.out.say(f"rank {rank} {text}.")
            self.ends[rank].report = {"event": "hung", "t": now, "code": 1, "what": text}
        return now

    def tell_others(self) -> None:
        """This node's job failed: post it, so every other node stops its ranks too."""
        if self.board is None or self.board.verdict is not None:
            return
        first = first_failure([e for e in self.ends.values() if self.failing(e.rank)])
        what = first.what() or describe(first.chosen() if first.report else first.code or 1)
        self.board.post("failed", f"node {self.a.node_rank} ({_env.hostname()}) failed: rank "
                                  f"{first.rank}: {shorten(what)}")

    def tell_ranks(self, verdict: Verdict) -> None:
        """Write the verdict where this node's ranks look while they wait in a cross-rank
        check (``_failures.VERDICT_FILE``): they raise RankFailedError saying it."""
        if not self.a.verdict_file:
            return
        n = self.a.nproc_per_node
        lost = [] if verdict.lost is None else list(range(verdict.lost * n, (verdict.lost + 1) * n))
        with suppress(OSError):
            Path(self.a.verdict_file + ".tmp").write_text(
                json.dumps({"text": verdict.text, "ranks": lost}))
            os.replace(self.a.verdict_file + ".tmp", self.a.verdict_file)

    def stop(self, running: set[int], fast: bool = False) -> None:
        """Stop the ranks still running (marking them stopped) and wait for every process.
        ``fast``: the job is over elsewhere, so SIGKILL follows SIGTERM within STOP_FAST_S."""
        now = time.monotonic()
        for r in running:
            self.ends[r].stop_t = now
        grace = min(self.a.stop_grace_s, STOP_FAST_S) if fast else self.a.stop_grace_s
        if running:
            _stop(self.procs, running, grace, self.events, self.record)

    def drain(self) -> None:
        """After the processes ended: let the readers drain, then note what they reported."""
        _join([t for ts in self.threads.values() for t in ts], 2.0)
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "verdict":
                self.verdict = self.verdict or event[1]
            elif event[0] != "signal":
                self.record(event)
        for r, proc in self.procs.items():
            if self.ends[r].code is None:
                self.ends[r].code = proc.returncode

    def conclude(self, ends: list[RankEnd] | None = None) -> int:
        """Print what went wrong (tail, tracebacks, summary) and return the exit status;
        ``ends``: the ranks to judge (default all)."""
        ends = list(self.ends.values()) if ends is None else ends
        v = self.verdict
        elsewhere = v is not None and (v.kind != "failed" or v.node != self.a.node_rank)
        if not any(self.failing(e.rank) for e in ends) and not elsewhere:
            return 0
        several_nodes = self.a.nnodes > 1
        text, code = summarize(ends, node_ranks="ranks on this node" if several_nodes else "ranks")
        failed = sorted((e for e in ends if e.kind() == "failed"),
                        key=lambda e: (e.consequence(), e.when(), e.rank))
        order = [e.rank for e in failed] + [e.rank for e in ends if e.kind() != "failed"]
        if failed:
            self.out.show_tail(failed[0].rank)
        self.out.show_held(order, also=[failed[0].rank] if failed else [])
        self.out.say(text)
        if elsewhere and v is not None:
            self.out.say(f"the job stopped because {v.text}.")
        return code


@contextmanager
def _signals_to(events: Events):
    """While active, SIGINT/SIGTERM to the launcher become events (SimpleQueue is reentrant)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda num, _frame: events.put(("signal", num))) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _board(a: argparse.Namespace) -> Board:
    from tensorplay.distributed._nodes import Board

    return Board(nnodes=a.nnodes, node_rank=a.node_rank, nproc=a.nproc_per_node,
                 host=_env.hostname(), addr=a.master_addr, port=a.master_port,
                 grace_s=a.node_grace_s, join_timeout_s=a.join_timeout_s)


def launch(a: argparse.Namespace) -> int:
    """Join the other nodes, start this node's ranks, supervise them, and leave no child
    behind on any path."""
    a.serve_store = backends.launcher_can_serve_store()
    if a.max_restarts is not None and not a.serve_store:
        raise bad_argument("--max-restarts", a.max_restarts, "needs the launcher to serve the "
                           "job's store (it outlives any rank), which needs torch in the "
                           f"launcher's Python ({sys.executable})", "install torch there, or "
                           "leave out --max-restarts")
    first = a.node_rank * a.nproc_per_node
    out = Output(a.shown, a.log_dir, range(first, first + a.nproc_per_node))
    if a.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        out.say(OMP_NOTE.format(n=a.nproc_per_node))
    a.base_env = dict(os.environ)  # what the ranks get, before the line below
    workdir = tempfile.mkdtemp(prefix="tensorplay-run-") if a.nnodes > 1 else None
    a.verdict_file = os.path.join(workdir, "verdict") if workdir else None
    if a.serve_store and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # torch logs each failed connect with a
        # C++ stack trace: noise in a launcher, which says itself what failed
    board = _board(a) if a.serve_store else None
    job = Job(a, out, board if a.nnodes > 1 else None)
    serving: threading.Thread | None = None
    with _signals_to(job.events):
        try:
            if board is not None and a.nnodes > 1:
                from tensorplay.distributed._nodes import JoinError

                try:
                    board.join()
                except JoinError as err:
                    out.say(f"error: {err}.")
                    return 1
                board.watch(lambda v: job.events.put(("verdict", v)))
            elif board is not None:  # one node: serve once a rank asks
                serving = threading.Thread(target=_serve, args=(board, job.events),
                                           name="tensorplay-run store")
                serving.start()
            job.start()
            elastic = a.max_restarts is not None
            signum = job.supervise_elastic() if elastic else job.supervise()
            job.drain()
            if signum is not None:
                stopped = sorted(r for r, e in job.ends.items() if e.stop_t is not None)
                job.out.show_held(sorted(job.ends))
                out.say(f"got {signal.Signals(signum).name}; stopped "
                        f"{ranks_phrase(stopped) if stopped else 'no rank (none was running)'}.")
                return 128 + signum
            code = job.conclude_elastic() if elastic else job.conclude()
            if job.board is not None:
                code = _leave(job, code)
            return code
        finally:
            alive = [r for r, p in job.procs.items() if p.returncode is None]
            if alive:  # only on an unexpected error: never leave a child behind
                _stop(job.procs, alive, a.stop_grace_s, job.events, lambda _event: None)
            if serving is not None and board is not None:
                board.stop_asking()
                serving.join()
            if board is not None:
                board.close()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            if "TORCH_CPP_LOG_LEVEL" not in a.base_env:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
            out.close()


def _serve(board: Board, events: Events) -> None:
    """One node: serve the job's store when a rank asks; when it cannot, stop the job."""
    from tensorplay.distributed._nodes import JoinError, Verdict

    try:
        board.serve_when_asked()
    except JoinError as err:
        events.put(("verdict", Verdict("store", 0, str(err))))


def _leave(job: Job, code: int) -> int:
    """Several nodes, this node's ranks ended: tell node 0, or (node 0) serve the store until
    every node is done. A node lost after our ranks succeeded fails the job."""
    board = job.board
    assert board is not None
    if job.a.node_rank != 0:
        board.beat_done()
        return code
    signals: list[int] = []

    def interrupted() -> bool:  # SIGINT/SIGTERM while node 0 serves the others' store
        with suppress(queue.Empty):
            event = job.events.get_nowait()
            if event[0] == "signal":
                signals.append(event[1])
        return bool(signals)

    if board.await_others(interrupted) or code:
        return code
    if signals:
        job.out.say(f"got {signal.Signals(signals[0]).name} while the other nodes still used "
                    f"the store this node serves; stopped serving it.")
        return 128 + signals[0]
    if board.verdict is not None:
        job.out.say(f"the job stopped because {board.verdict.text}.")
    return 1


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
