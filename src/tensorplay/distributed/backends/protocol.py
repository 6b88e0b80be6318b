"""The interface an engine meets, and the store it may offer: the seam below the package.

An engine moves the bytes: torch's c10d (gloo, nccl), MPI through mpi4py, and the
in-process "fake" world. Everything above ``backends/`` reaches an engine only through the
``Engine`` and ``GroupOps`` methods below, found by backend name in the registry
(``backends/__init__.py``); no module above the engines imports one or tests for its name.

The core comes in two parts, by how long each lives:

- ``Engine``, the registry's object, one per process, which keeps nothing of any world:
  ``start()`` joins the job's world (``running()``/``adopt()``: a world someone else
  started, joined as it is) and returns ``Started``: the engine's world group, its store, and
  the engine as that world runs it; ``classify()`` says what one of the engine's exceptions
  means (a timeout, a lost peer; ``job/failures.py`` words our errors from it, alike for every
  engine); ``store_failure()`` says whether a store call's exception means the store is gone
  (or a wait on it ran out), ``store_reachable()`` whether the store answers now; and the
  lookups that need no world: ``default_backend``, ``check_available``,
  ``group_members``, ``backend_for_device``, ``rank_array``;
- ``Joined``, ``Started.engine`` (what ``World.engine`` holds): an ``Engine`` that also holds
  one world's state (its groups, its sockets, its device, its bound), made by ``start`` and
  dropped after ``destroy``: ``new_group()`` makes the group of some ranks, in the given
  order, on its members only (``ProcessGroup`` wraps it); ``ops()`` binds the collectives to
  one such group; ``use_device()`` picks this world's device; ``destroy()`` leaves the world.
  A second world of the same process gets a new one, so nothing of the first leaks into it.

What only some engines can do is an optional capability: a ``runtime_checkable`` Protocol of
its own that the package finds with ``isinstance(engine, Capability)``. An engine without one
does not define its methods (no stub raises); the caller that needs it raises our error
(``BackendError``, ``ArgumentError``), naming the engine:

- ``NativeMeshes``: a mesh object of the engine's own (torch's DeviceMesh, which DTensor,
  tensor parallelism and FSDP2 take): ``to_native_mesh()`` builds one over a ``MeshView``
  of our mesh, on our groups; ``mesh_from_native()`` describes one of its own as a
  ``NativeMesh`` for ``DeviceMesh.from_torch()`` to adopt. Only the torch engine.
- ``Severable`` (a ``Joined``'s): what an elastic recovery needs of the engine:
  ``prepare_elastic()``, ``sever()`` (break a group's connections from any thread),
  ``close_group()`` and ``set_timeout()`` (a group made within a bound gets the world's
  timeout back). Only the torch engine; without it a world makes no elastic mesh, and an
  epoch's groups are retired without engine calls.
- ``GathersText`` (a ``Joined``'s): ``allgather_text()``, an all-gather of short texts over
  the whole world on a communicator user code never sees: what a world without a store runs
  its control plane on (``control/gather.py``'s ``GatherControl``), and ``tell_ended()``,
  which tells the members of this rank's groups its final call counts as it ends, so that a
  member stuck in a stray call names it at once. Only the MPI engine.

``Capabilities`` (data, not methods) say what an engine's world is like, so the package asks
"does it have a store?", never "is it torch?". The MPI engine (no store, numpy buffers) meets
the same core: ``start`` is MPI's init, ``new_group`` one ``Create_group`` per group, ``ops``
calls the communicator's collectives. What the ranks decide together goes through the
world's control plane (``control/``): over the store where the engine has one, else over the
engine's ``allgather_text`` (``GathersText``), bounded by the world's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..geometry.spec import Ranks
    from ..process_group import ProcessGroup, ReduceOp, Work


class Store(Protocol):
    """The key-value verbs the package uses (torch's c10d Store meets it as it is: TCPStore
    and PrefixStore have every one, ``timeout`` a property, since torch 2.8 ``clone`` too).

    Values are str or bytes when set and bytes when read; every wait is bounded by
    ``timeout``, which ``set_timeout`` changes for this connection (a ``Board``'s
    ``briefly()``: 2 s instead of the world's 300 s while a failing rank posts its marks).
    A call that fails for the store's own reason raises the engine's error, which
    ``Engine.store_failure`` judges; the control plane raises ``StoreGone`` or
    ``StoreTimedOut`` in its place (``control/store.JobStore``).
    """

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...  # waits until the key is set
    def check(self, keys: list[str]) -> bool: ...  # whether every key is set, without waiting
    def multi_get(self, keys: list[str]) -> list[bytes]: ...  # waits until all are set
    def multi_set(self, keys: list[str], values: list[str]) -> None: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def clone(self) -> Store: ...  # its own connection, for a watcher thread

    @property
    def timeout(self) -> timedelta: ...  # the bound of every wait of this connection

    def set_timeout(self, timeout: timedelta) -> None: ...


StoreFailure = Literal["gone", "timeout"]  # what ``Engine.store_failure`` says of an error


class StoreFailed(RuntimeError):
    """A call of the job's store failed for the store's own reason; the engine's error, as
    its engine judged it (``Engine.store_failure``), is the cause.

    The control plane's store (``control/store.JobStore``) raises it in place of the
    engine's exception, so every caller above the engines catches this class: none guesses
    from the engine's types or words (``except (RuntimeError, OSError)`` would also take a
    bug for the store's death). Any other error of a store call comes through as it is. A
    RuntimeError, as the engines' store errors are (torch's DistError).
    """


class StoreGone(StoreFailed):
    """The store's server cannot be reached: it closed (rank 0 ended, for env:// and tcp://;
    the launcher of node 0, under tensorplay-run and torchrun) or its machine is cut off.
    torch: DistNetworkError "Broken pipe" on a ``set`` once rank 0 has exited."""


class StoreTimedOut(StoreFailed):
    """A wait on the store ran out: a key was not set within the connection's ``timeout``
    (torch: DistStoreError "wait timeout after 1000ms, keys: /nokey")."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do; the package decides by these, never by the engine's name.

    simulated: the world exists only in this process (any rank of any size); nothing moves.
    has_store: a job-wide key-value store serves the cross-rank check, host map, call counts
        and barrier arrival marks (and the store needs a rendezvous address); without one a
        real (not simulated) world does them with ``GathersText.allgather_text``.
    """

    simulated: bool
    has_store: bool


@dataclass(frozen=True)
class Started:
    """What ``Engine.start`` and ``adopt`` return: the engine's group of the whole world, its
    store (None without one), and ``engine``, the engine as this world runs it (``Joined``),
    which keeps this world's state so that the registry's engine keeps none. ``rank`` and
    ``size``, on a process the engine started into a running job (a replacement, ``Shrinks``):
    its job rank and the job's size, in place of what its launcher's variables say."""

    world_group: Any
    store: Store | None
    engine: Joined
    rank: int | None = None
    size: int | None = None


@dataclass(frozen=True)
class Running:
    """A world the engine runs already, started outside the package."""

    backend: str
    rank: int
    world_size: int


FailureKind = Literal["timeout", "peer_lost", "other"]


@dataclass(frozen=True)
class MeshView:
    """One of our meshes as an engine needs it to build its own mesh object over it.

    A root (a mesh not sliced or flattened from another) gives its rank array; any other mesh
    gives, per dim, the root dims it runs along. On the (2, 2, 2) root ("dp", "cp", "tp"),
    ``root["dp", "cp"].flatten()`` runs along root dims (0, 1) and ``root["tp"]`` along (2,).

    groups: the engine group of each dim through this rank, () when the mesh lacks this rank.
    flatten_of: for a flattened 1-d mesh whose name the root answers to (``root["dp_cp"]``),
        that name; the engine's root then knows it too.
    """

    device_type: str
    names: tuple[str, ...] | None
    groups: tuple[Any, ...]
    ranks: Any = None  # a root's rank array (numpy int64, of the mesh's shape)
    root_dims: tuple[tuple[int, ...], ...] | None = None  # a non-root's dims in root dims
    flatten_of: str | None = None


@dataclass(frozen=True)
class NativeMesh:
    """An engine's own mesh object described for adoption (``DeviceMesh.from_torch``).

    obj: the engine's mesh object itself. ranks: its rank array (nested lists); None when
        this rank cannot see it (a slice that lacks this rank). groups: the engine group of
        each dim through this rank, () when the mesh lacks it. root: set when the mesh is a
        slice of a root by the root's dim names, which then names the dims to slice
        (``names``).
    """

    obj: Any
    device_type: str
    ranks: Any
    names: tuple[str, ...] | None
    groups: tuple[Any, ...]
    root: NativeMesh | None = None


class GroupOps(Protocol):
    """The collectives bound to one engine group, run on a member of it.

    Tensors are the engine's buffers (torch tensors and numpy arrays for torch's c10d).
    ``src``/``dst`` are global ranks already checked to be members; ``op`` is our ReduceOp (or
    the engine's own). Each returns a Work when ``async_op`` is set, else None once done.
    ``what`` names the call in errors. The engine checks its buffers (type, device, dtype,
    size) and raises our ArgumentError for bad ones.
    """

    def all_reduce(self, tensor: Any, op: ReduceOp, async_op: bool) -> Work | None: ...
    def broadcast(self, tensor: Any, src: int, async_op: bool) -> Work | None: ...
    def reduce(self, tensor: Any, dst: int, op: ReduceOp, async_op: bool) -> Work | None: ...
    def all_gather(self, tensor_list: list, tensor: Any, async_op: bool) -> Work | None: ...
    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool) -> Work | None: ...
    def reduce_scatter_tensor(
        self, output: Any, input: Any, op: ReduceOp, async_op: bool
    ) -> Work | None: ...
    def all_to_all_single(
        self, output: Any, input: Any, output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None, async_op: bool,
    ) -> Work | None: ...
    def gather(self, tensor: Any, gather_list: list | None, dst: int, async_op: bool
               ) -> Work | None: ...
    def scatter(self, tensor: Any, scatter_list: list | None, src: int, async_op: bool
                ) -> Work | None: ...
    def send(self, tensor: Any, dst: int) -> None: ...
    def recv(self, tensor: Any, src: int) -> None: ...
    def barrier(self, async_op: bool) -> Work | None: ...


class Engine(Protocol):
    """The core every engine meets, as the registry gives it (one per process, holding nothing
    of any world): how a world starts, how the engine fails, and the lookups that need no
    world. What only some engines can do is a capability below (``NativeMeshes``)."""

    name: str  # "torch", "fake", ...: for messages and the registry only
    capabilities: Capabilities

    def default_backend(self) -> str:
        """The backend to use when the user names none (nccl with CUDA, else gloo)."""
        ...

    def check_available(self, backend: str) -> None:
        """Raise BackendError when this installation cannot run ``backend``."""
        ...

    def start(
        self,
        backend: str,
        init_method: str,
        *,
        rank: int,
        world_size: int,
        timeout: timedelta,
        master: tuple[str, int] | None,
    ) -> Started:
        """Join the world; post this rank's join mark (``control/keys.py``'s ``JOINED``) in the
        store. ``timeout`` is the world's (``World.timeout``, its one owner): the bound of
        every wait of the engine in this world, given to its ``Joined`` and to each group."""
        ...

    def running(self) -> Running | None:
        """The engine's world if someone else started it (``torch.distributed`` initialised
        by Lightning, say); None otherwise. Changes nothing."""
        ...

    def adopt(self, timeout: timedelta) -> Started:
        """Join the running world as it is: its world group, and its store under a fresh
        key prefix; post this rank's join mark there, as ``start`` does. ``timeout`` bounds
        the engine's own waits in this world (its ``Joined`` is given it)."""
        ...

    def group_members(self, obj: object) -> tuple[list[int], str] | None:
        """(global ranks in group order, backend) of one of the engine's own group objects
        made outside the package (to adopt it); None when ``obj`` is not one."""
        ...

    def classify(self, err: BaseException) -> FailureKind | None:
        """What the engine's exception ``err`` means; None when it is not the engine's."""
        ...

    def store_failure(self, err: BaseException) -> StoreFailure | None:
        """What ``err``, raised by a call of the store ``start`` gave, means: "gone" (its
        server cannot be reached), "timeout" (a wait ran out), or None: no failure of the
        store's own (a bug, raised as it is). The one judge of "the store is gone"; None on
        an engine without a store."""
        ...

    def store_reachable(self) -> bool:
        """Whether the job's store accepts a connection now, asked before posting to a store
        that may have gone (a failed post makes torch's client log a C++ stack trace, which
        an expected failure must not show). False on an engine without a store."""
        ...

    def backend_for_device(self, device_type: str, world_backend: str) -> str:
        """The default backend of a mesh of ``device_type`` in a world on ``world_backend``
        (torch: gloo for a 'cpu' mesh on an nccl world, since NCCL moves CUDA tensors only)."""
        ...

    def rank_array(self, array: Any) -> Any:
        """A mesh's rank array (numpy int64) as the engine's users expect it (torch: a
        tensor)."""
        ...


class Joined(Engine, Protocol):
    """The engine as one world runs it (``Started.engine``, ``World.engine``): the registry's
    ``Engine`` with this world's state (its groups, its device, its bound), so two worlds of one
    process share nothing. What only some engines can do in a world is a capability below
    (``Severable``, ``GathersText``)."""

    def new_group(
        self, name: str, ranks: Ranks, backend: str, timeout: timedelta, desc: str, *,
        apart: bool = False
    ) -> Any:
        """The engine group of ``ranks`` in this order, called on members only (a simulated
        engine must not list them: a group may hold a million ranks). ``apart``: its members
        meet over a store connection of their own, not the one the rest of the process uses
        (a group made on a helper thread that may be given up while it waits, ``World._make``);
        an engine whose groups meet without a store ignores it."""
        ...

    def ops(
        self, engine_group: Any, group: ProcessGroup,
        failed: Callable[[BaseException, str], Exception],
    ) -> GroupOps:
        """The collectives of ``group`` (whose engine group is ``engine_group``) on a member.

        ``failed(err, what)`` gives the error to raise for the engine's exception ``err`` in
        collective ``what`` (worded by ``job/failures.py``).
        """
        ...

    def use_device(self, device_type: str) -> None:
        """Pick this process's device for a mesh of ``device_type``, once per world (torch:
        keep the current CUDA device, else LOCAL_RANK's); raise when it cannot be known."""
        ...

    def destroy(self) -> None:
        """Leave the world: every engine group we made stops working; the world itself is
        torn down only when we started it (``start``, not ``adopt``)."""
        ...


@runtime_checkable
class NativeMeshes(Protocol):
    """Capability: the engine has a mesh object of its own (torch's DeviceMesh) and converts
    our meshes to it and back. ``DeviceMesh.to_torch()``/``from_torch()`` raise BackendError,
    naming the engine, on an engine without it."""

    def to_native_mesh(self, view: MeshView, root: Any) -> Any:
        """The engine's own mesh object over ``view``'s groups, creating no group; ``root`` is
        the engine's mesh of the view's root (None when the view is a root). Raise BackendError
        when the installed version of the engine lacks what that needs."""
        ...

    def mesh_from_native(self, obj: object) -> NativeMesh | None:
        """``obj``, one of the engine's own mesh objects, described for adoption; None when
        ``obj`` is not one."""
        ...


@runtime_checkable
class Severable(Protocol):
    """Capability: the engine's groups can be broken and torn down one by one, which an
    elastic recovery needs. ``init_device_mesh(elastic=...)`` refuses an engine without it
    (ArgumentError naming the engine); ``World.close_epoch`` then only retires the groups."""

    def prepare_elastic(self) -> None:
        """An elastic mesh is being made: set up the groups made from now on so that a
        recovery can break them (torch: NCCL's non-blocking communicators)."""
        ...

    def sever(self, engine_group: Any) -> None:
        """Break one engine group's connections now, from any thread: this rank's call
        blocked in it fails at once, as do its peers' (an elastic recovery began elsewhere).
        The group is not torn down; ``close_group`` does that later. A group broken already
        (a peer died; severed before) breaks again without an error: an error it raises is
        a bug, and the caller raises it (``GroupRegistry.sever``, ``retire``). Never called
        on a group after its ``close_group`` (the registry orders the two)."""
        ...

    def close_group(self, engine_group: Any) -> None:
        """Tear one engine group down (an elastic mesh left its epoch): the engine forgets it;
        its resources go with its last reference. Never waits on a peer; a broken group
        closes without an error (one it raises is a bug, raised by the caller)."""
        ...

    def set_timeout(self, engine_group: Any, timeout: timedelta) -> None:
        """How long one engine group's calls wait from now on: a grown epoch's groups are
        made within a short bound (a rank that died on its way in costs seconds, not the
        world's timeout), then given the world's timeout for their collectives."""
        ...


@runtime_checkable
class GathersText(Protocol):
    """Capability: an all-gather of short texts over the whole world, on a communicator user
    code never sees; a world without a store runs its control plane on it (``GatherControl``).
    A world with neither has none to run (``world.control_for`` refuses it)."""

    def allgather_text(self, text: str, step: str) -> list[str]:
        """Every rank's ``text``, in world rank order, on every rank (called in step by every
        rank; ``step`` names the call in errors). Waits up to the world's timeout."""
        ...

    def tell_ended(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """This rank made its last collective: ``counts`` maps each of its groups' names to
        (the group's world ranks, this rank's calls on it). Tell the other members now,
        without waiting for them: a member blocked in a call on that group whose number is
        higher knows it is a stray call that nobody will pair, and says so at once."""
        ...


@runtime_checkable
class Shrinks(Protocol):
    """Capability: the engine's own fault tolerance shrinks a world in place and grows it back
    (MPI under Open MPI's ULFM): the survivors of a loss agree on who is left by the engine's
    agreement, with no store, and the engine starts the replacements itself. Ranks keep the
    numbers they had at the start (a job rank), whatever their place in the engine's shrunk
    communicators. An elastic mesh on such an engine uses these calls in place of a Board
    (``elastic/shrinking.py``); all but ``shrink_refused`` and ``spawned_note`` are collective
    over the ranks present.

    8 ranks, rank 5 SIGKILLed: ``shrink()`` on each of the 7 others returns [5] and leaves a
    world of 7 ranks numbered 0-4, 6, 7; ``spawn([5], note)`` starts one process, which is
    rank 5 again, and hands it ``note``."""

    def shrink_refused(self) -> tuple[str, str] | None:
        """(why this world cannot shrink: an MPI without working fault tolerance, or one
        started without it, naming the library and the flag it needs; the fix), or None."""
        ...

    def present(self) -> list[int]:
        """The job ranks of the processes in this world now, ascending."""
        ...

    def shrink(self, step: str) -> list[int]:
        """Break every communicator of this world (a rank blocked in one fails at once, as
        on a revoke), agree with the other survivors on who is left and continue on them;
        the lost job ranks, the same on every survivor."""
        ...

    def poll(self, flag: int, step: str) -> int | None:
        """One reduction of ``flag`` over the ranks present: the largest flag, or None when a
        rank present left the job (its script ended) while this one waited."""
        ...

    def spawn(self, ranks: Sequence[int], note: str, step: str) -> None:
        """Start one process per job rank in ``ranks`` (this script again, its arguments and
        working directory), merged into this world as those ranks; each reads ``note``
        (``spawned_note``)."""
        ...

    def spawned_note(self) -> str | None:
        """On a process ``spawn`` started: the note its spawners sent; else None."""
        ...

    def part(self, ranks: Sequence[int], step: str) -> None:
        """Split the ranks present in two, ``ranks`` and the others, each going on alone with
        its own control plane: at the members' end, the spares that leave take no part in
        the members' last checks (collective over the ranks present)."""
        ...
