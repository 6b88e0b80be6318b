"""The one in-memory store of the tests, and ranks run as threads over it.

``MemoryStore`` meets the package's Store Protocol (``protocol.Store``) as torch's c10d store
does: values are set as str or bytes and read as bytes; ``get`` and ``multi_get`` wait until
their keys are set, bounded by the store's timeout (``timeout``, ``set_timeout``); a wait that
expires raises RuntimeError worded as torch's ("... timeout ..."), which the torch engine's
``classify`` calls a timeout. ``clone()`` is another connection to the same data with its own
timeout. ``kill()`` stops its server: every later call, and every call still waiting, raises
RuntimeError("Connection reset by peer") as a client of a dead server does. ``calls`` counts
the round trips made to it (all connections together).

``ThreadRanks(n)`` plays the n ranks of one world as threads of this process: each rank has its
own real ``World`` (its own SPMD counters, its own connection to the shared store) on a
``ThreadEngine``, an engine with a store whose collectives meet across the threads.
``ranks.run(fn)`` calls ``fn(world)`` on every rank (or on ``ranks=[...]`` only: the others
never arrive) and returns each rank's result, or the exception it raised, by rank; a rank that
has not returned well after the configured timeout fails the test. Worlds last across runs, as
processes would: a second ``run`` continues the counters of the first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from tests import timing


class _Data:
    """What every connection to one MemoryStore shares: the keys, the lock, the state."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.dead = False
        self.calls = 0


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class MemoryStore:
    """An in-memory, thread-safe store with torch's semantics (see the module docstring)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=30), *, _data: _Data | None = None):
        self._data = _data or _Data()
        self._timeout = timeout

    # -- the Protocol ---------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        with self._op():
            self._data.kv[key] = _bytes(value)
            self._data.cond.notify_all()

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def check(self, keys: list[str]) -> bool:
        with self._op():
            return all(k in self._data.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._op():
            self._wait(keys)
            return [self._data.kv[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        with self._op():
            for k, v in zip(keys, values, strict=True):
                self._data.kv[k] = _bytes(v)
            self._data.cond.notify_all()

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As torch's: a missing key is set only when ``expected`` is empty (else ``expected``
        comes back); a present one only when it equals ``expected``; returns the value now."""
        with self._op():
            kv = self._data.kv
            if key not in kv:
                if _bytes(expected) != b"":
                    return _bytes(expected)
                kv[key] = _bytes(desired)
                self._data.cond.notify_all()
            elif kv[key] == _bytes(expected):
                kv[key] = _bytes(desired)
                self._data.cond.notify_all()
            return kv[key]

    def clone(self) -> MemoryStore:
        """Another connection to the same data, with its own timeout."""
        with self._op():
            return MemoryStore(self._timeout, _data=self._data)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # -- for the tests ----------------------------------------------------------------------------

    def kill(self) -> None:
        """The server dies: every call from now on, and every one waiting, raises."""
        with self._data.cond:
            self._data.dead = True
            self._data.cond.notify_all()

    def connection(self) -> MemoryStore:
        """A connection made before any fault (no round trip): a rank's own client."""
        return MemoryStore(self._timeout, _data=self._data)

    @property
    def calls(self) -> int:
        """Round trips made to this store so far, by every connection."""
        return self._data.calls

    def keys(self) -> list[str]:
        """Every key set, sorted (no round trip counted)."""
        with self._data.cond:
            return sorted(self._data.kv)

    # -- inside ---------------------------------------------------------------------------------

    def _op(self) -> _Op:
        return _Op(self._data)

    def _wait(self, keys: list[str]) -> None:
        """Wait (the condition held) until every key is set; bounded by the timeout."""
        data = self._data
        limit = self._timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not all(k in data.kv for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k in keys if k not in data.kv]
                raise RuntimeError(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                   f"{', '.join(missing)}")
            data.cond.wait(left)
            _raise_if_dead(data)


class _Op:
    """One round trip: the lock held, the server alive, counted."""

    def __init__(self, data: _Data):
        self._data = data

    def __enter__(self) -> None:
        self._data.cond.acquire()
        try:
            _raise_if_dead(self._data)
        except BaseException:
            self._data.cond.release()
            raise
        self._data.calls += 1

    def __exit__(self, *exc: object) -> None:
        self._data.cond.release()


def _raise_if_dead(data: _Data) -> None:
    if data.dead:
        raise RuntimeError("Connection reset by peer")


# ------------------------------------------------------------------------------ ranks as threads


class _Exchange:
    """Where the threads' collectives meet: call #n of a group gathers one value per member."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._posted: dict[tuple[str, int], dict[int, Any]] = {}

    def gather(self, group: str, n: int, index: int, size: int, value: Any,
               timeout_s: float) -> list[Any]:
        with self._cond:
            slot = self._posted.setdefault((group, n), {})
            slot[index] = value
            self._await(slot, size, timeout_s, f"{group} call #{n}")
            return [slot[i] for i in range(size)]


    def meet(self, key: str, size: int, timeout_s: float) -> None:
        """Wait until ``size`` threads came to ``key`` (a group's rendezvous as it is made)."""
        with self._cond:
            slot = self._posted.setdefault((key, 0), {})
            slot[len(slot)] = True
            self._await(slot, size, timeout_s, f"the members of {key}")

    def _await(self, slot: dict[int, Any], size: int, timeout_s: float, what: str) -> None:
        """With the lock held, after posting to ``slot``: wake the others and wait until it
        holds ``size`` entries, or raise as gloo does after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._cond.notify_all()
        while len(slot) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"Timed out waiting {timeout_s * 1000:.0f}ms for {what}")
            self._cond.wait(left)


class ThreadOps:
    """The collectives of one group, run by threads on numpy buffers: every call gathers one
    value per member (``_Exchange``), then each member computes its own result (sums for the
    reductions; ``all_to_all_single`` in equal chunks); ``send``/``recv`` meet by pair."""

    def __init__(self, exchange: _Exchange, group: Any, timeout_s: float):
        self._exchange, self._group, self._timeout_s = exchange, group, timeout_s
        self._n = 0
        self._pairs: dict[tuple[int, int], int] = {}  # (src, dst) -> messages so far

    def _gather(self, value: Any) -> list[Any]:
        self._n += 1
        return self._exchange.gather(self._group.name, self._n, self._group.rank(),
                                     self._group.size(), _copy(value), self._timeout_s)

    def _mine(self, global_rank: int) -> bool:
        return self._group.group_rank(global_rank) == self._group.rank()

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool) -> None:
        import numpy as np

        output.reshape(-1)[:] = np.concatenate([v.reshape(-1) for v in self._gather(input)])

    def all_reduce(self, tensor: Any, op: Any, async_op: bool) -> None:
        tensor[...] = sum(self._gather(tensor))

    def broadcast(self, tensor: Any, src: int, async_op: bool) -> None:
        tensor[...] = self._gather(tensor)[self._group.group_rank(src)]

    def reduce(self, tensor: Any, dst: int, op: Any, async_op: bool) -> None:
        total = sum(self._gather(tensor))
        if self._mine(dst):
            tensor[...] = total

    def all_gather(self, tensor_list: Any, tensor: Any, async_op: bool) -> None:
        for out, value in zip(tensor_list, self._gather(tensor), strict=True):
            out[...] = value

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any, async_op: bool) -> None:
        total = sum(self._gather(input)).reshape(-1)
        output.reshape(-1)[:] = total.reshape(self._group.size(), -1)[self._group.rank()]

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any,
                          input_split_sizes: Any, async_op: bool) -> None:
        import numpy as np

        size, me = self._group.size(), self._group.rank()
        chunks = [v.reshape(size, -1)[me] for v in self._gather(input)]
        output.reshape(-1)[:] = np.concatenate(chunks)

    def gather(self, tensor: Any, gather_list: Any, dst: int, async_op: bool) -> None:
        for out, value in zip(gather_list or (), self._gather(tensor), strict=False):
            out[...] = value

    def scatter(self, tensor: Any, scatter_list: Any, src: int, async_op: bool) -> None:
        lists = self._gather(list(scatter_list) if scatter_list is not None else None)
        tensor[...] = lists[self._group.group_rank(src)][self._group.rank()]

    def send(self, tensor: Any, dst: int) -> None:
        self._pair(self._group.global_rank(self._group.rank()), dst, 0, tensor)

    def recv(self, tensor: Any, src: int) -> None:
        tensor[...] = self._pair(src, self._group.global_rank(self._group.rank()), 1, None)

    def _pair(self, src: int, dst: int, index: int, value: Any) -> Any:
        """Message #n from ``src`` to ``dst``: both sides meet (the sender first, index 0)."""
        n = self._pairs[src, dst] = self._pairs.get((src, dst), 0) + 1
        return self._exchange.gather(f"{self._group.name} {src}->{dst}", n, index, 2,
                                     _copy(value), self._timeout_s)[0]

    def barrier(self, async_op: bool) -> None:
        import numpy as np

        self._gather(np.zeros(1))


def _copy(value: Any) -> Any:
    """What a member posts: a copy of its buffers (a list of them, or None: nothing)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [v.copy() for v in value]
    return value.copy()


class ThreadEngine:
    """An engine (``protocol.Engine``) for worlds whose ranks are threads: it has a store, is
    not simulated, words failures as the torch engine does (its ``classify``), and runs the
    collectives of ``ThreadOps`` (on any group: ``world.group(Ranks.of([...]))``).
    ``meets = True``: making a group waits until all its members make it, as gloo's does
    (bounded by the world's timeout); else a group is made at once."""

    name = "threads"

    def __init__(self, timeout_s: float):
        from tensorplay.distributed.backends.protocol import Capabilities

        self.capabilities = Capabilities(simulated=False, has_store=True)
        self._exchange = _Exchange()
        self._timeout_s = timeout_s
        self.meets = False
        self.made: list[str] = []  # the groups' names, once per member that made one
        self.severed: list[str] = []  # the groups' names, once per member that broke one

    def new_group(self, name: str, ranks: Any, backend: str, timeout: Any, desc: str, *,
                  apart: bool = False) -> str:
        """A group of threads: its name stands for it, once its members met (``meets``)."""
        if self.meets:
            self._exchange.meet(name, len(ranks), timeout.total_seconds())
        self.made.append(name)
        return name

    def ops(self, engine_group: Any, group: Any, failed: Any) -> ThreadOps:
        return ThreadOps(self._exchange, group, self._timeout_s)

    def classify(self, err: BaseException) -> Any:
        """As the torch engine says (the store's errors are worded as torch's)."""
        from tensorplay.distributed.backends.torch_c10d import TorchEngine

        return TorchEngine.classify(self, err)  # reads nothing of the engine itself

    def store_failure(self, err: BaseException) -> Any:
        """As the torch engine says (the store's errors are worded as torch's)."""
        from tensorplay.distributed.backends.torch_c10d import TorchEngine

        return TorchEngine.store_failure(self, err)  # reads nothing of the engine itself

    def store_reachable(self) -> bool:
        """The store of threads is in this process: posting to a dead one only raises."""
        return True

    def backend_for_device(self, device_type: str, world_backend: str) -> str:
        return world_backend

    def prepare_elastic(self) -> None:
        """Nothing to prepare (``Severable``: an elastic mesh may be made on threads)."""

    def use_device(self, device_type: str) -> None:
        """A thread has no device to pick."""

    def sever(self, engine_group: Any) -> None:
        """Nothing to break (the threads' groups hold no connections): noted in ``severed``."""
        self.severed.append(engine_group)

    def close_group(self, engine_group: Any) -> None:
        """Nothing to tear down."""

    def set_timeout(self, engine_group: Any, timeout: Any) -> None:
        """Nothing to change: a thread group waits only while it is made."""

    def destroy(self) -> None:
        """Nothing to tear down: a rank's world ends (``World.close``) with its groups."""


class ThreadRanks:
    """n ranks of one world as threads over one MemoryStore (see the module docstring).

    ``timeout_s``: the world's timeout (every store wait's bound). ``host_pids``: rank -> pid
    of the ranks "on this host" (default: this process for every rank; give an exited pid to
    play a rank that died). ``strict``: strict mode on the worlds' groups.
    """

    def __init__(self, n: int, timeout_s: float = 5.0, *, host_pids: dict[int, int] | None = None,
                 strict: bool = False):
        self.n = n
        self.timeout_s = timeout_s
        self.store = MemoryStore(timedelta(seconds=timeout_s))
        self.engine = ThreadEngine(timeout_s)
        self.host_pids = host_pids
        self.strict = strict
        self._worlds: dict[int, Any] = {}
        from tensorplay.distributed.control import keys as _keys
        from tensorplay.distributed.host import knobs

        # every rank on this host, as init_process_group's host exchange would have posted
        self.store.connection().set(_keys.HOSTS, "\n".join([knobs.hostname()] * n))

    def world(self, rank: int) -> Any:
        """Rank ``rank``'s World, made on first use: the one place a rank's world is built."""
        if rank not in self._worlds:
            from tensorplay.distributed.job.world import World

            self._worlds[rank] = World(
                rank, self.n, "gloo", timedelta(seconds=self.timeout_s), self.engine,
                self.store.connection(), strict=self.strict,
                host_pids=dict(self.host_pids) if self.host_pids is not None
                else dict.fromkeys(range(self.n), os.getpid()))
        return self._worlds[rank]

    def limit_s(self) -> float:
        """How long ``run`` waits for a rank: twice the world's timeout, plus a margin (a rank
        that timed out also diagnoses and settles), scaled to the machine's speed."""
        return timing.bound(2 * self.timeout_s, 10.0)

    def run(self, fn: Callable[..., Any], *args: Any,
            ranks: Sequence[int] | None = None) -> list[Any]:
        """``fn(world, *args)`` on each rank of ``ranks`` (default: all), each on its own
        thread; by rank, what it returned or the exception it raised (None for a rank not
        run)."""
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        worlds = {r: self.world(r) for r in ranks}
        out: list[Any] = [None] * self.n
        done = {r: threading.Event() for r in ranks}

        def main(rank: int) -> None:
            try:
                out[rank] = fn(worlds[rank], *args)
            except BaseException as err:  # noqa: BLE001 - returned to the test
                out[rank] = err
            finally:
                done[rank].set()

        for r in ranks:
            threading.Thread(target=main, args=(r,), daemon=True, name=f"rank {r}").start()
        deadline = time.monotonic() + self.limit_s()
        for r in ranks:
            if not done[r].wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"rank {r} did not return within {self.limit_s():.0f} s "
                                     f"(world timeout {self.timeout_s:g} s; {timing.describe()})")
        return out


def board(store: MemoryStore | None = None) -> Any:
    """A ``StoreBoard`` over ``store`` (a fresh MemoryStore by default), its failures judged
    as the torch engine judges its store's."""
    from tensorplay.distributed.control.store import JobStore, StoreBoard

    judge = ThreadEngine(30.0).store_failure
    return StoreBoard(JobStore(store if store is not None else MemoryStore(), judge))


def raised(results: Sequence[Any], kind: type[BaseException]) -> list[BaseException]:
    """Check that every result is an exception of ``kind``; return them."""
    for rank, result in enumerate(results):
        assert isinstance(result, kind), (rank, result)
    return list(results)


def exited_pid() -> int:
    """The pid of a process that has exited and been reaped (a rank that died)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
