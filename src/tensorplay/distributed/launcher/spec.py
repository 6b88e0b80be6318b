"""The launch spec: everything one launcher needs to know, built once from the command line.

``parse_args`` reads and checks the flags (``options``), fills in what the command line leaves
open (the master address and port on one node), and fixes what the launcher decides at start:
whether it serves the job's store (``serve_store``), the environment the ranks inherit
(``base_env``, taken before the launcher changes its own) and, on several nodes, the file where
it tells its ranks a verdict (``verdict_file``). The spec is frozen: no step of the launch
changes it. Worked example::

    >>> spec = parse_args(["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
    ...                    "--master-addr", "10.0.0.1", "--master-port", "29500",
    ...                    "-m", "mypkg.train", "--lr", "0.1"])
    >>> spec.world_size, list(spec.local_ranks), spec.global_rank(1)
    (8, [4, 5, 6, 7], 5)
    >>> spec.rank_env(1)["RANK"], spec.rank_env(1)["MASTER_ADDR"]
    ('5', '10.0.0.1')
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import bad_argument
from ..host import wire
from ..host.wire import TENSORPLAY_RESTART_COUNT, VERDICT_FILE
from . import rank_main, store
from .options import (
    NO_WARM_ENV,
    PROG,
    build_parser,
    check_args,
    check_port_free,
    free_port,
    parse_rank_list,
    store_endpoints,
)


@dataclass(frozen=True)
class LaunchSpec:
    """The checked command line and what the launcher fixed at start (see the module)."""

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    shown: frozenset[int] | None  # --log-ranks: the ranks whose output is shown (None: all)
    log_dir: str | None
    stop_grace_s: float
    node_grace_s: float
    hang_timeout_s: float | None
    join_timeout_s: float
    max_restarts: int | None  # None: fail fast; else elastic mode
    settle_s: float
    module: bool
    script: str
    script_args: tuple[str, ...]
    serve_store: bool  # this launcher can serve the job's store (node 0 does; loaded lazily)
    base_env: Mapping[str, str]  # the launcher's environment at start: what the ranks inherit
    workdir: str | None  # several nodes: a private directory (made at launch) for the verdict
    store: str = "tcp"  # "tcp" (node 0's TCPStore) or "etcd" (--store etcd, or etcd://...)
    store_endpoints: tuple[str, ...] = ()  # --store etcd://...: the user's cluster
    store_replicas: int = 0  # --store etcd: how many nodes run a member (0: not ours)
    job_id: str = "default"  # --job-id: the job's name in the user's cluster
    warm: bool = True  # fork the ranks from one warm process (not --no-warm/TENSORPLAY_NO_WARM)
    preload: tuple[str, ...] = ()  # --preload: modules the warm process imports too

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """--max-restarts: lost ranks are restarted, the others go on."""
        return self.max_restarts is not None

    @property
    def verdict_file(self) -> str | None:
        """Where this node's ranks read a verdict from elsewhere (several nodes only)."""
        return None if self.workdir is None else os.path.join(self.workdir, "verdict")

    @property
    def losses_file(self) -> str | None:
        """Where this node's ranks read the nodes lost in elastic mode (several nodes only)."""
        return None if self.workdir is None else os.path.join(self.workdir, "losses")

    @property
    def local_ranks(self) -> range:
        """The global ranks of this node."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def rank_env(self, local_rank: int, restart: int = 0, instance: str = "",
                 store_url: str = "") -> dict[str, str]:
        """The environment of one rank (``restart``: the times it was restarted before;
        ``instance``: this launcher's ``"<node>.<claim>"``, once it joined the other nodes;
        ``store_url``: under etcd, the job's store for the ranks, ``wire.STORE``)."""
        env = child_env(self.base_env, rank=self.global_rank(local_rank), local_rank=local_rank,
                        world_size=self.world_size, local_world_size=self.nproc_per_node,
                        node_rank=self.node_rank, master_addr=self.master_addr,
                        master_port=self.master_port,
                        agent_store=self.serve_store and self.store == "tcp")
        if store_url:
            env[wire.STORE] = store_url
        if self.hang_timeout_s is not None:
            env[rank_main.BEAT_S] = "1"
        if restart:  # elastic mode: this rank joins a running job's elastic mesh
            env[TENSORPLAY_RESTART_COUNT] = str(restart)
        if self.verdict_file:
            env[VERDICT_FILE] = self.verdict_file
        if self.losses_file and self.elastic:
            env[wire.LOSSES_FILE] = self.losses_file
        if instance:
            env[wire.NODE_INSTANCE] = instance
        if sys.platform.startswith("linux"):  # rank_main.name_this_process reads /proc
            env[rank_main.TITLE] = self.rank_title(local_rank, restart)
            env[rank_main.COMM] = f"{rank_main.COMM_PREFIX}{self.global_rank(local_rank)}"
        return env

    def script_line(self) -> str:
        """The command a rank runs, as a shell reads it: ``python train.py --lr 0.1`` (``python
        -m mypkg.train ...`` with -m; ``python`` is this interpreter's file name, ``python3.12``
        say; an argument with a space or a quote is quoted: ``--name 'a b'``)."""
        return shlex.join([os.path.basename(sys.executable), *(["-m"] if self.module else []),
                           self.script, *self.script_args])

    def rank_title(self, local_rank: int, restart: int = 0) -> str:
        """What ``ps`` shows as a rank's command line: ``tensorplay-run rank 5/8: python
        train.py --lr 0.1`` (rank 5 of a world of 8; ``rank 5/8 (restart 1): ...`` once elastic
        mode restarted it)."""
        again = f" (restart {restart})" if restart else ""
        return (f"{PROG} rank {self.global_rank(local_rank)}/{self.world_size}{again}: "
                f"{self.script_line()}")

    def rank_args(self) -> list[str]:
        """What ``rank_main.main`` reads: ``--file SCRIPT ARGS...`` or ``--module NAME ...``."""
        return ["--module" if self.module else "--file", self.script, *self.script_args]

    def rank_command(self) -> list[str]:
        """A rank's command line: the script under ``rank_main``, its arguments untouched."""
        return [sys.executable, "-c", rank_main.loader_command(), *self.rank_args()]

    def wants_warm(self) -> bool:
        """Whether to fork the ranks from a warm process: on by default, off with --no-warm
        or TENSORPLAY_NO_WARM=1, and off for one rank that is never restarted (one import
        either way)."""
        return self.warm and (self.nproc_per_node > 1 or self.elastic)


def parse_args(argv: list[str] | None) -> LaunchSpec:
    """Parse and check the command line (a usage error names the flag), and build the spec."""
    a = build_parser().parse_args(argv)
    check_args(a)
    return from_args(a)


def from_args(a: argparse.Namespace) -> LaunchSpec:
    """The spec of checked flags: the master address and port filled in (a given port checked
    free on node 0), whether this launcher serves the store, the ranks' environment."""
    world_size = a.nnodes * a.nproc_per_node
    shown = None if a.log_ranks is None else frozenset(parse_rank_list(a.log_ranks, world_size))
    master_addr = a.master_addr or "127.0.0.1"
    master_port = a.master_port
    if master_port is None:
        master_port = free_port()
    elif a.node_rank == 0:  # rank 0, which serves the store, runs here
        check_port_free(master_addr, master_port)
    serve_store = store.can_serve()
    replicas = 0
    if a.store == "etcd":
        from .etcd_nodes import replicas_for

        replicas = replicas_for(a.nnodes, a.store_replicas)
        if a.node_rank < replicas:
            _check_etcd_binary()
    if a.max_restarts is not None and not serve_store and a.store == "tcp":
        raise bad_argument("--max-restarts", a.max_restarts, "needs the launcher to serve the "
                           "job's store (it outlives any rank), which needs torch in the "
                           f"launcher's Python ({sys.executable})", "install torch there, or "
                           "leave out --max-restarts")
    workdir = None
    if a.nnodes > 1 or a.store != "tcp":  # named now, made at launch (mode 0o700, never one
        # that exists)
        workdir = os.path.join(tempfile.gettempdir(), f"{PROG}-{secrets.token_hex(8)}")
    return LaunchSpec(
        nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
        master_addr=master_addr, master_port=master_port, shown=shown, log_dir=a.log_dir,
        stop_grace_s=a.stop_grace_s, node_grace_s=a.node_grace_s,
        hang_timeout_s=a.hang_timeout_s, join_timeout_s=a.join_timeout_s,
        max_restarts=a.max_restarts, settle_s=a.settle_s, module=a.module, script=a.script,
        script_args=tuple(a.script_args), serve_store=serve_store,
        base_env=MappingProxyType(dict(os.environ)), workdir=workdir,
        store="tcp" if a.store == "tcp" else "etcd",
        store_endpoints=tuple(store_endpoints(a.store)) if a.store.startswith("etcd://") else (),
        store_replicas=replicas, job_id=a.job_id,
        warm=not a.no_warm and os.environ.get(NO_WARM_ENV, "").strip() in ("", "0"),
        preload=tuple(a.preload))


def _check_etcd_binary() -> None:
    """A node that runs a store member needs etcd's server: a usage error naming what to
    install, before any rank starts."""
    from .etcd_members import MembersError, find_binary

    try:
        find_binary()
    except MembersError as err:
        raise bad_argument("--store", "etcd", str(err).rstrip("."), "install it as said "
                           "above") from None


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


