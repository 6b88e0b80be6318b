"""tensorplay-run's entry point: build the spec, meet the other nodes, run the job, conclude.

``main(argv)`` returns the exit status: 0, a failed rank's status (128 + signal for a rank
killed by one), 128 + signal when the launcher itself was stopped, 1 for a job stopped by
another node, 2 for a usage error (``tensorplay-run: error: --flag=value: problem. Fix:
...``). Whatever happens, no rank is left behind, and what the launcher changed (its signal
handlers, its TORCH_CPP_LOG_LEVEL, the verdict directory) is put back. Worked example::

    $ tensorplay-run --nproc-per-node 4 train.py --lr 0.1
    [rank 0] step 1 loss 2.31
    ...
    tensorplay-run: rank 1 failed first (exit code 1): ValueError: bad lr; stopped ranks 0, 2-3.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace

from ..errors import ArgumentError, bad_argument, rank_words
from ..host import knobs, netif
from . import handoff, join, rank_table, slurm_step, store
from .events import Events, Notice, Signal, Verdict
from .job import Job, policy_for
from .join import JoinError
from .nodes import JobNodes
from .options import PROG, build_parser, check_args
from .output import Output
from .procs import stop_ranks
from .rank_table import RankTable
from .roster import NodeFlags
from .spec import LaunchSpec, from_args
from .warm import Warm

USAGE_ERROR = 2
OMP_NOTE = ("setting OMP_NUM_THREADS=1 for every rank, as torchrun does, so {n} ranks do not "
            "oversubscribe the cores (it was not set; set it to choose another value)")


@contextmanager
def _signals_to(events: Events) -> Iterator[None]:
    """While active, SIGINT/SIGTERM (stop) and SIGUSR1/SIGUSR2 (a warning: ``Job.pass_on``)
    to the launcher become events (SimpleQueue is reentrant)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda num, _frame: events.put(Signal(num)))
           for s in (signal.SIGINT, signal.SIGTERM)}
    old |= {s: signal.signal(s, lambda num, _frame: events.put(Notice(num)))
            for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _nodes(spec: LaunchSpec) -> JobNodes:
    flags = NodeFlags(nnodes=spec.nnodes, index=spec.node_rank, nproc=spec.nproc_per_node,
                      host=knobs.hostname(), addr=spec.master_addr, port=spec.master_port,
                      grace_s=spec.node_grace_s, join_timeout_s=spec.join_timeout_s,
                      elastic=spec.elastic)
    if spec.store == "tcp":
        return JobNodes(flags)
    from .etcd_nodes import EtcdNodes

    route = netif.route_to(spec.master_addr)
    own = spec.master_addr if netif.is_local(spec.master_addr) or route is None \
        else route.address
    flags = replace(flags, store="etcd", own_addr=own, members=spec.store_replicas,
                    job_id=spec.job_id)
    return EtcdNodes(flags, spec.store_endpoints, spec.job_id)


def _store_note(spec: LaunchSpec) -> str | None:
    """What node 0 says at start of a store that survives no loss of a member."""
    if spec.store != "etcd" or spec.store_endpoints or spec.node_rank != 0:
        return None
    from .etcd_nodes import majority_note

    return majority_note(spec.store_replicas)


def launch(spec: LaunchSpec) -> int:
    """Join the other nodes, start this node's ranks, supervise them, and leave no child
    behind on any path."""
    out = Output(spec.shown, spec.log_dir, spec.local_ranks)
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        out.say(OMP_NOTE.format(n=spec.nproc_per_node))
    if spec.workdir is not None:
        os.mkdir(spec.workdir, 0o700)
    if spec.serve_store and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # torch logs each failed connect with a
        # C++ stack trace: noise in a launcher, which says itself what failed
    joins = spec.nnodes > 1 or spec.store != "tcp"  # meets the other nodes in the store
    nodes = _nodes(spec) if spec.serve_store or spec.store != "tcp" else None
    if (note := _store_note(spec)) is not None:
        out.say(f"{note}.")
    if nodes is not None and spec.store == "tcp" and spec.wants_warm():
        store.preload()  # meanwhile the warm process imports torch too (store.preload says
        # why); a launcher of --store etcd never imports torch: its import, holding the GIL
        # on a thread, slowed its start by seconds (3 launchers on 2 cores: 4.5 s to their
        # first etcd call, 1.5 s without it)
    warm = _warm(spec, out)
    table = _table(spec, out)
    job = Job(spec, out, nodes if joins else None, warm, table)
    policy = policy_for(spec)
    serving: threading.Thread | None = None
    with _signals_to(job.events):
        try:
            if nodes is not None and joins:
                try:
                    nodes.join()
                except JoinError as err:
                    out.say(f"error: {err}.")
                    return 1
                if nodes.claim > 1:
                    out.say(f"this launcher takes back node {spec.node_rank}, which the job "
                            f"declared lost: its ranks start as ranks joining the elastic "
                            f"mesh.")
                nodes.watch(job.events.put, job.events.put)
            elif nodes is not None:  # one node: serve once a rank asks
                serving = threading.Thread(target=_serve, args=(nodes, job.events),
                                           name="tensorplay-run store")
                serving.start()
            job.start()
            signum = job.supervise(policy)
            job.drain()
            if signum is not None:
                got = f"got {signal.Signals(signum).name}{slurm_step.signal_words(spec.base_env)}"
                _tell_signal(job, got)
                stopped = sorted(r for r, e in job.ends.items() if e.stop_t is not None)
                job.out.show_held(sorted(job.ends))
                out.say(f"{got}; stopped "
                        f"{rank_words(stopped) if stopped else 'no rank (none was running)'}.")
                return 128 + signum
            code = job.conclude(policy)
            if job.nodes is not None:
                code = _leave(job, code)
            return code
        finally:
            alive = [r for r, p in job.procs.items() if p.returncode is None]
            if alive:  # only on an unexpected error: never leave a child behind
                stop_ranks(job.procs, alive, spec.stop_grace_s, job.events, lambda _event: None)
            if warm is not None and (left := warm.close()) is not None:
                out.say(f"{left}.")
            if serving is not None and nodes is not None:
                nodes.stop_asking()
                serving.join()
            if nodes is not None:
                nodes.close()
                if (left := getattr(nodes, "left_behind", None)) is not None:
                    out.say(f"{left}.")
            if spec.workdir is not None:
                shutil.rmtree(spec.workdir, ignore_errors=True)
            if table is not None:
                try:
                    table.remove()
                except OSError as err:
                    out.say(f"the rank table {table.path} was not removed ({err}).")
            if "TORCH_CPP_LOG_LEVEL" not in spec.base_env:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
            out.close()


def _warm(spec: LaunchSpec, out: Output) -> Warm | None:
    """Start the warm process the ranks are forked from, or say in one line why not."""
    if not spec.wants_warm():
        return None
    title = f"{PROG} warm: {spec.script_line()}" if sys.platform.startswith("linux") else ""
    warm, why = Warm.start(spec.rank_env(0), spec.preload, title)
    if warm is None:
        out.say(f"warm start off: {why}; starting ranks as fresh interpreters.")
    return warm


def _table(spec: LaunchSpec, out: Output) -> RankTable | None:
    """This launcher's rank -> pid table (``rank_table``; written as the ranks start), or
    None, said in one line, when its directory cannot be used."""
    header = (f"{PROG} {os.getpid()}, node {spec.node_rank} of {spec.nnodes}: "
              f"{spec.script_line()}")
    try:
        return RankTable.create(header, knobs.hostname())
    except OSError as err:
        out.say(f"no rank table for this job ({err}); {PROG} --ps does not show it.")
        return None


def ps(argv: list[str]) -> int:
    """``tensorplay-run --ps [LAUNCHER_PID]``: print the rank -> pid table of that launcher,
    or of every running launcher of this user; 1 when there is none, 2 for a bad argument."""
    if len(argv) > 1 or (argv and not argv[0].isdigit()):
        raise bad_argument("--ps", " ".join(argv), "takes one launcher pid, or none",
                           f"run {PROG} --ps, or {PROG} --ps 4242 for launcher pid 4242")
    text, code = rank_table.show(int(argv[0]) if argv else None)
    (sys.stdout if code == 0 else sys.stderr).write(text)
    return code


def _serve(nodes: JobNodes, events: Events) -> None:
    """One node: serve the job's store when a rank asks; when it cannot, stop the job."""
    try:
        nodes.serve_when_asked()
    except JoinError as err:
        events.put(Verdict("store", 0, str(err)))


def _tell_signal(job: Job, got: str) -> None:
    """Several nodes, not elastic: this launcher was stopped by a signal; post it as the job's
    verdict, so that the others say why they stop (``node 1 (hostB, ranks 4-7) got SIGTERM
    (Slurm cancelled job 41 ...)``), not that node 1 is lost when its link closes. Under
    scancel every node gets the signal; the first posted stands. An elastic job goes on
    without a node stopped alone: it is lost, as it would be."""
    nodes = job.nodes
    if nodes is None or nodes.client is None or job.spec.elastic or job.verdict is not None:
        return
    nodes.post("signal", f"{nodes.own_name()} {got}")


def _leave(job: Job, code: int) -> int:
    """Several nodes, this node's ranks ended: tell node 0, or (node 0) serve the store until
    every node is done. A node lost after our ranks succeeded fails the job."""
    nodes = job.nodes
    assert nodes is not None
    if not nodes.keeps_store_up():
        nodes.beat_done()
        return code
    if nodes.flags.equal:  # a store member: say it is done too (the other members wait for it)
        nodes.beat_done()
    signals: list[int] = []

    def interrupted() -> bool:  # SIGINT/SIGTERM while node 0 serves the others' store
        with suppress(queue.Empty):
            event = job.events.get_nowait()
            if isinstance(event, Signal):
                signals.append(event.signum)
        return bool(signals)

    if nodes.await_others(interrupted) or code:
        return code
    if signals:
        job.out.say(f"got {signal.Signals(signals[0]).name}"
                    f"{slurm_step.signal_words(job.spec.base_env)} while the other nodes "
                    f"still used the store this node serves; stopped serving it.")
        return 128 + signals[0]
    if nodes.verdict is not None:
        job.out.say(f"the job stopped because {nodes.verdict.text}.")
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of tensorplay-run; returns the exit code (2 for usage errors)."""
    try:
        words = sys.argv[1:] if argv is None else argv
        if words[:1] == ["--ps"]:
            return ps(words[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        check_args(args)
        if handoff.needed():  # no torch: the job runs under mpiexec, or we say how
            return handoff.hand_off(args, parser)
        return launch(from_args(args))
    except SystemExit as exc:  # argparse: --help (0) or a malformed command line (2)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except slurm_step.StepRefusal as exc:  # node 0 would wait for this node: tell it
        told = join.refuse(exc.addr, exc.port, exc.step.task, exc.told)
        print(f"{PROG}: error: {exc} {told[0].upper()}{told[1:]}.", file=sys.stderr)
        return USAGE_ERROR
    except ArgumentError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
