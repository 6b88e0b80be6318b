"""Every store key the package writes, and every counter that must move in step on every rank.

The SPMD rule, written once: each counter here counts calls that every rank of the world makes
in the same order (init_process_group, a cross-rank check, a blocking barrier on one group).
A key made from a counter is only met by the same key on the other ranks if every rank moved
that counter the same number of times; a rank that skipped a call waits on a key nobody
writes, and its wait says so by timing out. Nothing else may name a key.

Keys are scoped twice:

- per world: the engine hands the package a store already prefixed with
  ``tensorplay/world_<k>/``, k counting the worlds this process started (``next_world()``), so
  a world never reads an older world's keys on a store that outlived it;
- per epoch: the keys of checks and barriers live under ``e<epoch>/``, and group names carry
  the epoch too. ``Spmd.open_epoch()`` starts a fresh generation (after ranks were lost, say):
  nothing keyed in the old one is met again.

On a (2, 4) world in epoch 0, rank 5's digest at its 3rd cross-rank check is posted under
``e0/check/3/arrive/5``, and the verdict under ``e0/check/3/outcome``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# -- world keys: posted once per world, outside any epoch ------------------------------------
OPENED = "tensorplay/opened"  # rank 0 serves this world's store (clients wait for it)
JOINED = "tensorplay/joined/{rank}"  # "<pid> <host>", posted by each rank as it joins
HOSTS = "tensorplay/hosts"  # every rank's host name, one per line, posted by rank 0
ON_HOST = "tensorplay/host/{host}"  # "<rank>:<pid>;..." of one host, posted by rank 0

# -- epoch keys: made by Spmd.key(), under e<epoch>/ -------------------------------------------
CHECK_ARRIVE = "check/{n}/arrive/{rank}"  # a rank's request digest (or a death notice)
CHECK_OUTCOME = "check/{n}/outcome"  # ok | differ ... | gave_up ... | dead ...
CHECK_REQUEST = "check/{n}/request/{rank}"  # a request's JSON text, posted only on a difference
BARRIER_MARK = "barrier/{group}/{n}/{rank}"  # a member at a lasting barrier (#0: the making)
BARRIER_COUNT = "barrier/{group}"  # the Spmd counter of one group's blocking barriers
EXCHANGE = "exchange/{name}/{rank}"  # a rank's text in a Control.exchange ("calls": its counts)
CALLS_AFTER_FAILURE = "calls/{group}/{rank}"  # a member's count of a group whose call failed
LEFT = "left/{rank}"  # a rank is done with the store (rank 0 waits for these before it closes)
FAILED = "failed/{rank}"  # a rank raised RankFailedError: it saw a loss, it is not one (if gone)

# -- elastic keys: the chain of epochs (``_elastic``), per world but across epochs ------------
ELASTIC_NEXT = "elastic/e{epoch}/next"  # what follows epoch k: its mesh, or the end (JSON)
ELASTIC_RECOVERING = "elastic/e{epoch}/recovering"  # a member began recover() in epoch k
ELASTIC_POLL = "elastic/e{epoch}/poll/{n}"  # the members' n-th grow() poll in epoch k: decided
RECOVER_HERE = "recover/e{epoch}/here/{rank}"  # a survivor of epoch k: its suspects, its dead
RECOVER_VERDICT = "recover/e{epoch}/verdict"  # the lost ranks of epoch k (or a refusal), decided
ELASTIC_WANT = "elastic/want/{rank}"  # a rank waiting to join: "<token>" (a replacement, a spare)
ELASTIC_ENTERED = "elastic/e{epoch}/entered/{rank}"  # a fresh rank of epoch k reached it
ELASTIC_ENTERED_VERDICT = "elastic/e{epoch}/entered"  # the fresh ranks lost on the way (decided)

_worlds_started = 0  # worlds this process has started: the k of their key prefix


def next_world() -> int:
    """Count one more world started by this process and return its number (1, 2, ...)."""
    global _worlds_started
    _worlds_started += 1
    return _worlds_started


def worlds_started() -> int:
    """How many worlds this process has started."""
    return _worlds_started


ATTEMPT_PREFIX = "tensorplay/attempt_{attempt}/"  # an agent's store: its keys of restart n


def world_prefix(k: int) -> str:
    """The prefix of world k's keys on its store: ``tensorplay/world_<k>/``."""
    return f"tensorplay/world_{k}/"


def joined(rank: int) -> str:
    """The key of ``rank``'s join mark."""
    return JOINED.format(rank=rank)


@dataclass
class Spmd:
    """The per-world counters that every rank moves in step, and the current epoch.

    ``next("check")`` numbers cross-rank checks; ``next(BARRIER_COUNT.format(group=g))`` numbers one
    group's blocking barriers. ``open_epoch()`` moves to a new generation and restarts them.
    """

    epoch: int = 0
    _counts: dict[str, int] = field(default_factory=dict)

    def next(self, kind: str) -> int:
        """Count one more call of ``kind`` and return its number (1, 2, ...)."""
        n = self._counts.get(kind, 0) + 1
        self._counts[kind] = n
        return n

    def counts(self) -> dict[str, int]:
        """A copy of every counter: {kind: calls so far}."""
        return dict(self._counts)

    def open_epoch(self, epoch: int | None = None) -> int:
        """Start the next epoch (or ``epoch``, for a rank joining a running job) with every
        counter at zero; returns its number."""
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self._counts.clear()
        return self.epoch

    def key(self, template: str, **fields: object) -> str:
        """``template`` filled in, under this epoch: ``key(CHECK_OUTCOME, n=3)`` ->
        'e0/check/3/outcome'."""
        return f"e{self.epoch}/" + template.format(**fields)
