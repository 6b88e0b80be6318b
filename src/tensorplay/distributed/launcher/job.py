"""This node's ranks as the launcher sees them: one supervise loop, two policies, one conclusion.

``Job.supervise(policy)`` takes events off the queue until no rank runs. What a rank's end means
is the policy's:

- ``FailFast`` (the default): the first failure stops the job. The other ranks get --settle-s
  to end on their own (so ranks that fail alike are all seen), then they are stopped;
- ``RestartLost`` (--max-restarts N): a rank lost to a signal while its script ran (killed, or
  hung and killed here) is restarted, at most N times per rank, and the others go on; any other
  end is final.

Either way a signal to the launcher stops every rank at once, and a verdict from another node
(``nodes``) stops them quickly. ``Job.conclude(policy)`` then prints what went wrong (a
hidden rank's tail, the held tracebacks, the summary line of ``rank_ends``) and returns the
exit status. Worked example, fail fast, 4 ranks, rank 1 raises at t = 4.0 s::

    t=4.0  Report(1, raised ValueError)  -> stop at 4.0 + settle_s
    t=4.1  Exit(1, 1, 4.1)
    t=5.0  SIGTERM to ranks 0, 2, 3; their Exit events come in
    conclude -> "rank 1 failed first (exit code 1): ValueError: bad lr; stopped ranks 0, 2-3."
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
from contextlib import suppress
from pathlib import Path

from ..errors import rank_words
from ..host import knobs, wire
from .events import (
    Beat,
    Event,
    Events,
    Exit,
    NodeChange,
    Notice,
    Recovered,
    Report,
    Signal,
    Verdict,
)
from .hangs import HangWatch
from .heartbeat import ACK_S
from .nodes import JobNodes
from .options import PROG
from .output import Output
from .procs import Proc, Threads, join_threads, signal_groups, start_rank, stop_ranks
from .rank_ends import RankEnd, RankReport, describe_code, first_failure, shorten, summarize
from .rank_table import RankTable
from .spec import LaunchSpec
from .warm import Warm

ELASTIC_TAIL_S = 10.0  # elastic: a restarted rank still waiting to join when all others ended
STOP_FAST_S = 2.0  # a node lost or stopped elsewhere: SIGTERM, then SIGKILL after at most this
LOST_SETTLE_S = 0.5  # a node lost: what is left of --settle-s for this node's ranks to end
# after the ranks ended: how long their output readers may take to reach the end of the pipes
# (a busy machine needs seconds; only a process left holding a pipe makes the launcher wait it)
DRAIN_S = 5.0


class FailFast:
    """The first failure (or hang, or verdict from elsewhere) ends the job, after --settle-s."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec

    def settle_after_failure(self) -> float | None:
        """Seconds the other ranks get after a rank of this node failed (None: go on)."""
        return self.spec.settle_s

    def settle_after_verdict(self, verdict: Verdict) -> float:
        """Seconds this node's ranks get after a verdict from elsewhere (they may say more
        first: those in our own checks raise RankFailedError, told through the verdict file)."""
        if verdict.kind == "lost":  # most wait for the lost node: be quick
            return min(self.spec.settle_s, LOST_SETTLE_S)
        return self.spec.settle_s

    def restart(self, job: Job, rank: int) -> bool:
        """Whether ``rank``, which just ended, was started again: never."""
        return False

    def judged(self, job: Job) -> list[RankEnd] | None:
        """The ends the summary judges (all of them); None would mean success."""
        return list(job.ends.values())


class RestartLost:
    """Elastic mode (--max-restarts): lost ranks are restarted, the others go on."""

    def __init__(self, spec: LaunchSpec):
        assert spec.max_restarts is not None
        self.spec = spec
        self.max_restarts = spec.max_restarts
        self.restarts: dict[int, int] = {}  # rank -> times restarted
        self.lost: list[tuple[RankEnd, bool]] = []  # ends of lost ranks, restarted or not

    def settle_after_failure(self) -> float | None:
        return None  # a failure here does not stop the others

    def settle_after_verdict(self, verdict: Verdict) -> float:
        return 0.0  # the job is over: stop at once

    def restart(self, job: Job, rank: int) -> bool:
        """Restart ``rank`` if a signal ended it while its script ran (killed, or hung and
        killed here) and it has restarts left."""
        end = job.ends[rank]
        said = end.report.event if end.report is not None else None
        if end.code is None or end.code >= 0 or said not in (None, "hung"):
            return False  # its script ended (returned, raised, exited) before it died: final
        done = self.restarts.get(rank, 0)
        again = done < self.max_restarts
        self.lost.append((end, again))
        cause = end.report.what if end.report is not None else describe_code(end.code)
        if not again:
            job.out.say(f"rank {rank} lost ({cause}); not restarted (--max-restarts "
                        f"{self.max_restarts} used): the others go on without it.")
            return False
        self.restarts[rank] = done + 1
        job.out.say(f"rank {rank} lost ({cause}); elastic mode: restarting it (restart "
                    f"{done + 1} of {self.max_restarts}); the others go on.")
        job.start_rank(rank, restart=done + 1)
        return True

    def judged(self, job: Job) -> list[RankEnd] | None:
        """None when the job went on to its end (some rank's script returned and none failed by
        itself), ranks lost on the way named; else the ends to judge (all, or those not lost
        for good when a script failed)."""
        ends = list(job.ends.values())
        final_lost = [e for e in ends if e.code is not None and e.code < 0 and e.stop_t is None
                      and (e.report is None or e.report.event == "hung")]  # not: died at exit
        by_script = [e for e in ends if e not in final_lost and e.stop_t is None
                     and e.failing()]
        if not any(e.kind() == "ok" for e in ends):
            return ends
        lost_nodes = [c for c in job.node_changes if c.kind == "lost"]
        if lost_nodes:
            back = {c.node for c in job.node_changes if c.kind == "back"}
            job.out.say("elastic: " + "; ".join(
                f"{c.text} ({'taken back by a new launcher' if c.node in back else 'not replaced'})"
                for c in lost_nodes) + "; the job went on to its end.")
        if self.lost:
            restarted = sorted({e.rank for e, again in self.lost if again})
            gone = sorted(e.rank for e in final_lost)
            words = [f"{rank_words(restarted)} restarted"] if restarted else []
            words += [f"{rank_words(gone)} lost for good"] if gone else []
            job.out.say(f"elastic: {len(self.lost)} rank loss(es) survived ("
                        f"{'; '.join(words)}); the job went on to its end"
                        f"{', but a script failed:' if by_script else '.'}")
        return [e for e in ends if e not in final_lost] if by_script else None


Policy = FailFast | RestartLost


def policy_for(spec: LaunchSpec) -> Policy:
    """``RestartLost`` with --max-restarts, else ``FailFast``."""
    return RestartLost(spec) if spec.elastic else FailFast(spec)


class Job:
    """This node's ranks: processes, and how each one ended.

    ``nodes`` (several nodes) tells the other nodes when this node's ranks fail, and brings
    their verdicts (a node lost, a failure elsewhere) as ``Verdict`` events.
    """

    def __init__(self, spec: LaunchSpec, out: Output, nodes: JobNodes | None = None,
                 warm: Warm | None = None, table: RankTable | None = None):
        self.spec = spec
        self.out = out
        self.nodes = nodes
        self.warm = warm  # the warm server the ranks are forked from (None: plain starts)
        self.table = table  # the rank -> pid file, rewritten at each (re)start (None: none)
        self.events: Events = queue.SimpleQueue()
        self.procs: dict[int, Proc] = {}
        self.threads: Threads = {}
        self.ends: dict[int, RankEnd] = {}
        self.hangs = HangWatch(spec.node_grace_s, spec.hang_timeout_s)
        self.verdict: Verdict | None = None  # why the job stopped, if another node said so
        self.node_changes: list[NodeChange] = []  # elastic mode: nodes lost and taken back
        self.recoveries: dict[int, Recovered] = {}  # epoch -> what its change cost (the latest)

    def start(self) -> None:
        """Start every rank of this node: as ranks joining a running elastic mesh when this
        launcher took back a lost node (they wait until the members' grow() admits them)."""
        joining = self.nodes is not None and self.nodes.claim > 1
        for rank in self.spec.local_ranks:
            self.start_rank(rank, restart=1 if joining else 0)

    def start_rank(self, rank: int, restart: int = 0) -> None:
        """Start (or restart) one rank, with a fresh record of how it ends."""
        self.ends[rank] = RankEnd(rank)
        local = rank - self.spec.node_rank * self.spec.nproc_per_node
        instance = "" if self.nodes is None else f"{self.nodes.index}.{self.nodes.claim}"
        store_url = "" if self.nodes is None else self.nodes.rank_store
        proc: Proc | None = None
        if self.warm is not None:
            try:
                proc = start_rank(self.spec, local, self.out, self.events, self.threads,
                                  restart, self.warm, instance, store_url)
            except OSError as err:
                self.out.say(f"warm start off: {err}; starting ranks as fresh interpreters.")
                self.warm = None
        if proc is None:
            proc = start_rank(self.spec, local, self.out, self.events, self.threads, restart,
                              instance=instance, store_url=store_url)
        self.procs[rank] = proc
        self.write_table()

    def write_table(self) -> None:
        """Write every rank's latest pid to the rank table (``rank_table``); when it cannot
        be written, say so once and write it no more (the launcher removes it at the end)."""
        if self.table is None:
            return
        try:
            self.table.write({r: p.pid for r, p in self.procs.items()})
        except OSError as err:
            self.out.say(f"the rank table {self.table.path} was not written ({err}); "
                         f"{PROG} --ps does not show this job.")
            self.table = None

    def record(self, event: Event) -> None:
        """Note an exit, a report (a rank's first report counts), a beat, or a verdict (the
        first counts). A signal is the supervise loop's to act on."""
        if isinstance(event, Exit):
            end = self.ends[event.rank]
            end.code, end.exit_t = event.code, event.t
        elif isinstance(event, Beat):
            self.hangs.beat(event.rank, event.still, event.where)
        elif isinstance(event, Report):
            end = self.ends[event.rank]
            end.report = end.report or event.report
        elif isinstance(event, Verdict):
            self.verdict = self.verdict or event
        elif isinstance(event, Recovered):
            self.recoveries[event.recovery.epoch] = event

    def supervise(self, policy: Policy) -> int | None:
        """Wait for the ranks until none runs (see the module). Returns None, or the signal
        number that stopped the job."""
        running = set(self.procs)
        restarted: set[int] = set()  # ranks whose running process is not the first one
        stop_at: float | None = None  # when the ranks still running get stopped
        fast = False  # the job is over elsewhere: stop quickly
        tail_from: float | None = None
        while running:
            wait = 0.5 if stop_at is None else min(stop_at - time.monotonic(), 0.5)
            if wait <= 0:
                break
            try:
                event: Event | None = self.events.get(timeout=wait)
            except queue.Empty:
                event = None
            if isinstance(event, Signal):
                self.stop(running)
                return event.signum
            if isinstance(event, NodeChange):
                self.note_change(event, running)
                continue
            if isinstance(event, Notice):
                self.pass_on(event, running)
                continue
            if isinstance(event, Verdict):
                self.verdict = event
                if stop_at is None:
                    self.out.say(f"{event.text}; stopping {rank_words(running)} on this node.")
                    self.tell_ranks(event)
                    stop_at, fast = time.monotonic() + policy.settle_after_verdict(event), True
                continue
            if event is not None:
                self.record(event)
                if isinstance(event, Exit):
                    running.discard(event.rank)
                    restarted.discard(event.rank)
                    if policy.restart(self, event.rank):
                        running.add(event.rank)
                        restarted.add(event.rank)
                settle = policy.settle_after_failure()
                if stop_at is None and settle is not None and self.ends[event.rank].failing():
                    stop_at = time.monotonic() + settle
            if stop_at is None:
                hung_at = self.kill_hung(running)
                settle = policy.settle_after_failure()
                if hung_at is not None and settle is not None:
                    stop_at = hung_at + settle
            if running and running <= restarted:  # only restarted ranks are left, waiting
                tail_from = tail_from or time.monotonic()
                if time.monotonic() - tail_from > ELASTIC_TAIL_S:
                    self.out.say(f"{rank_words(running)} (restarted) still running "
                                 f"{ELASTIC_TAIL_S:g} s after every other rank ended: stopping.")
                    break
        if stop_at is not None:  # after --settle-s: the cause it names is the summary's
            self.tell_others()
        self.stop(running, fast)
        return None

    def kill_hung(self, running: set[int]) -> float | None:
        """Kill the ranks that are hung (``hangs``), recording why; when one was, the time."""
        hung = self.hangs.hung({r: self.procs[r].pid for r in running})
        if not hung:
            return None
        now = time.monotonic()
        for rank, why in sorted(hung.items()):
            signal_groups(self.procs, [rank], signal.SIGKILL)
            text = f"hung on host {knobs.hostname()}: {why}; {PROG} killed it"
            self.out.say(f"rank {rank} {text}.")
            self.ends[rank].report = RankReport("hung", now, 1, text)
        return now

    def tell_others(self) -> None:
        """This node's job failed: post it, so every other node stops its ranks too.

        When this node's first failure is a consequence (a RankFailedError: a peer on another
        node died), the cause is that node's to name: its verdict is awaited first, for up to
        --settle-s + ``heartbeat.ACK_S`` (the other launcher settles, posts, and we read it). The
        verdict that stands, if another node's, is the one the summary names ("the job stopped
        because node 1 (hostB) failed: rank 5: killed by signal SIGKILL")."""
        if self.nodes is None:
            return
        failed = [e for e in self.ends.values() if e.failing()]
        stands = self.nodes.verdict
        if stands is None and failed:
            first = first_failure(failed)
            if first.is_consequence():
                stands = self.nodes.await_verdict(self.spec.settle_s + ACK_S)
            if stands is None:
                what = first.error() or describe_code(first.chosen_code() if first.report
                                                      else first.code or 1)
                stands = self.nodes.post("failed", f"node {self.spec.node_rank} "
                                         f"({knobs.hostname()}) failed: rank {first.rank}: "
                                         f"{shorten(what)}")
        elsewhere = stands is not None and (stands.kind != "failed"
                                            or stands.node != self.spec.node_rank)
        if elsewhere and self.verdict is None:
            self.verdict = stands

    def note_change(self, change: NodeChange, running: set[int]) -> None:
        """Elastic mode: another node was lost or taken back. Say so, and tell this node's
        ranks (``wire.write``; they read ``wire.lost_ranks``): a recovery counts a lost
        node's ranks as dead, and no rank waits for them."""
        self.node_changes.append(change)
        if change.kind == "lost":
            here = rank_words(sorted(running)) if running else "no rank"
            self.out.say(f"{change.text}; elastic mode: {here} on this node "
                         f"{'go' if len(running) > 1 else 'goes'} on without its "
                         f"{rank_words(change.ranks)}.")
        else:
            self.out.say(f"{change.text}: its ranks join the elastic mesh at the members' "
                         f"next grow().")
        path = self.spec.losses_file
        if not path:
            return
        back = [(c.node, c.claim) for c in self.node_changes if c.kind == "back"]
        losses = [{"node": c.node, "claim": c.claim, "ranks": c.ranks, "text": c.text,
                   "replaced": any(n == c.node and k > c.claim for n, k in back)}
                  for c in self.node_changes if c.kind == "lost"]
        with suppress(OSError):
            wire.write(path, losses)

    def pass_on(self, notice: Notice, running: set[int]) -> None:
        """SIGUSR1/SIGUSR2 to the launcher: pass it to the running ranks' process groups, as
        a warning they may act on (save a checkpoint). Slurm's ``--signal=USR1@60`` and
        ``scancel --signal=USR1`` signal the task's process group, the launcher's, and each
        rank has a group of its own (seen with Slurm 22.05): without this, no rank hears it."""
        signal_groups(self.procs, running, notice.signum)
        self.out.say(f"got {signal.Signals(notice.signum).name}; passed it to "
                     f"{rank_words(running) if running else 'no rank'}; the job goes on.")

    def tell_ranks(self, verdict: Verdict) -> None:
        """Write the verdict where this node's ranks look while they wait in a cross-rank
        check (``wire.VERDICT_FILE``): they raise RankFailedError saying it."""
        path = self.spec.verdict_file
        if not path:
            return
        n = self.spec.nproc_per_node
        lost = [] if verdict.lost is None else list(range(verdict.lost * n, (verdict.lost + 1) * n))
        with suppress(OSError):
            Path(path + ".tmp").write_text(json.dumps({"text": verdict.text, "ranks": lost}))
            os.replace(path + ".tmp", path)

    def stop(self, running: set[int], fast: bool = False) -> None:
        """Stop the ranks still running (marking them stopped) and wait for every process.
        ``fast``: the job is over elsewhere, so SIGKILL follows SIGTERM within STOP_FAST_S.

        A rank whose script has failed (it reported so) is exiting by itself: it gets the
        grace without a SIGTERM and is marked stopped only if it is still there at the end
        ("stopped while exiting"), so a slow teardown keeps the code its script chose.
        """
        now = time.monotonic()
        exiting = {r for r in running if (rep := self.ends[r].report_in_time()) is not None
                   and rep.failed}
        for r in running - exiting:
            self.ends[r].stop_t = now
        grace = min(self.spec.stop_grace_s, STOP_FAST_S) if fast else self.spec.stop_grace_s
        if running:
            left = stop_ranks(self.procs, running, grace, self.events, self.record, exiting)
            for r in left & exiting:
                self.ends[r].stop_t = time.monotonic()

    def drain(self) -> None:
        """After the processes ended: let the readers drain, then note what they reported."""
        join_threads([t for ts in self.threads.values() for t in ts], DRAIN_S)
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            self.record(event)
        for r, proc in self.procs.items():
            if self.ends[r].code is None:
                self.ends[r].code = proc.returncode

    def conclude(self, policy: Policy) -> int:
        """Print each elastic recovery's cost, then what went wrong (tail, tracebacks, summary)
        and return the exit status; the policy says which ends to judge."""
        for epoch in sorted(self.recoveries):
            said = self.recoveries[epoch]
            self.out.say(f"elastic recovery (rank {said.rank}): {said.recovery.line()}.")
        ends = policy.judged(self)
        if ends is None:
            return 0
        v = self.verdict
        elsewhere = v is not None and (v.kind != "failed" or v.node != self.spec.node_rank)
        if not any(e.failing() for e in ends) and not elsewhere:
            return 0
        several_nodes = self.spec.nnodes > 1
        text, code = summarize(ends, node_ranks="ranks on this node" if several_nodes else "ranks")
        failed = sorted((e for e in ends if e.kind() == "failed"),
                        key=lambda e: (e.is_consequence(), e.failed_at(), e.rank))
        order = [e.rank for e in failed] + [e.rank for e in ends if e.kind() != "failed"]
        if failed:
            self.out.show_tail(failed[0].rank)
        self.out.show_held(order, also=[failed[0].rank] if failed else [])
        self.out.say(text)
        if elsewhere and v is not None:
            self.out.say(f"the job stopped because {v.text}.")
        elif any(c.kind == "lost" for c in self.node_changes):  # the ranks could not go on
            lost = [c for c in self.node_changes if c.kind == "lost"][-1]
            self.out.say(f"the job stopped after {lost.text} (its ranks were "
                         f"{rank_words(lost.ranks)}; the others could not go on without them).")
        return code
