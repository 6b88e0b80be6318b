"""tensorplay-run's command line: the flags, their defaults, and the checks of their values.

Every flag has a dash and an underscore spelling (``--nproc-per-node``, ``--nproc_per_node``,
as torchrun accepts both); three defaults may come from the environment
(``TENSORPLAY_NODE_GRACE_S``, ``TENSORPLAY_HANG_TIMEOUT_S``, ``TENSORPLAY_JOIN_TIMEOUT_S``).
A bad value is a usage error naming the flag, the value and the fix, e.g.::

    >>> parse_rank_list("0-2, 5", 8)
    {0, 1, 2, 5}
    >>> check_args(build_parser().parse_args(["--nnodes", "0", "train.py"]))
    Traceback (most recent call last):
    ArgumentError: --nnodes=0: must be at least 1. Fix: pass the node count.

``spec.parse_args`` turns the checked namespace into the frozen ``LaunchSpec``.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from ..errors import bad_argument
from . import slurm_step

PROG = "tensorplay-run"
SETTLE_S = 1.0  # default --settle-s
NODE_GRACE_S = 10.0  # default --node-grace-s
JOIN_TIMEOUT_S = 300.0  # default --join-timeout-s
NODE_GRACE_ENV = "TENSORPLAY_NODE_GRACE_S"
HANG_ENV = "TENSORPLAY_HANG_TIMEOUT_S"
JOIN_ENV = "TENSORPLAY_JOIN_TIMEOUT_S"
NO_WARM_ENV = "TENSORPLAY_NO_WARM"  # set (not 0): --no-warm


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


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free right now on host (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    """Describe the command line; every option accepts both dash and underscore spellings."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,  # else a script's own '--log' would be taken as ambiguous
        description="Start --nproc-per-node copies of a Python script, one per rank.",
        epilog=f"{PROG} --ps [LAUNCHER_PID] prints the rank -> pid table of that launcher, or "
               "of each of your running launchers (docs/launcher.md).",
    )

    def opt(name: str, **kw) -> None:
        p.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kw)

    opt("nproc-per-node", type=int, default=1, help="processes (ranks) on this node")
    opt("nnodes", type=int, default=None,
        help="number of nodes in the job (default 1; under srun the step's task count: one "
             "launcher per node)")
    opt("node-rank", type=int, default=None,
        help="index of this node, 0..nnodes-1 (default 0; under srun the task's SLURM_PROCID)")
    opt("master-addr", default=None,
        help="address of rank 0 (default 127.0.0.1 on one node; under srun the first host "
             "of the step's node list)")
    opt("master-port", type=int, default=None,
        help="port of rank 0 (default: a free port; under srun one derived from the job id)")
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
    opt("store", default="tcp", metavar="tcp|etcd|etcd://H:P,...",
        help="the job's store: 'tcp' (default: node 0's launcher serves torch's TCPStore, "
             "which dies with node 0), 'etcd' (the first --store-replicas nodes' launchers run "
             "an etcd cluster: every host equal, node 0 may be lost too) or 'etcd://h1:2379,"
             "h2:2379' (an etcd cluster you run). Needs pip install -e \".[ha]\"")
    opt("store-replicas", type=int, default=None, metavar="N",
        help="--store etcd: how many nodes run an etcd member (odd; default 3, or 1 below 3 "
             "nodes); the store survives the loss of (N-1)/2 of them")
    opt("job-id", default="default",
        help="--store etcd://...: the job's name in your cluster (its keys are under "
             "jobs/<ID>/); a job of an ID that ended is refused, so give each run its own "
             "(e.g. $SLURM_JOB_ID)")
    opt("no-warm", action="store_true",
        help="start each rank as a fresh interpreter (also: TENSORPLAY_NO_WARM=1); default: "
             "fork each rank from one warm process that imported torch once")
    opt("preload", action="append", default=[], metavar="MODULE",
        help="also import MODULE in the warm process, before any rank is forked (repeatable)")
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
    """Take what an srun step says for the node flags left out (``slurm_step.fill``: it also
    refuses the ones that contradict it), then reject values that cannot start a job, naming
    the flag, the bad value and the fix."""
    slurm_step.fill(a)
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
    check_store(a)
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


def store_endpoints(value: str) -> list[str]:
    """``etcd://h1:2379,h2:2379`` -> ["h1:2379", "h2:2379"] (ArgumentError when malformed)."""
    fix = "pass --store etcd://HOST:PORT[,HOST:PORT...], e.g. etcd://10.0.0.5:2379"
    endpoints = [e.strip() for e in value[len("etcd://"):].rstrip("/").split(",")]
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise bad_argument("--store", value, f"{e!r} is not HOST:PORT", fix)
    return endpoints


def check_store(a: argparse.Namespace) -> None:
    """--store, --store-replicas and --job-id: a known store, an odd count of members that
    the job's nodes can hold, and the etcd client installed (before any rank starts)."""
    if a.store not in ("tcp", "etcd") and not a.store.startswith("etcd://"):
        raise bad_argument("--store", a.store, "is not a store", "pass tcp, etcd or "
                           "etcd://HOST:PORT,...")
    if a.store.startswith("etcd://"):
        store_endpoints(a.store)
        if a.store_replicas is not None:
            raise bad_argument("--store-replicas", a.store_replicas, "is for the cluster the "
                               "launchers run (--store etcd), not for yours (--store etcd://)",
                               "leave it out")
    if a.store_replicas is not None:
        if a.store != "etcd":
            raise bad_argument("--store-replicas", a.store_replicas, "needs --store etcd",
                               "pass --store etcd too, or leave it out")
        if not 1 <= a.store_replicas <= a.nnodes or a.store_replicas % 2 == 0:
            raise bad_argument("--store-replicas", a.store_replicas,
                               f"must be odd and in 1..{a.nnodes} (--nnodes)",
                               "pass 3 (survives one member lost) or 5 (two)")
    if a.store != "tcp":
        from ..backends import etcd

        missing = etcd.missing_client()
        if missing is not None:
            raise bad_argument("--store", a.store, missing.split(". Fix: ")[0],
                               f"{etcd.INSTALL.split(' (')[0]}")
