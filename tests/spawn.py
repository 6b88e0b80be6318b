"""The one spawn helper of the multi-process tests: start real ranks, run a function on each.

``run(fn, n)`` starts n fresh processes (gloo over 127.0.0.1; forked from a server that
imported torch once, with the caller's environment of now), calls ``fn(rank, *args)`` on
each and returns their results in rank order; a failing rank fails the test with its traceback.
``Pool(n)`` keeps n ranks initialised across many calls (much faster than a spawn per test).
Every wait has a deadline and every child is killed on the way out.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests import timing

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed.tensor"])  # imported once, in the
# server (torch 1.8 s of CPU, DTensor 0.8 s more): each rank is a fork


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pythonpath() -> str:
    """PYTHONPATH for a process a test starts: this checkout's package (src/) and its tests,
    never another copy installed in the environment (an editable install of another tree)."""
    return os.pathsep.join([os.path.join(ROOT, "src"), ROOT])


def without(directory: str | os.PathLike, *modules: str) -> str:
    """A PYTHONPATH entry (written into ``directory``) whose ``sitecustomize`` makes
    ``modules`` unimportable, as where they are not installed: ``find_spec`` and ``import``
    raise ModuleNotFoundError. It holds in every process started with it on PYTHONPATH, their
    children too (mpiexec's ranks). ``without(tmp_path, "torch")``: an environment without
    torch."""
    path = os.path.join(directory, "sitecustomize.py")
    with open(path, "w") as f:
        f.write(f"""import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {sorted(modules)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
""")
    return os.fspath(directory)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports of 127.0.0.1 that were free a moment ago
    (an etcd member takes two, a job of three members six)."""
    for _ in range(100):
        port = free_port()
        if port + count < 65000 and all(_free(port + i) for i in range(1, count)):
            return port
    raise RuntimeError(f"no {count} free ports in a row on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Failure:
    """What a rank raised: the exception's type name, message and traceback."""

    kind: str
    message: str
    trace: str
    types: tuple[str, ...]  # names of the exception's classes, most derived first


NO_ANSWER = Failure("NoAnswer", "the rank did not answer before the deadline", "", ("NoAnswer",))


def _env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }
    env.update(extra or {})
    return env


def _capture(fn: Callable, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        return "error", Failure(
            type(err).__name__, str(err), traceback.format_exc(),
            tuple(c.__name__ for c in type(err).__mro__),
        )


def _init(timeout_s: float) -> None:
    import tensorplay.distributed as dist

    dist.init_process_group("gloo", timeout=timeout_s)


def _as_spawned(parent_env: dict[str, str]) -> None:
    """A forked rank sees the test's environment of now, as a spawned one would (the fork
    server's was frozen when it started)."""
    os.environ.clear()
    os.environ.update(parent_env)


def _child(rank, world_size, port, env, init, timeout_s, fn, args, results, parent_env):
    _as_spawned(parent_env)
    os.environ.update(_env(rank, world_size, port, env))
    import tensorplay.distributed as dist

    if init:
        status, value = _capture(_init, timeout_s)
        if status == "error":
            results.put((rank, status, value))
            return
    results.put((rank, *_capture(fn, rank, *args)))
    if init and dist.is_initialized():
        dist.destroy_process_group()


def run(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60,
    pg_timeout: float = 30,
    init: bool = True,
    env: dict[str, str] | None = None,
    expect_errors: bool = False,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` fresh ranks; results (or Failures) by rank.

    Without ``expect_errors`` any Failure fails the test with that rank's traceback. A rank
    that has not answered by ``timeout`` gets NO_ANSWER (and is killed).
    """
    port = free_port()
    results = _CTX.Queue()
    procs = [
        _CTX.Process(target=_child, args=(r, world_size, port, env, init, pg_timeout, fn, args,
                                          results, dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: list[Any] = [NO_ANSWER] * world_size
    try:
        _collect(results, procs, out, timing.guard(timeout))  # a hang guard: scaled
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if not expect_errors:
        _raise_failures(out)
    return out


def _collect(results, procs, out: list[Any], timeout: float) -> None:
    """Fill ``out`` by rank, waiting up to ``timeout`` for each answer; stop early once every
    rank that has not answered has exited (killed by a signal, say) and nothing is in flight."""
    waiting = set(range(len(procs)))
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            rank, status, value = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            if any(procs[r].is_alive() for r in waiting):
                continue
            try:  # an exited rank's answer is already in the pipe
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                return
        out[rank] = value
        waiting.discard(rank)
        deadline = time.monotonic() + timeout


def _raise_failures(out: list[Any]) -> None:
    failed = [(r, v) for r, v in enumerate(out) if isinstance(v, Failure)]
    if failed:
        rank, failure = failed[0]
        raise AssertionError(f"rank {rank} raised {failure.kind}: {failure.message}\n"
                             f"{failure.trace}")


def _pool_child(rank, world_size, port, tasks, results, parent_env):
    _as_spawned(parent_env)
    os.environ.update(_env(rank, world_size, port, None))
    import tensorplay.distributed as dist

    results.put((rank, *_capture(_init, 60)))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        results.put((rank, *_capture(fn, rank, *args)))
    dist.destroy_process_group()


class Pool:
    """``world_size`` ranks that stay initialised; ``pool.run(fn, *args)`` runs on all."""

    def __init__(self, world_size: int, timeout: float = 120):
        self.world_size = world_size
        self.timeout = timeout
        port = free_port()
        self._results = _CTX.Queue()
        self._tasks = [_CTX.Queue() for _ in range(world_size)]
        self._procs = [
            _CTX.Process(target=_pool_child, args=(r, world_size, port, self._tasks[r],
                                                   self._results, dict(os.environ)), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect()  # the init results

    def _collect(self) -> list[Any]:
        out: list[Any] = [NO_ANSWER] * self.world_size
        try:
            for _ in range(self.world_size):
                rank, status, value = self._results.get(timeout=timing.guard(self.timeout))
                out[rank] = value
        except queue.Empty:
            pass
        _raise_failures(out)
        return out

    def run(self, fn: Callable, *args: Any) -> list[Any]:
        """Results of ``fn(rank, *args)`` on every rank, in rank order."""
        for q in self._tasks:
            q.put((fn, args))
        return self._collect()

    def close(self) -> None:
        """Stop every rank."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
