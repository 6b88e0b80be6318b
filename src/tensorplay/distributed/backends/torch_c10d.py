"""The torch.distributed (c10d) engine: gloo on CPU, NCCL on GPU. With the other ``torch_*``
modules beside it (``torch_rendezvous.py``: where the ranks meet; ``torch_collectives.py``,
``torch_mesh.py``, ``torch_store.py``), the only place that imports torch.

``TorchEngine`` (the registry's) starts or adopts a world and keeps nothing of it; the world's
state (its c10d groups, their sockets and calls once an elastic mesh asked, its CUDA device,
the store its groups meet in) is its ``TorchWorld``, ``Started.engine``.

Groups are made with c10d's own group helper under a name we derive from the group's ranks,
backend and epoch, so a group's identity never depends on how many groups were made before it
(torch's new_group names hashed groups with a running count of all groups).

Private torch APIs we rely on (``PRIVATE_APIS``; ``probe()`` checks each one's signature and a
test runs it, so a torch upgrade fails in a second, naming the torch version, not deep in a
job):

- ``distributed_c10d._new_process_group_helper``: make a group under our name, on members
  only, keeping the given rank order;
- ``distributed_c10d._world.pg_group_ranks``: the group's global -> group rank map, which we
  write so torch's own calls agree with our (unsorted) rank order;
- ``distributed_c10d._get_default_store``: the world's store, under file:// init;
- ``distributed_c10d._world.pg_coalesce_state``: groups inside torch's coalescing manager,
  whose calls must go through torch's wrapper;
- ``TCPStore(master_listen_fd=...)``: serve the store on a socket we bound to MASTER_ADDR;
- ``torch._C._has_torch_function_unary``: whether a tensor overrides torch functions;
- ``ProcessGroup.allreduce([tensor], AllreduceOptions)``: the c10d call behind all_reduce.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from contextlib import suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..control import arrivals, keys
from ..errors import (
    BackendError,
    DistributedError,
    DistributedTimeoutError,
    LaunchEnvError,
    bad_argument,
)
from ..host import launchers, netif, wire
from . import torch_rendezvous, torch_store
from .protocol import (
    Capabilities,
    Engine,
    FailureKind,
    Joined,
    NativeMeshes,
    Running,
    Severable,
    Started,
    Store,
    StoreFailure,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

    from .torch_collectives import TorchGroupOps

log = logging.getLogger("tensorplay.distributed")


def start(
    backend: str,
    init_method: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    master: tuple[str, int] | None,
) -> Started:
    """Start c10d's default group on our store (or on torch's, for file://).

    A rendezvous that times out says which ranks never joined (each rank marks its arrival
    in the store first).
    """
    ENGINE.check_available(backend)
    if master is not None:
        step = f"init_process_group rendezvous at {master[0]}:{master[1]}"
        began = time.monotonic()
        try:
            store = torch_rendezvous.make_tcp_store(
                master[0], master[1], rank=rank, world_size=world_size, timeout=timeout
            )
        except DistributedError:
            raise  # rank 0 could not listen: already our words
        except (RuntimeError, dist.DistError) as err:
            raise _rendezvous_error(step, err, began, timeout, [0], "Rank 0 serves the "
                                    "store there: it has not started, has exited, or listens "
                                    "on another address or port.") from err
        store.set(keys.joined(rank), torch_rendezvous.joined_mark())
        torch_rendezvous.pick_interface(master[0])
        try:
            with torch_rendezvous.alone_if_restarted():
                dist.init_process_group(
                    backend, store=store, rank=rank, world_size=world_size, timeout=timeout
                )
        except (RuntimeError, dist.DistError) as err:
            raise _rendezvous_error(step, err, began, timeout,
                                    absent(store, range(world_size)), "") from err
    elif init_method.startswith("env://"):  # one rank given no address: nobody to meet
        store = dist.HashStore()
        store.set_timeout(timeout)
        store.set(keys.joined(rank), torch_rendezvous.joined_mark())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        store = c10d._get_default_store()
        store.set(keys.joined(rank), torch_rendezvous.joined_mark())
    # our groups meet in c10d's own store of the world (our keys are under their names)
    return Started(dist.group.WORLD, _ours(store),
                   TorchWorld(c10d._get_default_store(), adopted=False))


def _ours(store: dist.Store) -> Store:
    """c10d's store as the package's Store: it meets the protocol, but torch's stubs type
    set() as taking str only and lack clone() and multi_set(), which c10d's Store has."""
    return cast(Store, store)


def _rendezvous_error(step: str, err: BaseException, began: float, timeout: timedelta,
                      missing: list[int] | None, about: str) -> DistributedError:
    """The error of a rendezvous that failed: a timeout when the wait really expired, or when
    it lasted that long while some rank never joined (a peer that gave up waiting for that rank
    first makes the engine say "connection closed" here: the absent rank is still the cause);
    else what the engine said, after how long, and who had not joined."""
    elapsed = time.monotonic() - began
    said = _first_line(err)
    waited = elapsed >= 0.5 * timeout.total_seconds()
    if waited and (ENGINE.classify(err) == "timeout" or missing):
        who = None
        if missing == []:
            who = ("every rank reached the store, but the engine's own connections did not "
                   "complete (check that each host advertises an address the others reach)")
        return DistributedTimeoutError(step, timeout.total_seconds(), missing,
                                       f"{about} Engine said: {said}".strip(), who=who)
    never = f" Not joined: ranks {missing}." if missing else ""
    if "remote=[127." in said:
        about = (f"A rank advertised a loopback address to gloo, which ranks on other hosts "
                 f"cannot reach (GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}). "
                 f"{about}")
    return BackendError(f"{step} failed after {elapsed:.1f} s: {said}.{never} {about} Fix: "
                        f"start every rank with the same MASTER_ADDR and MASTER_PORT, and "
                        f"read the first error of the first rank that failed.".replace("  ", " "))


def absent(store: Any, ranks: Iterable[int]) -> list[int] | None:
    """Those of ``ranks`` that never posted their join mark; None if the store is gone."""
    ranks = list(ranks)
    try:
        return [ranks[i] for i in arrivals.unset(store, [keys.joined(r) for r in ranks])]
    except (RuntimeError, dist.DistError):  # rank 0, which serves the store, has left
        return None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


class TorchEngine:
    """The c10d engine as the registry gives it (``Engine``, ``NativeMeshes``): it starts or
    adopts a world, reads c10d's, gloo's and the store's exceptions, converts meshes, and
    keeps nothing of any world: each world's state is its ``TorchWorld``."""

    name = "torch"
    capabilities = Capabilities(simulated=False, has_store=True)
    start = staticmethod(start)

    def default_backend(self) -> str:
        """nccl when CUDA is usable, else gloo."""
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"

    def check_available(self, backend: str) -> None:
        """Raise BackendError when this torch build lacks ``backend``."""
        available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
        if not available.get(backend, False):
            raise BackendError(
                f"backend={backend!r} is not available in this torch build "
                f"(gloo: {available['gloo']}, nccl: {available['nccl']}). Fix: use "
                f"backend='gloo' on CPU, or install a CUDA build of torch for nccl."
            )

    def running(self) -> Running | None:
        """torch.distributed's world when someone else initialised it."""
        if not dist.is_initialized():
            return None
        return Running(dist.get_backend(), dist.get_rank(), dist.get_world_size())

    def adopt(self, timeout: timedelta) -> Started:
        """torch.distributed's world group, and its store under a fresh key prefix (where our
        groups meet too, apart from the owner's keys)."""
        store = dist.PrefixStore(keys.world_prefix(keys.next_world()),
                                 c10d._get_default_store())
        store.set(keys.joined(dist.get_rank()), torch_rendezvous.joined_mark())
        return Started(dist.group.WORLD, _ours(store), TorchWorld(store, adopted=True))

    def group_members(self, obj: object) -> tuple[list[int], str] | None:
        """(ranks in group order, backend) of a torch ProcessGroup made outside the package."""
        if not isinstance(obj, dist.ProcessGroup):
            return None
        return dist.get_process_group_ranks(obj), dist.get_backend(obj)

    def classify(self, err: BaseException) -> FailureKind | None:
        """What a c10d, gloo or store exception means; the one place that reads their text."""
        if not isinstance(err, RuntimeError | OSError):
            return None
        lowered = str(err).lower()
        if isinstance(err, dist.DistStoreError) or "timed out" in lowered or "timeout" in lowered:
            return "timeout"
        if isinstance(err, dist.DistNetworkError | ConnectionError) or any(
                s in lowered for s in ("connection", "closed", "reset by peer", "broken pipe")):
            return "peer_lost"
        return "other"

    def store_failure(self, err: BaseException) -> StoreFailure | None:
        """What a TCPStore call's exception means (``torch_store.failure``: "gone",
        "timeout", or None for a bug)."""
        return torch_store.failure(err)

    def store_reachable(self) -> bool:
        """Whether the job's store, at the launcher's MASTER_ADDR:MASTER_PORT, accepts a
        connection (True where no launcher says where it is: nothing to probe); under
        ``tensorplay-run --store etcd``, whether one of its members has a leader."""
        cluster = wire.etcd_store()
        if cluster is not None:
            from . import etcd

            return any(etcd.health(e, 1.0) is None for e in cluster[0])
        launch = launchers.detect()
        if launch is None or not launch.master_addr or not launch.master_port:
            return True
        return not netif.refuses(launch.master_addr, launch.master_port)

    def backend_for_device(self, device_type: str, world_backend: str) -> str:
        """gloo for a 'cpu' mesh on an nccl world (NCCL moves CUDA tensors only)."""
        return "gloo" if device_type == "cpu" and world_backend == "nccl" else world_backend

    def rank_array(self, array: Any) -> torch.Tensor:
        """The rank array as an int64 tensor sharing its memory."""
        return torch.from_numpy(array)

    def to_native_mesh(self, view: Any, root: Any) -> Any:
        """torch's DeviceMesh over the view's c10d groups (``torch_mesh.py``)."""
        from .torch_mesh import to_native

        return to_native(view, root)

    def mesh_from_native(self, obj: object) -> Any:
        """torch's DeviceMesh ``obj`` described for adoption (``torch_mesh.py``)."""
        from .torch_mesh import from_native

        return from_native(obj)


class TorchWorld(TorchEngine):
    """The c10d engine as one world runs it (``Joined``, ``Severable``; ``Started.engine``):
    the groups it made there, their sockets and calls once an elastic mesh asked
    (``prepare_elastic``), the CUDA device of its meshes, and the store its groups meet in.

    In a world of 8 gloo ranks with a (2, 4) elastic mesh, rank 5's holds its two mesh groups'
    c10d objects (``_made``; the world group is c10d's own), the sockets each opened as it was
    made (to 3 peers in "tp" [4, 5, 6, 7], to 1 in "dp" [1, 5]) and their calls (``_ops``,
    refused after a sever). A second world of the process gets a new one, with none of these.
    """

    def __init__(self, group_store: Any, adopted: bool) -> None:
        self._group_store = group_store  # where our groups meet
        self._adopted = adopted  # started outside the package: its owner tears it down
        self._cuda_device: int | None = None  # chosen by the world's first 'cuda' mesh
        self._made: list[Any] = []  # the c10d groups we made in this world
        # id(group) -> its (fd, inode); None until prepare_elastic: only an elastic world's
        # groups are severed, so only they are noted
        self._sockets: dict[int, set[tuple[int, str]]] | None = None
        self._ops: dict[int, TorchGroupOps] = {}  # elastic worlds: id(engine group) -> its calls

    def new_group(
        self, name: str, ranks: Any, backend: str, timeout: timedelta, desc: str, *,
        apart: bool = False
    ) -> Any:
        """Create a c10d group named ``name`` of ``ranks`` (in this order); members only.

        ``apart``: the members meet over a clone of the store (a TCP connection of its own,
        kept by the group, about 1 ms to open), for a group made on a helper thread that may
        be given up while it waits (``World._make``). A TCPStore client serves one request at
        a time, and gloo's rendezvous waits in the store for each peer's address, up to the
        group's timeout: on the shared connection every store call of this process queues
        behind that wait. Seen: rank 6's replacement SIGKILLed as a grown epoch's groups were
        made; every rank gave its group up within 0.2 s, then sat in its first store call of
        the recovery (a read of the failure marks, the vote's post) until gloo's 30 s wait
        (ENTER_S) for an address that never came ran out; the first ones freed declared ranks
        3 and 7, still waiting, lost, and the job ended below its minimum."""
        self.check_available(backend)
        ranks = ranks.tolist()
        store = self._group_store.clone() if apart else self._group_store
        noted = self._sockets  # None outside an elastic world
        before = _sockets() if noted is not None else set()  # after the clone: a sever()
        group, _ = c10d._new_process_group_helper(  # breaks gloo's pairs, not the store
            len(ranks),
            ranks.index(dist.get_rank()),
            ranks,
            backend,
            store,
            cast("GroupName", name),  # torch's NewType of str, for its group names
            timeout=timeout,
            group_desc=desc,
        )
        c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
        self._made.append(group)
        if noted is not None:
            noted[id(group)] = _sockets() - before
        return group

    def ops(self, engine_group: Any, group: Any, failed: Any) -> Any:
        """The collectives of ``group`` on c10d group ``engine_group``."""
        from .torch_collectives import TorchGroupOps

        ops = TorchGroupOps(engine_group, group.backend, group.size(), failed,
                            breakable=self._sockets is not None)
        if self._sockets is not None:  # an elastic world: sever() may refuse its calls
            self._ops[id(engine_group)] = ops
        return ops

    def use_device(self, device_type: str) -> None:
        """For a 'cuda' mesh: keep the current CUDA device, else take LOCAL_RANK's; never
        guess. Chosen once per world (this one), and logged."""
        if device_type != "cuda" or self._cuda_device is not None:
            return
        if not torch.cuda.is_available():
            raise bad_argument("device_type", "cuda", "CUDA is not available in this process",
                               "use device_type='cpu', or run where torch.cuda.is_available()")
        if torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()
            log.info("cuda mesh: keeping the current device cuda:%d", self._cuda_device)
            return
        local = launchers.local_rank_from_env()
        if local is None:
            raise LaunchEnvError(
                "init_device_mesh('cuda'): no current CUDA device and LOCAL_RANK is not set, "
                "so the device for this rank is unknown. Fix: launch with tensorplay-run or "
                "torchrun (they set LOCAL_RANK), or call torch.cuda.set_device(i) first."
            )
        self._cuda_device = local % torch.cuda.device_count()
        torch.cuda.set_device(self._cuda_device)
        log.info("cuda mesh: set device cuda:%d from LOCAL_RANK=%d", self._cuda_device, local)

    def prepare_elastic(self) -> None:
        """Groups made from now on can be severed: their sockets are noted as they are made
        (a /proc/self/fd listing before and after, which other worlds skip), and NCCL groups
        use non-blocking communicators, so that aborting one ends a peer's wait instead of
        blocking in NCCL (a user's setting wins; untested here: no GPU)."""
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
        if self._sockets is None:
            self._sockets = {}

    def set_timeout(self, engine_group: Any, timeout: timedelta) -> None:
        """torch's own per-group setter (gloo and NCCL backends)."""
        c10d._set_pg_timeout(timeout, engine_group)

    def sever(self, engine_group: Any) -> None:
        """Shut down the sockets the group opened as it was made (gloo connects every pair
        then; ``_sockets``): a call blocked in it, here or at a peer, reads end of stream and
        fails at once instead of waiting out its timeout. NCCL: abort the communicators where
        torch offers it (untested here: no GPU). Only after a failure: a socket a faster peer
        opened for a later group can be counted as this group's (1 run in 2 of a test that
        opens epochs back to back broke so), harmless only while no later group exists.
        Then every call on the group fails at once (``TorchGroupOps.refuse``): gloo can miss
        this side's own shutdown for a call posted after it (seen: a rank that reached its
        ring all_reduce late waited for the peer that had not broken its side)."""
        for fd, inode in list((self._sockets or {}).get(id(engine_group), ())):
            _shut(fd, inode)
        ops = self._ops.get(id(engine_group))
        if ops is not None:  # a call made from now on fails at once, as a peer's loss does
            ops.refuse("this rank broke its connections of the group: a recovery began")
        if dist.get_backend(engine_group) == "nccl" and callable(getattr(engine_group, "abort",
                                                                          None)):
            engine_group.abort()

    def close_group(self, engine_group: Any) -> None:
        """Destroy one c10d group (torch forgets it; its threads and sockets go with its last
        reference, which the world drops on a daemon thread: gloo's teardown can block for
        ever joining its event loop after a peer was SIGKILLed)."""
        if self._sockets is not None:
            self._sockets.pop(id(engine_group), None)
        self._ops.pop(id(engine_group), None)
        if engine_group in self._made:
            self._made.remove(engine_group)
        if engine_group in c10d._world.pg_map:
            dist.destroy_process_group(engine_group)

    def destroy(self) -> None:
        """Tear c10d down: every group, or in an adopted world only the groups we made (its
        owner tears the world down)."""
        made, self._made, self._group_store = self._made, [], None
        torch_rendezvous.forget_interface()  # this world's choice: a later one chooses anew
        if not dist.is_initialized():
            return
        if not self._adopted:
            dist.destroy_process_group()
            return
        for group in made:
            dist.destroy_process_group(group)


def _sockets() -> set[tuple[int, str]]:
    """(fd, "socket:[inode]") of every socket this process holds open (Linux; else none)."""
    found = set()
    with suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    found.add((int(name), target))
    return found


def _shut(fd: int, inode: str) -> None:
    """Shut connected socket ``fd`` down both ways if it is still the socket ``inode`` (an
    fd number is reused once closed): its peer reads end of stream at once; gloo on this side
    sees the same as when a peer dies. The fd stays open."""
    with suppress(OSError):
        if os.readlink(f"/proc/self/fd/{fd}") != inode:
            return
        dup = socket.socket(fileno=os.dup(fd))
        with suppress(OSError):  # a listening socket is left alone: gloo aborts the process
            if not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # when its
                dup.shutdown(socket.SHUT_RDWR)  # accept fails
        dup.close()


ENGINE = TorchEngine()
JOINED = TorchWorld  # the class of Started.engine
_CLAIMS: tuple[Engine, NativeMeshes] = (ENGINE,) * 2  # mypy: the core and 1 capability
if TYPE_CHECKING:  # mypy: a world's engine meets the core per world and 2 capabilities
    _WORLD_CLAIMS: tuple[type[Joined], type[NativeMeshes], type[Severable]] = (JOINED,) * 3


def probe() -> list[str]:
    """Problems with the private torch APIs we use (empty when all is as we rely on).

    Each entry names the API, what we expected and the torch version, so a torch upgrade that
    breaks one fails here, in a second, and not in the middle of a job.
    """
    import inspect

    problems: list[str] = []

    def expect(ok: bool, api: str, wanted: str) -> None:
        if not ok:
            problems.append(f"torch {torch.__version__}: {api} is not {wanted}")

    helper = getattr(c10d, "_new_process_group_helper", None)
    params = list(inspect.signature(helper).parameters) if callable(helper) else []
    expect(params[:6] == ["group_size", "group_rank", "global_ranks_in_group", "backend",
                          "store", "group_name"] and {"timeout", "group_desc"} <= set(params),
           "distributed_c10d._new_process_group_helper",
           "(group_size, group_rank, global_ranks_in_group, backend, store, group_name, "
           "timeout=, group_desc=)")
    world = getattr(c10d, "_world", None)
    expect(isinstance(getattr(world, "pg_group_ranks", None), dict),
           "distributed_c10d._world.pg_group_ranks", "a dict")
    expect(isinstance(getattr(world, "pg_coalesce_state", None), dict),
           "distributed_c10d._world.pg_coalesce_state", "a dict")
    expect(callable(getattr(c10d, "_get_default_store", None)),
           "distributed_c10d._get_default_store", "a function")
    expect("master_listen_fd" in (dist.TCPStore.__init__.__doc__ or ""),
           "TCPStore(master_listen_fd=...)", "an accepted keyword")
    expect(callable(getattr(torch._C, "_has_torch_function_unary", None)),
           "torch._C._has_torch_function_unary", "a function")
    expect(callable(getattr(dist.ProcessGroup, "allreduce", None))
           and hasattr(dist, "AllreduceOptions"),
           "ProcessGroup.allreduce with AllreduceOptions", "available")
    return problems
