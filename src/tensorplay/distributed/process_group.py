"""Our ProcessGroup, Work and ReduceOp: what a user holds, whatever engine runs it.

A ProcessGroup knows its global ranks in group order, this process's rank in it, its backend,
the engine's own group object (hand ``group.engine_group`` to torch's DDP or FSDP) and the
collectives bound to it (``ops``, from the engine). The world keeps one registry of groups
(``world.World``), so a rank set is made into a group once per backend and epoch.

A group may exist before its engine group does (a mesh view's groups are made at first use):
then ``made`` is False and the first collective, ``engine_group`` or ``usable()`` on a member
runs the world's maker once; the object stays the same, so ``view.get_group("ep") is
cp_tp.get_group()`` holds before and after. On the (2, 2, 4, 2, 4) torchtitan mesh of 128
ranks, the expert view's "efsdp" group through rank 5, [5, 13, 21, 29], is a ProcessGroup at
once and a communicator only when rank 5 and its three peers first reduce over it.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentError,
    NotAMemberError,
    NotInitializedError,
    StaleEpochError,
    format_ranks,
)
from .geometry.spec import Ranks

if TYPE_CHECKING:
    from .backends.protocol import GroupOps


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
    """A set of global ranks in a fixed order, bound to one engine group on its members.

    ``label`` names it in errors: "the 'dp' group [1, 5]" for a mesh dim, "the group [0, 2]"
    for new_group, "the world group [0-7]" for the world.
    """

    def __init__(
        self,
        ranks: Ranks,
        global_rank: int,
        backend: str,
        name: str,
        engine_group: Any = None,
        *,
        kind: str = "",
    ):
        self._ranks = ranks
        self._backend = backend
        self._name = name
        self._engine_group = engine_group
        self._kind = kind
        self._released = False
        self._retired = ""  # why this group may not be used: its epoch is over (elastic)
        found = ranks.index(global_rank)
        self._rank = -1 if found is None else found
        self._global_rank = global_rank
        # the engine's collectives for this group: set by the world on a member, None when
        # this rank cannot use the group (usable() then says why)
        self.ops: GroupOps | None = None
        self.calls = 0  # collectives this rank made on the group (control/accounting.py compares)
        # set by the world on a member whose engine group is not made yet: makes it (given
        # the call that needs it), binds ``ops`` and clears itself
        self.maker: Callable[[str], None] | None = None

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
        """Name of the group, derived from its ranks, backend and epoch only."""
        return self._name

    @property
    def label(self) -> str:
        """How errors name the group: "the 'dp' group [1, 5]"."""
        ranks = format_ranks(self._ranks) if len(self._ranks) < 4096 else repr(self._ranks)
        return f"the {self._kind + ' ' if self._kind else ''}group [{ranks}]"

    @property
    def engine_group(self) -> Any:
        """The engine's own group object (a torch ProcessGroup), made now if it was not yet
        (every member must ask at the same point, as for a collective); None in a fake world,
        on a non-member, and once the world is destroyed or the group's epoch is over."""
        if self.maker is not None and not (self._released or self._retired):
            self.maker("engine_group")
        return self._engine_group

    @property
    def made(self) -> bool:
        """Whether this rank's engine group exists (always True on a non-member, which has
        none to make); False for a view's group not used yet."""
        return self.maker is None

    def made_engine_group(self) -> Any:
        """The engine group if it is made, else None; never makes it (for the threads that
        break or close groups)."""
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

    def bind(self, engine_group: Any, ops: GroupOps) -> None:
        """The engine group is made: keep it and its collectives (``ops``)."""
        self._engine_group, self.ops, self.maker = engine_group, ops, None

    def release(self) -> None:
        """Let go of the engine group (its world was destroyed); later use raises."""
        self._engine_group = None
        self.ops = None
        self._released = True

    def retire(self, why: str) -> Any:
        """Stop this group for good (its epoch is over); returns the engine group, which the
        caller closes. Later use raises StaleEpochError saying ``why``."""
        engine_group, self._engine_group, self.ops = self._engine_group, None, None
        self._retired = why
        return engine_group

    @property
    def retired(self) -> bool:
        """Whether the group's epoch is over (an elastic mesh recovered or grew)."""
        return bool(self._retired)

    def usable(self, what: str, make: bool = True) -> GroupOps:
        """The group's collectives, or the error saying why this rank cannot use them. A group
        not made yet is made now, by every member at this same call; with ``make=False``
        (point to point: the other members do not come) that is an ArgumentError instead."""
        if self.ops is not None:
            return self.ops
        if self.maker is not None and not (self._released or self._retired):
            if not make:
                raise ArgumentError(
                    f"{what}: {self.label} has no communicator yet, and a send or receive "
                    "cannot make it (its other members do not come). Fix: make it first on "
                    "every member with a collective (barrier(group=...)) or by reading "
                    "group.engine_group, or build the mesh with init_device_mesh(..., "
                    "eager_groups=True).")
            self.maker(what)
            if self.ops is not None:
                return self.ops
        if self._retired:
            raise StaleEpochError(
                f"{what}: {self.label} {self._retired}. Fix: use the groups of the mesh that "
                f"mesh.recover() or mesh.grow() returned.")
        if self._released:
            raise NotInitializedError(
                f"{what}: {self.label} belongs to a destroyed world. Fix: build new "
                f"groups and meshes after init_process_group()."
            )
        raise NotAMemberError(
            f"{what}: rank {self._global_rank} is not in {self.label}. Fix: call it only on "
            f"the group's members, or use a group that holds this rank."
        )

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(backend={self._backend!r}, size={self.size()}, rank={self._rank}, "
            f"ranks={self._ranks!r})"
        )


def group_name(ranks: Ranks, backend: str, epoch: int) -> str:
    """Deterministic name of the group of ``ranks`` on ``backend`` in ``epoch``, equal on
    every rank: 'gloo-e0-' and 16 hex digits of a digest of the ordered ranks."""
    digest = hashlib.sha1(repr((ranks.key(), backend)).encode(), usedforsecurity=False)
    return f"{backend}-e{epoch}-{digest.hexdigest()[:16]}"


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
