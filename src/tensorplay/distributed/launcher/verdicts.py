"""The one verdict of a job across nodes: why it stops, posted once, printed by every launcher.

The first verdict posted wins (``compare_set`` on ``keys.NODES_VERDICT``); every launcher
reads it at its next beat, or while it joins, and stops its ranks. A launcher that cannot reach
the store keeps its own word. Worked example, 2 nodes: node 1's rank 3 exits with code 3, and
node 1 posts first::

    verdicts.post(client, "failed", "node 1 (hostB) failed: rank 3: exit code 3")
    # node 0, a beat later: verdicts.read(client) -> that Verdict; it prints
    # "tensorplay-run: the job stopped because node 1 (hostB) failed: rank 3: exit code 3."
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from . import keys
from .store import CALL_S, POLL_S, Client, Posted, StoreGone, bounded


@dataclass(frozen=True)
class Verdict(Posted):
    """Why the job stops: posted once by one launcher, printed by every one."""

    kind: str  # 'join', 'lost', 'failed', 'store', 'bug' (a launcher's own internal error)
    node: int  # the node that posted it
    text: str
    lost: int | None = None  # the node declared lost, which will not read this


class Verdicts:
    """The verdict that stands for this launcher (``verdict``; None while the job goes on),
    and ``decide``, which acts on one: ``on_verdict`` (set by whoever watches) is called."""

    def __init__(self, index: int):
        self.index = index  # this launcher's node
        self.verdict: Verdict | None = None
        self.on_verdict: Callable[[Verdict], None] = lambda v: None

    def post(self, client: Client | None, kind: str, text: str, lost: int | None = None
             ) -> Verdict:
        """Post a verdict unless one was posted before; return the one that stands (ours when
        the store cannot be reached, or ``client`` is None: none could be made)."""
        mine = Verdict(kind, self.index, text, lost)
        if client is None:
            self.verdict = self.verdict or mine
            return self.verdict
        try:
            won = bounded(lambda: client.compare_set(keys.NODES_VERDICT, "", mine.dumps()),
                          CALL_S)
            self.verdict = Verdict.loads(won)
        except StoreGone:  # this launcher's word stands
            self.verdict = self.verdict or mine
        return self.verdict

    @staticmethod
    def read(client: Client) -> Verdict | None:
        """The verdict posted in the job's store (None: none yet)."""
        if not client.check([keys.NODES_VERDICT]):
            return None
        return Verdict.loads(client.get(keys.NODES_VERDICT))

    def note(self, client: Client) -> Verdict | None:
        """The verdict that stands, read from the store when none does yet."""
        self.verdict = self.verdict or self.read(client)
        return self.verdict

    def await_verdict(self, client: Client, within_s: float) -> Verdict | None:
        """The verdict that stands, waiting up to ``within_s`` for another launcher to post
        one (None: none came, or the store cannot be reached)."""
        deadline = time.monotonic() + within_s
        while self.verdict is None:
            try:
                self.verdict = self.verdict or bounded(lambda: self.read(client), CALL_S)
            except StoreGone:  # nobody else will say
                break
            if self.verdict is not None or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return self.verdict

    def decide(self, verdict: Verdict) -> None:
        """The job stops for ``verdict``: it stands, and ``on_verdict`` hears it."""
        self.verdict = verdict
        self.on_verdict(verdict)
