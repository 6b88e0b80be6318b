"""Our ProcessGroup, Work and ReduceOp, and the World that owns every group of one job.

A ProcessGroup knows its global ranks in group order, this process's rank in it, its backend
and the engine's own group object (hand ``group.engine_group`` to torch's DDP or FSDP).
The World keeps one registry of groups keyed by (ordered ranks, backend), so a rank set is
made into a group once per backend and every later mesh that needs it reuses it.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import Any

from ._layout import Layout
from ._mesh_spec import Ranks
from .errors import NotAMemberError, NotInitializedError, format_ranks


class ReduceOp(enum.Enum):
    """How a reduction combines values."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


class Work:
    """Handle of an async collective: wait() blocks until done, then runs any finishing step."""

    def __init__(self, engine_work: Any = None, finish: Callable[[], None] | None = None):
        self._engine_work = engine_work
        self._finish = finish
        self._done = engine_work is None and finish is None

    def wait(self) -> bool:
        """Block until the collective has finished and its result is in place."""
        if not self._done:
            if self._engine_work is not None:
                self._engine_work.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once wait() has returned (or the collective needed no waiting)."""
        return self._done


class ProcessGroup:
    """A set of global ranks in a fixed order, bound to one engine group on its members."""

    def __init__(
        self,
        ranks: Ranks,
        global_rank: int,
        backend: str,
        name: str,
        engine_group: Any = None,
    ):
        self._ranks = ranks
        self._backend = backend
        self._name = name
        self._engine_group = engine_group
        self._released = False
        self.barriers = 0  # blocking barriers run so far (names their store keys)
        found = ranks.index(global_rank)
        self._rank = -1 if found is None else found
        self._global_rank = global_rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self._ranks)

    def rank(self) -> int:
        """This process's rank in the group; -1 when it is not a member."""
        return self._rank

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the members, in group order (group rank i is ranks[i])."""
        return self._ranks.tolist()

    @property
    def rank_seq(self) -> Ranks:
        """The members as a lazy sequence (cheap for huge groups)."""
        return self._ranks

    @property
    def backend(self) -> str:
        """Engine backend name: 'gloo', 'nccl' or 'fake'."""
        return self._backend

    @property
    def name(self) -> str:
        """Name of the group, derived from its ranks and backend only."""
        return self._name

    @property
    def engine_group(self) -> Any:
        """The engine's own group object (a torch ProcessGroup); None in a fake world, on a
        non-member, and once the world is destroyed."""
        return self._engine_group

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group."""
        return self._rank >= 0

    def global_rank(self, group_rank: int) -> int:
        """Global rank of a group rank."""
        return self._ranks[group_rank]

    def group_rank(self, global_rank: int) -> int | None:
        """Group rank of a global rank, None when not a member."""
        return self._ranks.index(global_rank)

    def release(self) -> None:
        """Let go of the engine group (its world was destroyed); later use raises."""
        self._engine_group = None
        self._released = True

    def require_member(self, what: str) -> None:
        """Raise unless this rank is in the group and the group's world is still alive."""
        if self._released:
            raise NotInitializedError(
                f"{what}: group {self._name} belongs to a destroyed world. Fix: build new "
                f"groups and meshes after init_process_group()."
            )
        if not self.is_member:
            raise NotAMemberError(
                f"{what}: rank {self._global_rank} is not in group {self._name} "
                f"(ranks {format_ranks(self._ranks) if len(self._ranks) < 4096 else self._ranks})."
                f" Fix: call it only on the group's members, or use a group that holds this rank."
            )

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(backend={self._backend!r}, size={self.size()}, rank={self._rank}, "
            f"ranks={self._ranks!r})"
        )


def group_name(ranks: Ranks, backend: str) -> str:
    """Deterministic name of the group of ``ranks`` on ``backend``: equal on every rank."""
    digest = hashlib.sha1(repr((ranks.key(), backend)).encode(), usedforsecurity=False)
    return f"tp-{backend}-{digest.hexdigest()[:20]}"


@dataclass(eq=False)
class World:
    """One initialised job: this rank, the world size, its engine and its group registry."""

    rank: int
    size: int
    backend: str
    timeout: timedelta
    engine: ModuleType
    store: Any
    default_group: ProcessGroup = field(init=False)
    engine_default_group: Any = None
    groups: dict[tuple, ProcessGroup] = field(default_factory=dict)
    flattened: dict[tuple, dict[str, tuple]] = field(default_factory=dict)
    created: int = 0  # groups this rank has helped create (not counting the world)
    cuda_device: int | None = None  # chosen once by the first "cuda" mesh
    agreements: int = 0  # cross-rank checks run so far (names their store keys)
    # rank -> pid of this host's ranks, gathered at init: naming a dead peer must not need
    # the store, which dies with rank 0 (often just after its error)
    host_pids: dict[int, int] | None = None
    alive: bool = True
    hosts: Any = None  # _topology.Hosts of every rank: rank 0 from init, others on first use

    def __post_init__(self) -> None:
        ranks = Ranks(layout=Layout((((self.size, 1),),)))
        self.default_group = ProcessGroup(
            ranks, self.rank, self.backend, "world", self.engine_default_group
        )
        self.groups[(ranks.key(), self.backend)] = self.default_group

    def find_group(self, ranks: Ranks, backend: str | None = None) -> ProcessGroup | None:
        """The registered group of ``ranks`` on ``backend``, or None."""
        return self.groups.get((ranks.key(), backend or self.backend))

    def group(self, ranks: Ranks, backend: str | None = None, desc: str = "") -> ProcessGroup:
        """The group of ``ranks`` on ``backend``: reused when registered, else created.

        Only members create the engine group; a non-member gets a ProcessGroup with rank -1.
        """
        backend = backend or self.backend
        key = (ranks.key(), backend)
        found = self.groups.get(key)
        if found is not None:
            return found
        name = group_name(ranks, backend)
        engine_group = None
        if ranks.index(self.rank) is not None:
            members = ranks.tolist() if self.engine.NAME != "fake" else []
            engine_group = self.engine.new_group(name, members, backend, self.timeout, desc)
            self.created += 1
        group = ProcessGroup(ranks, self.rank, backend, name, engine_group)
        self.groups[key] = group
        return group

    def register_flatten(self, root_key: tuple, name: str, dims: tuple) -> None:
        """Remember that ``name`` flattens ``dims`` of the root mesh with ``root_key``."""
        self.flattened.setdefault(root_key, {})[name] = dims

    def flattened_names(self, root_key: tuple) -> dict[str, tuple]:
        """Flattened dim names registered for a root mesh."""
        return self.flattened.get(root_key, {})


def check_ranks_in_world(name: str, ranks: Sequence[int], world_size: int) -> None:
    """Raise for ranks outside [0, world_size)."""
    from .errors import bad_argument

    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise bad_argument(
            name,
            list(ranks) if len(ranks) <= 32 else f"<{len(ranks)} ranks>",
            f"ranks {format_ranks(bad)} are outside the world of {world_size} ranks",
            f"use ranks 0..{world_size - 1}",
        )
