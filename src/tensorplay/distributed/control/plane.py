"""The control plane: what the ranks of one world decide together, declared once.

Every cross-rank protocol of the package (the argument check, the host exchange, the call
counts, strict mode's call texts, barrier arrivals, failure marks, the survivors' vote, the
chain of epochs) is written once, against ``Control``; each world has one, chosen by
``world.control_for`` from what its engine offers:

- ``StoreControl`` (``control/store.py``): over the job's key-value store (the torch
  engine's TCPStore, the launcher's). Rank 0 judges, every other rank makes O(1) round trips:
  a check of 100,000 ranks reads 100,000 digests at rank 0 and one outcome everywhere else.
  It is also a ``Board``: marks any rank may post and read at any time, and decisions where
  the first proposal wins (what elastic recovery needs).
- ``GatherControl`` (``control/gather.py``): over an engine's all-gather of short texts on
  a communicator user code never sees (the MPI engine's control communicator). Every call is
  made in step by every rank, so it is no Board: a world on it has no elastic meshes.
- ``SoloControl`` (``control/gather.py``): a simulated or one-rank world, where nobody else
  can disagree.

The verbs, each called by every member in the same order (SPMD; the store keys of call #n are
met only by call #n elsewhere, see ``control/keys.py``):

- ``tally(step, text)``: every member's text compared; the members grouped by equal text, the
  same answer on every member: ``[[0, 1, 2, 3]]`` when all agree, ``[[0, 2], [1, 3]]`` when
  ranks 1 and 3 passed another text;
- ``texts(step, text, ranks)``: the texts of ``ranks`` (the others pass anything), to every
  member: after a tally, the first rank of each group says what its group passed;
- ``exchange(name, text, wanted, wait_s)``: every member posts ``text``; each gets the texts of
  the ``wanted`` ranks posted within ``wait_s`` (the call counts at the end);
- ``ending(counts)``: this rank has made its last collective (group name -> (members, calls),
  before the counts' ``exchange`` at the end): a control plane whose members may be blocked
  in a stray call that cannot fail (MPI's) tells them now, so that they name it at once;
- ``meet_hosts(step)``: every rank's host and pid; returns rank -> pid of this host's ranks;
  ``hosts()``: the world's host map (read on first use); ``known_hosts()``: the map if this
  rank holds it already, without asking (rank 0 does, after meeting the others);
- ``arrivals(step, name, ranks, n)``: a block (barrier #n of the group ``name``; n = 0: the
  group's making at its first use) after which a timeout names the members that never arrived;
- ``leave(grace_s)``: this rank is done with the control plane (rank 0, whose process may
  serve the store, lingers until the others are done, at most ``grace_s``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..geometry.topology import Hosts

Tally = list[Sequence[int]]  # the members grouped by equal text, in order of first rank


class Control(Protocol):
    """What the ranks of one world decide together (see the module docstring)."""

    def tally(self, step: str, text: str) -> Tally: ...
    def texts(self, step: str, text: str, ranks: Sequence[int]) -> list[str]: ...
    def exchange(self, name: str, text: str, wanted: Sequence[int], wait_s: float
                 ) -> dict[int, str]: ...
    def ending(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None: ...
    def meet_hosts(self, step: str) -> dict[int, int]: ...
    def hosts(self) -> Hosts: ...
    def known_hosts(self) -> Hosts | None: ...
    def arrivals(self, step: str, name: str, ranks: Sequence[int], n: int
                 ) -> AbstractContextManager[None]: ...
    def leave(self, grace_s: float) -> None: ...


@runtime_checkable
class Board(Protocol):
    """Marks any rank may post and read at any time, not in step: a store's verbs.

    ``post`` never waits long; ``peek`` returns what is posted now (None for a key not yet
    posted); ``wait`` waits up to the world's timeout for every key; ``decide`` keeps the
    first proposal for ``key`` and returns it to every caller. ``briefly()`` bounds every
    call inside it by a short peek time instead of the world's timeout.
    """

    def post(self, key: str, value: str) -> None: ...
    def peek(self, keys: Sequence[str]) -> list[str | None]: ...
    def wait(self, keys: Sequence[str]) -> list[str]: ...
    def decide(self, key: str, proposal: str) -> str: ...
    def unposted(self, keys: Sequence[str]) -> list[int]: ...
    def briefly(self) -> AbstractContextManager[None]: ...
    def clone(self) -> Board: ...


PEEK_S = 2.0  # the longest a Board call takes inside briefly(): a failing rank's marks
