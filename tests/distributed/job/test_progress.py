"""A call that lasts says what it waits in (``job/progress.py``), once, and a quick one says
nothing; every call a user can wait in is declared, and each is named in its notice.

In this process: the test's main thread (the one watched) is a rank of a world whose ranks
are threads over one in-memory store (``tests.fakes.ThreadRanks``); its call waits for
another rank, which makes its part of the call only once the notice is logged (bounded by
the world's timeout: no sleep lets anything happen). A call whose door reads the process's
world (``current_world``) is made by a thread rank with its own world current for that call
(``current``): the main thread's call, past its door, holds its own."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import numpy as np
import pytest

import tensorplay.distributed as dist
from tensorplay.distributed import backends, collectives, device_mesh
from tensorplay.distributed.backends.protocol import Started
from tensorplay.distributed.control import keys
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh, sync_replicas
from tensorplay.distributed.elastic import chain
from tensorplay.distributed.elastic import mesh as elastic_mesh
from tensorplay.distributed.errors import MembersFinished, RankFailedError
from tensorplay.distributed.geometry.spec import MeshSpec
from tensorplay.distributed.host import knobs
from tensorplay.distributed.job import lifecycle, progress
from tensorplay.distributed.mesh.groups import make_groups
from tensorplay.distributed.mesh.parts import MeshParts
from tests import timing
from tests.fakes import ThreadEngine, ThreadRanks

AFTER_S = 0.2  # TENSORPLAY_PROGRESS_S in these tests
TIMEOUT_S = 20.0  # the worlds' timeout: every wait's bound


class Notices(logging.Handler):
    """The hang notices logged; ``first`` is set by the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "still in" in record.getMessage():
            self.lines.append(record.getMessage())
            self.first.set()


@pytest.fixture
def notices(monkeypatch) -> Iterator[Notices]:
    """The notes of the watcher (looking every 0.05 s), no world current to begin with."""
    monkeypatch.setattr(progress, "LOOK_EVERY_S", 0.05)
    monkeypatch.setattr(lifecycle, "_WORLD", None)
    handler = Notices()
    logger = logging.getLogger("tensorplay.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    yield handler
    logger.removeHandler(handler)
    progress.stop()


@contextlib.contextmanager
def current(world: Any) -> Iterator[None]:
    """``world`` is the process's world (``current_world``) inside."""
    before = lifecycle._WORLD
    lifecycle._WORLD = world
    try:
        yield
    finally:
        lifecycle._WORLD = before


def waited(notices: Notices, call: Callable[[], Any], then: Callable[[], Any]) -> Any:
    """``call()`` on the main thread while ``then()`` waits on another for the first notice,
    then runs (the part of the other ranks that lets ``call`` end); what ``call`` returned.
    Both are bounded by the worlds' timeout."""
    failed: list[BaseException] = []

    def other() -> None:
        try:
            if notices.first.wait(timing.bound(TIMEOUT_S, 5)):
                then()
        except BaseException as err:  # noqa: BLE001 - raised again by the test
            failed.append(err)

    helper = threading.Thread(target=other, daemon=True)
    helper.start()
    try:
        return call()
    finally:
        helper.join(timing.bound(TIMEOUT_S, 5))
        assert not failed, failed


def said(notices: Notices, rank: int, what: str) -> None:
    """Exactly one notice, naming ``what`` on ``rank``, with the world's timeout."""
    assert len(notices.lines) == 1, notices.lines
    line = notices.lines[0]
    assert line.startswith(f"rank {rank}: still in {what} after "), line
    assert line.endswith(f"(waits up to {TIMEOUT_S:g} s)"), line


def watched(ranks: ThreadRanks, rank: int) -> Any:
    """Rank ``rank``'s world, its main thread (this test's) watched."""
    world = ranks.world(rank)
    progress.watch(world, AFTER_S)
    return world


# -- the notice, once; none for a quick call --------------------------------------------------


def test_a_long_wait_says_what_it_waits_in_once(notices):
    ranks = ThreadRanks(2, timeout_s=TIMEOUT_S)
    world = watched(ranks, 0)
    other = ranks.world(1).default_group.ops
    waited(notices, lambda: collectives.all_reduce(np.ones(1), group=world.default_group),
           lambda: other.all_reduce(np.ones(1), None, False))
    said(notices, 0, "all_reduce() on the world group [0-1]")


def test_a_quick_call_says_nothing(notices):
    ranks = ThreadRanks(2, timeout_s=TIMEOUT_S)
    world = watched(ranks, 0)
    other = threading.Thread(target=ranks.world(1).default_group.ops.all_reduce,
                             args=(np.ones(1), None, False))
    other.start()
    collectives.all_reduce(np.ones(1), group=world.default_group)
    other.join()
    # the notice that must not come: waited for as long as it would take to come
    assert not notices.first.wait(2 * AFTER_S + 2 * progress.LOOK_EVERY_S)
    assert notices.lines == []


# -- each declared call, named in its notice ---------------------------------------------------


def _collective(name: str) -> Case:
    """Rank 0 makes collective ``name`` on the world group of 2; rank 1 joins it after the
    notice (root: rank 0; a send goes to rank 1, a recv comes from it)."""
    def case(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
        world, late = ranks.world(0), ranks.world(1)
        two = [np.zeros(1), np.zeros(1)]
        calls: dict[str, Callable[[Any], Any]] = {
            "all_reduce": lambda g: collectives.all_reduce(np.ones(1), group=g),
            "broadcast": lambda g: collectives.broadcast(np.ones(1), 0, group=g),
            "reduce": lambda g: collectives.reduce(np.ones(1), 0, group=g),
            "all_gather": lambda g: collectives.all_gather(
                [np.zeros(1), np.zeros(1)], np.ones(1), group=g),
            "all_gather_into_tensor": lambda g: collectives.all_gather_into_tensor(
                np.zeros(2), np.ones(1), group=g),
            "reduce_scatter_tensor": lambda g: collectives.reduce_scatter_tensor(
                np.zeros(1), np.ones(2), group=g),
            "all_to_all_single": lambda g: collectives.all_to_all_single(
                np.zeros(2), np.ones(2), group=g),
            "gather": lambda g: collectives.gather(
                np.ones(1), two if g.rank() == 0 else None, 0, group=g),
            "scatter": lambda g: collectives.scatter(
                np.zeros(1), two if g.rank() == 0 else None, 0, group=g),
            "barrier": lambda g: collectives.barrier(group=g),
        }
        if name in calls:
            def of(w: Any) -> Callable[[], Any]:
                return lambda: calls[name](w.default_group)

            return lambda: _as(world, of(world)), lambda: _as(late, of(late))
        if name == "send":
            return (lambda: _as(world, lambda: collectives.send(
                        np.ones(1), 1, group=world.default_group)),
                    lambda: _as(late, lambda: collectives.recv(
                        np.zeros(1), 0, group=late.default_group)))
        return (lambda: _as(world, lambda: collectives.recv(
                    np.zeros(1), 1, group=world.default_group)),
                lambda: _as(late, lambda: collectives.send(
                    np.ones(1), 0, group=late.default_group)))
    return case


def _as(world: Any, call: Callable[[], Any]) -> Any:
    with current(world):
        return call()


class StartingEngine(ThreadEngine):
    """The thread engine, started by init_process_group: rank 0's store is the thread
    ranks' store; it posts rank 0's join mark, as torch's engine does when it joins."""

    def __init__(self, ranks: ThreadRanks):
        super().__init__(TIMEOUT_S)
        self._store = ranks.store

    def start(self, backend: str, init_method: str, *, rank: int, world_size: int,
              timeout: Any, master: Any) -> Started:
        store = self._store.connection()
        store.set(keys.joined(rank), f"{os.getpid()} {knobs.hostname()}")
        return Started(world_group="world", store=store, engine=self)


def _init_process_group(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """Rank 0 waits in the host exchange for rank 1's join mark (the watcher is the one
    init_process_group starts)."""
    engine = StartingEngine(ranks)
    monkeypatch.setattr(backends, "engine_for", lambda name: engine)
    monkeypatch.setenv("TENSORPLAY_PROGRESS_S", str(AFTER_S))
    return (lambda: dist.init_process_group("gloo", "tcp://127.0.0.1:1", rank=0,
                                            world_size=2, timeout=TIMEOUT_S),
            lambda: ranks.store.connection().set(keys.joined(1),
                                                 f"{os.getpid()} {knobs.hostname()}"))


def _new_group(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """Rank 0 of 3 makes the group [0, 2]; it waits until rank 2 makes it too."""
    ranks.engine.meets = True
    return (lambda: _as(ranks.world(0), lambda: dist.new_group([0, 2])),
            lambda: _as(ranks.world(2), lambda: dist.new_group([0, 2])))


def _same_call(call: Callable[[], Any], late: int = 1) -> Case:
    """Rank 0 makes ``call``; rank ``late`` makes the same call after the notice."""
    def case(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
        return (lambda: _as(ranks.world(0), call), lambda: _as(ranks.world(late), call))
    return case


def _meshes(ranks: ThreadRanks, ranks_of_mesh: list[int], eager: bool = False
            ) -> list[DeviceMesh]:
    """Each rank's 1-d mesh "dp" over ``ranks_of_mesh``, its group made at first use
    (``eager``: the meshes made from it make theirs at once)."""
    spec = MeshSpec.from_ranks((len(ranks_of_mesh),), ranks_of_mesh, ("dp",))

    def one(world: Any) -> DeviceMesh:
        groups = make_groups(world, spec, ("gloo",), make=False)
        return DeviceMesh.of(MeshParts(world, "cpu", spec, spec, ("gloo",), groups, (None,),
                                       eager))
    return [one(ranks.world(r)) for r in range(ranks.n)]


def _view(method: Callable[[DeviceMesh], Any]) -> Case:
    """Rank 0 makes ``method`` of its mesh "dp" of 2, rank 1 of its own, after the notice."""
    def case(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
        mine, theirs = _meshes(ranks, [0, 1])
        return lambda: method(mine), lambda: method(theirs)
    return case


class NativeEngine(ThreadEngine):
    """The thread engine with mesh objects of its own (``NativeMeshes``): a tuple."""

    def to_native_mesh(self, view: Any, root: Any) -> Any:
        return ("engine mesh", view.names, root)

    def mesh_from_native(self, obj: Any) -> Any:
        return None


def _to_torch(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """Rank 0's mesh over [0, 2]: to_torch() makes its group, which waits for rank 2's."""
    mine, _, theirs = _meshes(ranks, [0, 2])
    return mine.to_torch, theirs.to_torch


def _unpickle(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """A mesh over [0, 2] that makes its views' groups at once, unpickled: its group is made
    as it is, by rank 0 and then by rank 2."""
    ranks.engine.meets = True
    blob = pickle.dumps(_meshes(ranks, [0, 2], eager=True)[0])
    return _same_call(lambda: pickle.loads(blob), late=2)(ranks, monkeypatch)


def _elastic(ranks: ThreadRanks, shape: tuple[int, int]) -> list[Any]:
    """Every rank's elastic mesh of ``shape`` ("dp", "tp"), elastic "dp"."""
    return ranks.run(lambda w: elastic_mesh.init(w, "cpu", shape, ("dp", "tp"),
                                                 ("gloo", "gloo"), False, (0, 1), given="dp"))


def _recover(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """Rank 0 recovers from a failure that names rank 1 and waits for it in the agreement
    on the lost ranks; rank 1 comes to the recovery too (so none is lost)."""
    mine, theirs = _elastic(ranks, (2, 1))
    err = RankFailedError("rank 1 failed", ranks=[1])
    return lambda: mine.recover(err), lambda: theirs.recover(err)


def _grow(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """(2, 2) with rank 3 lost: rank 2 is a spare and waits in grow() to be admitted; the
    members finish without it (it leaves with MembersFinished)."""
    meshes = _elastic(ranks, (2, 2))
    lost = {"epoch": 1, "shape": [1, 2], "ranks": [0, 1], "lost": [3], "spares": [2]}
    shrunk = ranks.run(lambda w: _shrunk(w, meshes[w.rank], lost))
    spare = shrunk[2]
    assert spare.get_coordinate() is None

    def finish() -> None:
        chain.finish(chain.board_of(ranks.world(0)), 1, (1, 2), [0, 1])

    def grow() -> None:
        with pytest.raises(MembersFinished):
            spare.grow()
    return grow, finish


def _shrunk(world: Any, mesh: Any, decision: dict[str, Any]) -> Any:
    try:
        return elastic_mesh.enter(world, mesh, mesh.parts.plan, decision, kind="shrink")
    except dist.StaleEpochError as told:  # the lost rank leaves
        return told


def _sync_replicas(ranks: ThreadRanks, monkeypatch: Any) -> tuple[Callable, Callable]:
    """(2, 1) grown back with rank 1 fresh: rank 0 sends it the state along "dp"."""
    meshes = _elastic(ranks, (2, 1))
    back = {"epoch": 1, "shape": [2, 1], "ranks": [0, 1], "fresh": [1]}
    mine, theirs = ranks.run(lambda w: elastic_mesh.enter(
        w, meshes[w.rank], meshes[w.rank].parts.plan, back, kind="grow"))
    state = np.zeros(1)
    return (lambda: _as(ranks.world(0), lambda: sync_replicas(mine, [np.ones(1)])),
            lambda: _as(ranks.world(1), lambda: sync_replicas(theirs, [state])))


# declared name -> (world size, watched rank, the case, what the notice says after the name)
Case = Callable[[ThreadRanks, Any], tuple[Callable, Callable]]  # -> (call, the others' part)
CASES: dict[str, tuple[int, int, Case, str]] = {
    **{f"{name}()": (2, 0, _collective(name), " on the world group [0-1]") for name in (
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
        "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "send", "recv",
        "barrier")},
    "init_process_group()": (2, 0, _init_process_group, ""),
    "new_group()": (3, 0, _new_group, ""),
    "destroy_process_group()": (2, 0, _same_call(dist.destroy_process_group), ""),
    "DeviceMesh()": (2, 0, _same_call(lambda: DeviceMesh("cpu", [0, 1])), ""),
    "init_device_mesh()": (2, 0, _same_call(lambda: init_device_mesh("cpu", (2,))), ""),
    "flatten()": (2, 0, _view(lambda m: m.flatten()), ""),
    "unflatten()": (2, 0, _view(lambda m: m.unflatten("dp", (2, 1), ("a", "b"))), ""),
    "reshape()": (2, 0, _view(lambda m: m.reshape((1, 2), ("a", "b"))), ""),
    "to_torch()": (3, 0, _to_torch, ""),
    "pickle.loads() of a DeviceMesh": (3, 0, _unpickle, ""),
    "recover()": (2, 0, _recover, ""),
    "grow()": (4, 2, _grow, ""),
    "sync_replicas()": (2, 0, _sync_replicas, " on the 'dp' group [0-1]"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_declared_call_is_named_in_its_notice(notices, monkeypatch, name):
    size, rank, case, where = CASES[name]
    ranks = ThreadRanks(size, timeout_s=TIMEOUT_S)
    if name == "to_torch()":
        ranks.engine = NativeEngine(TIMEOUT_S)
        ranks.engine.meets = True
    call, then = case(ranks, monkeypatch)
    if name != "init_process_group()":
        watched(ranks, rank)
    waited(notices, call, then)
    said(notices, rank, name + where)


# -- the registry: every call a user can wait in is declared -----------------------------------

# the public methods of a mesh that wait for no other rank: queries of the value and its
# world (the host map is read from the store, where init_process_group put it), slices
# (no group made), adoption of groups made elsewhere, the value's own dunders; a plain
# mesh's recover() and grow() raise at once (it is not elastic)
ANSWERS_AT_ONCE = {
    DeviceMesh: {
        "size", "get_rank", "get_coordinate", "get_local_rank", "shift", "get_group",
        "get_all_groups", "host_of", "describe", "plot", "__getitem__", "from_group",
        "from_torch", "of", "__eq__", "__hash__", "__repr__", "__reduce__", "__setattr__",
        "__delattr__", "__getattr__", "recover", "grow"},
    elastic_mesh.ElasticMesh: {"next_epoch"},  # called inside recover() and grow()
}


def _methods(cls: type) -> dict[str, Any]:
    """The public methods ``cls`` defines (dunders included), as the stack shows them."""
    found = {}
    for name, value in vars(cls).items():
        function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
        if isinstance(function, FunctionType) and not (
                name.startswith("_") and not name.startswith("__")):
            found[name] = function
    return found


@pytest.mark.parametrize("cls", [DeviceMesh, elastic_mesh.ElasticMesh])
def test_every_public_method_of_a_mesh_is_declared_or_answers_at_once(cls):
    methods, quick = _methods(cls), ANSWERS_AT_ONCE[cls]
    undeclared = sorted(n for n, f in methods.items()
                        if progress.declared(f) is None and n not in quick)
    assert not undeclared, f"declare them (@progress.entry) or list them: {undeclared}"
    both = sorted(n for n, f in methods.items() if progress.declared(f) is not None and n in quick)
    assert not both, both
    assert {n: progress.declared(f).name for n, f in methods.items()  # type: ignore[union-attr]
            if progress.declared(f) is not None} == (
        {"__init__": "DeviceMesh()", "flatten": "flatten()", "reshape": "reshape()",
         "unflatten": "unflatten()", "to_torch": "to_torch()"} if cls is DeviceMesh else
        {"recover": "recover()", "grow": "grow()"})


def test_every_collective_is_declared_with_its_group():
    public = {name: f for name, f in vars(collectives).items()
              if isinstance(f, FunctionType) and f.__module__ == collectives.__name__
              and not name.startswith("_")}
    assert len(public) == 12
    for name, function in public.items():
        assert progress.declared(function) == progress.Entry(f"{name}()", group="pg"), name


def test_the_lifecycle_and_the_mesh_module_declare_their_waits():
    waits = {lifecycle.init_process_group: "init_process_group()",
             lifecycle.destroy_process_group: "destroy_process_group()",
             lifecycle.new_group: "new_group()",
             device_mesh.init_device_mesh: "init_device_mesh()",
             sync_replicas: "sync_replicas()"}
    for function, name in waits.items():
        assert progress.declared(function).name == name  # type: ignore[union-attr]
    assert progress.declared(sync_replicas).group == "group"  # type: ignore[union-attr]
    for quick in (lifecycle.get_rank, lifecycle.get_world_size, lifecycle.is_initialized):
        assert progress.declared(quick) is None


def test_every_declared_call_has_its_notice_test():
    assert sorted(e.name for e in progress.entries()) == sorted(CASES)


def test_a_declaration_returns_the_function_itself_and_refuses_an_unknown_group(monkeypatch):
    monkeypatch.setattr(progress, "_ENTRIES", {})

    def wait_on(pg: Any) -> None:
        """A call of the test."""

    assert progress.entry("wait_on()", group="pg")(wait_on) is wait_on
    assert progress.declared(wait_on) == progress.Entry("wait_on()", "pg")
    with pytest.raises(ValueError, match=r"^progress.entry\('wait_on\(\)', group='group'\): "
                       r"wait_on\(\) has no local 'group'$"):
        progress.entry("wait_on()", group="group")(wait_on)
