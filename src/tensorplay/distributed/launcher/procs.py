"""The ranks' processes: start one, signal their process groups, stop some, reap them all.

Each rank runs in its own process group (``start_new_session``), so a signal reaches the rank
and anything it spawned. ``start_rank`` gives it a report pipe, two reader threads
(``output``) and a waiter thread that puts an ``Exit`` event when it ends. Worked example
(what ``Job`` does when a rank fails and the others must go)::

    procs = {r: start_rank(spec, r, out, events, threads) for r in range(4)}
    stop_ranks(procs, {0, 2, 3}, grace_s=5.0, events=events, record=job.record)
    # SIGTERM to ranks 0, 2, 3; up to 5 s for them to go (a Signal event cuts it short);
    # then SIGKILL to every group, and every process waited for
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress

from . import rank_main
from .events import Beat, Event, Events, Exit, Recovered, Report, Signal
from .output import Output, pump_stderr, pump_stdout
from .spec import LaunchSpec
from .warm import KILLED_S, Warm, WarmProc

Threads = dict[int, list[threading.Thread]]  # rank -> its reader threads
Proc = subprocess.Popen | WarmProc  # a rank's process: started plainly, or forked warm


def _reap(proc: Proc, rank: int, events: Events) -> None:
    """Waiter thread: report the child's exit status as soon as it has one."""
    code = proc.wait()
    events.put(Exit(rank, code, time.monotonic()))


def start_rank(spec: LaunchSpec, local_rank: int, out: Output, events: Events,
               threads: Threads, restart: int = 0, warm: Warm | None = None,
               instance: str = "", store_url: str = "") -> Proc:
    """Start one rank in its own process group, with its report pipe, two readers and a waiter:
    forked by the ``warm`` server when there is one, else a fresh interpreter (Popen).

    The rank's parent-death signal is tied to the thread that starts it, so call this from the
    thread that supervises the job (it lives as long as the launcher).
    """
    rank = spec.global_rank(local_rank)
    env = spec.rank_env(local_rank, restart, instance, store_url)
    report_r, report_w = os.pipe()
    proc: Proc
    try:
        if warm is not None:
            proc = _fork_rank(warm, spec, env, report_w)
        else:
            env[rank_main.REPORT_FD] = str(report_w)
            env[rank_main.PARENT_PID] = str(os.getpid())
            proc = subprocess.Popen(spec.rank_command(), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, pass_fds=(report_w,))
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)

    def on_event(event: Report | Beat | Recovered) -> None:
        if isinstance(event, Report) and event.report.event == "raised" and event.report.first:
            out.expect(event.rank, event.report.first)
        events.put(event)

    assert proc.stdout is not None and proc.stderr is not None
    readers = [threading.Thread(target=pump_stdout, args=(proc.stdout, rank, out), daemon=True),
               threading.Thread(target=pump_stderr, daemon=True,
                                args=(proc.stderr, report_r, rank, out, on_event))]
    threads.setdefault(rank, []).extend(readers)
    for t in [*readers, threading.Thread(target=_reap, args=(proc, rank, events), daemon=True)]:
        t.start()
    return proc


def _fork_rank(warm: Warm, spec: LaunchSpec, env: dict[str, str], report_w: int) -> WarmProc:
    """Have the warm server fork the rank, on pipes made here as Popen makes them."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        return warm.spawn(env, spec.rank_args(), out_w, err_w, report_w, out_r, err_r)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)


def signal_groups(procs: Mapping[int, Proc], ranks: Iterable[int], sig: int) -> None:
    """Send sig to each rank's whole process group (the rank and anything it spawned)."""
    for r in ranks:
        with suppress(OSError):  # the group is already gone
            os.killpg(procs[r].pid, sig)


def stop_ranks(procs: Mapping[int, Proc], ranks: Iterable[int], grace_s: float,
               events: Events, record: Callable[[Event], None],
               exiting: Iterable[int] = ()) -> set[int]:
    """SIGTERM the given ranks, wait up to grace_s (a new signal cuts it short), SIGKILL all.
    Returns the ranks that had not exited when the grace ran out (or a signal came).

    ``exiting``: ranks whose scripts have failed and are on their way out by themselves
    (their report came); they get the grace to end without a SIGTERM, so that a slow
    teardown (torch's, on a busy machine) ends with the code their script chose.
    Events that arrive meanwhile (exits, reports, beats, a verdict) go to ``record``.
    """
    pending = set(ranks)
    signal_groups(procs, pending - set(exiting), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if isinstance(event, Signal):
            break
        record(event)
        if isinstance(event, Exit):
            pending.discard(event.rank)
    signal_groups(procs, procs, signal.SIGKILL)
    for proc in procs.values():  # bounded: a process not reaped after its SIGKILL is left
        with suppress(subprocess.TimeoutExpired):  # to the system (see Warm.close)
            proc.wait(KILLED_S)
    return pending


def join_threads(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Wait for reader threads to drain, but never longer than timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
