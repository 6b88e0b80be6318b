"""The control planes that need no store (``control/plane.py`` declares the verbs).

``GatherControl``: every verb over an engine's all-gather of short texts on a communicator user
code never sees (the MPI engine's control communicator), called in step by every rank.
``SoloControl``: a simulated world (one process plays any rank of any size) or a world of one
rank, where nobody else can disagree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from ..geometry.topology import Hosts, hosts_from_names
from ..host import knobs
from ..job.failures import named_failures
from .plane import Tally

if TYPE_CHECKING:
    from ..backends.protocol import GathersText
    from ..job.context import JobContext


# -- a world where nobody else can disagree ---------------------------------------------------
class SoloControl:
    """A simulated world (any rank of any size, alone in this process) or a world of one rank:
    every tally agrees, nothing is exchanged, every rank is on this host."""

    def __init__(self, world: JobContext):
        self._world = world

    def tally(self, step: str, text: str) -> Tally:
        return [self._world.members()]

    def texts(self, step: str, text: str, ranks: Sequence[int]) -> list[str]:
        return [text for _ in ranks]

    def exchange(self, name: str, text: str, wanted: Sequence[int], wait_s: float
                 ) -> dict[int, str]:
        return {r: text for r in wanted}  # every rank of a simulated world says what this says

    def ending(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """Nobody else to tell."""

    def meet_hosts(self, step: str) -> dict[int, int]:
        return {}

    def hosts(self) -> Hosts:
        return Hosts.blocks(self._world.size, 1, names=[knobs.hostname()])

    def known_hosts(self) -> Hosts | None:
        return None

    def arrivals(self, step: str, name: str, ranks: Sequence[int], n: int
                 ) -> AbstractContextManager[None]:
        return nullcontext()

    def leave(self, grace_s: float) -> None:
        """Nobody to wait for."""


# -- an engine's all-gather of texts (MPI's control communicator) -----------------------------
class GatherControl:
    """Every verb is one or two all-gathers of short texts over the whole world
    (``GathersText.allgather_text``), whose waits are the engine's, bounded by the world's timeout.
    O(world size) text per rank per call: fine for what runs once per mesh or per job."""

    def __init__(self, world: JobContext, engine: GathersText):
        self._world, self._engine = world, engine
        self._hosts: Hosts | None = None

    def _gather(self, text: str, step: str) -> list[str]:
        with named_failures(self._world, step):
            return self._engine.allgather_text(text, step)

    def tally(self, step: str, text: str) -> Tally:
        members = self._world.members()
        every = self._gather(text, step)
        by_text: dict[str, list[int]] = {}
        for rank in members:
            by_text.setdefault(every[rank], []).append(rank)
        return list(by_text.values())

    def texts(self, step: str, text: str, ranks: Sequence[int]) -> list[str]:
        every = self._gather(text if self._world.rank in ranks else "", step)
        return [every[r] for r in ranks]

    def exchange(self, name: str, text: str, wanted: Sequence[int], wait_s: float
                 ) -> dict[int, str]:
        every = self._gather(text, f"exchanging {name}")
        return {r: every[r] for r in wanted}

    def ending(self, counts: Mapping[str, tuple[Sequence[int], int]]) -> None:
        """Tell the members of each group this rank's final count of it, without waiting
        (``GathersText.tell_ended``): a member blocked in a stray call would otherwise wait in
        it, and the others in the counts' all-gather, until the timeout."""
        self._engine.tell_ended(counts)

    def meet_hosts(self, step: str) -> dict[int, int]:
        pairs = [t.split(" ", 1) for t in self._gather(_joined_mark(), step)]
        self._hosts = hosts_from_names([host for _, host in pairs])
        here = knobs.hostname()
        return {rank: int(pid) for rank, (pid, host) in enumerate(pairs) if host == here}

    def hosts(self) -> Hosts:
        if self._hosts is None:  # every world meets at init_process_group
            raise RuntimeError("GatherControl.hosts(): meet_hosts() was not called")
        return self._hosts

    def known_hosts(self) -> Hosts | None:
        return self._hosts

    def arrivals(self, step: str, name: str, ranks: Sequence[int], n: int
                 ) -> AbstractContextManager[None]:
        return nullcontext()  # the engine's watchdog asks the members who is missing

    def leave(self, grace_s: float) -> None:
        """The engine's exit meeting waits for every rank."""


def _joined_mark() -> str:
    """What a rank says of itself as it joins: "<pid> <host>"."""
    return f"{os.getpid()} {knobs.hostname()}"
