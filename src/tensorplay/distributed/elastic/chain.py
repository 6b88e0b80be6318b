"""The chain of epochs of an elastic mesh, kept on the world's Board: who is in each epoch.

An elastic mesh (``init_device_mesh(..., elastic="dp")``) lives through epochs. Epoch k ends
in exactly one way, written once (``Board.decide``) under ``elastic/e<k>/next``: the next
epoch's mesh (shape, ranks, the ranks that join it fresh), or the end of the job (why). Every
rank that moves on reads the same record, so nobody's own view changes the membership:

- a recovery (``mesh.recover(err)``) writes the shrunk mesh once the survivors agreed on the
  lost ranks (``survivors``);
- a grow poll (``mesh.grow()``, every member at the same point of its loop) writes the grown
  mesh when ranks wait to join (``elastic/want/<rank>``: a replacement the launcher started, a
  spare of a removed slice) and every rank of a removed slice is there again;
- a waiting rank follows the chain from the epoch it knows, until a record admits it (its
  token, ``"<pid> <host> <node>.<claim>"``, is in ``admitted``), ends the job (``end``: it
  raises), or says the members finished (``finished``, written at their
  destroy_process_group: it leaves, raising MembersFinished, exit code 0). A token whose
  process is gone (on the deciding member's host, where its pid can be looked up; on another
  host, when the launchers declared its node lost) is not admitted: a rank that died while it
  waited is lost like any other, and its slice stays out until a replacement posts a live
  token;
- before a grown epoch's groups are made, its ranks wait for its fresh ranks to arrive
  (``enter_together``): one that died after its admission (or is not there within
  ENTER_S) is lost, decided once under ``elastic/e<k>/entered``, and the ranks recover from
  that epoch at once instead of waiting for it in the groups' rendezvous.

Worked example, (2, 4) named ("dp", "tp"), elastic "dp", rank 5 SIGKILLed at step 4:

    e0/next = {"epoch": 1, "shape": [1, 4], "ranks": [0, 1, 2, 3], "lost": [5]}
    (rank 5 restarted; it and spares 4, 6, 7 post elastic/want/<r>)
    e1/poll/3 = the third grow() poll of epoch 1 finds slice 1 complete:
    e1/next = {"epoch": 2, "shape": [2, 4], "ranks": [0, ..., 7], "fresh": [4, 5, 6, 7],
               "admitted": {"4": "812 hostA", "5": "977 hostA", ...}}

Cost: a grow poll is one ``check`` and one ``get`` or ``compare_set`` per member (the first
member to arrive also checks the missing ranks' want keys); nothing here is O(world) per step.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends.protocol import Severable, Shrinks
from ..control import keys
from ..control.plane import Board
from ..errors import DistributedTimeoutError, ShrinkError
from ..geometry.shrink import grow
from ..host import knobs, procfs, wire

if TYPE_CHECKING:
    from ..job.world import World

POLL_S = 0.05  # how often a waiting rank reads the chain
ENTER_S = 30.0  # how long after a grow decision its fresh ranks have to arrive (enter_together)


@dataclass(frozen=True)
class Elastic:
    """What an elastic mesh remembers: its dim, minimum, full layout, epoch, fresh ranks.

    ``fresh`` are the ranks that joined at this epoch and hold no training state yet
    (``sync_replicas`` fills them from a replica that trained). O(world size) once per mesh.
    """

    dim: int
    minimum: int
    full_shape: tuple[int, ...]
    full_ranks: tuple[int, ...]
    epoch: int = 0
    fresh: tuple[int, ...] = ()
    own_groups: bool = True  # each epoch's mesh makes its groups as it is entered

    def at(self, decision: dict[str, Any]) -> Elastic:
        """This plan in the epoch ``decision`` opens."""
        return Elastic(self.dim, self.minimum, self.full_shape, self.full_ranks,
                       decision["epoch"], tuple(decision.get("fresh", ())), self.own_groups)


def board_of(world: World) -> Board:
    """The world's control plane as a Board (every elastic world has one: checked when the
    elastic mesh is made, ``elastic_refused``)."""
    control = world.control
    assert isinstance(control, Board), "elastic_refused() let a world without a board through"
    return control


def elastic_refused(world: World) -> tuple[str, str] | None:
    """(why ``world`` cannot hold an elastic mesh; the fix), or None: the survivors of a loss
    agree on a board any rank reads at any time (a store; a control plane in step only has
    none), and a recovery breaks the groups of the failed epoch (a ``Severable`` engine); or
    the engine shrinks its own world (``Shrinks``: ``elastic/shrinking.py``) and says whether
    this job can."""
    fix = "use backend 'gloo' or 'nccl' for an elastic mesh"
    if isinstance(world.engine, Shrinks):
        refused = world.engine.shrink_refused()
        return None if refused is None else (
            f"needs the engine's fault tolerance: {refused[0]}", refused[1])
    if not isinstance(world.control, Board):
        return (f"needs a store where the survivors agree; the {world.engine.name} engine has "
                "none (its control plane runs in step only)"), fix
    if not isinstance(world.engine, Severable):
        return (f"needs an engine that can break its groups in a recovery; the "
                f"{world.engine.name} engine cannot"), fix
    return None


def next_of(board: Board, epoch: int, proposal: dict[str, Any]) -> dict[str, Any]:
    """What follows ``epoch``: ``proposal`` if it is the first written, else the first."""
    key = keys.ELASTIC_NEXT.format(epoch=epoch)
    return json.loads(board.decide(key, json.dumps(proposal)))


def end(board: Board, epoch: int, why: str) -> None:
    """Write that the job ends after ``epoch`` (ranks waiting to join read why), unless
    another record came first."""
    next_of(board, epoch, {"end": why})


def finish(board: Board, epoch: int, shape: tuple[int, ...], ranks: list[int]) -> None:
    """The members are done (destroy_process_group): ranks still waiting to join get the last
    mesh, which does not hold them, and leave."""
    next_of(board, epoch, {"finished": f"the members finished at epoch {epoch}",
                           "epoch": epoch, "shape": list(shape), "ranks": ranks})


def poll(board: Board, plan: Elastic, n: int, members: set[int]) -> dict[str, Any] | None:
    """The members' ``n``-th grow poll of this epoch: the grown mesh, or None (the same on
    every member: the first to arrive decides)."""
    key = keys.ELASTIC_POLL.format(epoch=plan.epoch, n=n)
    posted = board.peek([key])[0]
    if posted is None:
        posted = board.decide(key, json.dumps(_growth(board, plan, members)))
    return json.loads(posted) or None


def _growth(board: Board, plan: Elastic, members: set[int]) -> dict[str, Any]:
    """The grown mesh if waiting ranks complete a removed slice, else {}."""
    missing = [r for r in plan.full_ranks if r not in members]
    tokens = board.peek([keys.ELASTIC_WANT.format(rank=r) for r in missing])
    waiting = {r: t for r, t in zip(missing, tokens, strict=True)
               if t is not None and not _gone(t)}
    shape, ranks = grow(plan.full_shape, plan.full_ranks, plan.dim, members | set(waiting))
    admitted = {str(r): waiting[r] for r in ranks if r in waiting}
    if not admitted:
        return {}
    return {"epoch": plan.epoch + 1, "shape": list(shape), "ranks": list(ranks),
            "fresh": sorted(int(r) for r in admitted), "admitted": admitted}


def _gone(token: str) -> bool:
    """Whether the process a want token names (``"<pid> <host> [<node>.<claim>]"``) is gone:
    on this host, no longer running; on another host, its node was declared lost by the
    launchers (``wire.gone``: "977 hostB 1.1" once node 1's first launcher is lost). Any other
    process on another host is taken as alive (its launcher's heartbeat judges it)."""
    pid, host = (token.split() + ["", ""])[:2]
    if host == knobs.hostname():
        return pid.isdigit() and not procfs.alive(int(pid))
    return wire.gone(token)


def want(board: Board, rank: int, token: str) -> None:
    """Say that ``rank`` (this process, ``token``) waits to join the mesh."""
    board.post(keys.ELASTIC_WANT.format(rank=rank), token)


def await_admission(board: Board, rank: int, token: str, epoch: int,
                    timeout_s: float) -> dict[str, Any]:
    """Follow the chain from ``epoch`` until a record admits ``token`` or says the members
    finished; that record.

    Raises ShrinkError when the job ended (naming why), DistributedTimeoutError after
    ``timeout_s`` (the members never grew: no grow() poll, or a slice still incomplete).
    """
    want(board, rank, token)
    began = time.monotonic()
    while True:
        posted = board.peek([keys.ELASTIC_NEXT.format(epoch=epoch)])[0]
        if posted is not None:
            decision = json.loads(posted)
            if "end" in decision:
                raise ShrinkError(f"rank {rank} waited to join, but the job ended: "
                                  f"{decision['end']}")
            if "finished" in decision or decision.get("admitted", {}).get(str(rank)) == token:
                return decision
            epoch = decision["epoch"]
            continue
        if time.monotonic() - began > timeout_s:
            raise DistributedTimeoutError(
                f"rank {rank} waiting to join the elastic mesh after epoch {epoch}", timeout_s,
                None, who="no member admitted it",
                fix="Fix: the members admit waiting ranks only in mesh.grow(), once every rank "
                    "of a removed slice waits: call mesh.grow() once per step on every member, "
                    "and keep the spares of a removed slice waiting in mesh.grow()")
        time.sleep(POLL_S)


def enter_together(board: Board, decision: dict[str, Any], rank: int,
                   dead: Callable[[], Iterable[int]]) -> list[int]:
    """The fresh ranks of the epoch ``decision`` opens that will never arrive ([] when every
    one did), the same list on every rank of its mesh: the first rank to see them all
    arrive, one of them dead (``dead()``, asked at every poll), or ENTER_S run out,
    decides. A fresh rank posts its arrival first. O(fresh ranks) per poll.

    Worked example: rank 0's replacement admitted into epoch 2 at (2, 4), then SIGKILLed
    before it reads the decision: ranks 1-7 see its pid gone and get [0]; a rank that arrived
    a moment before the decision was written gets [0] too, not []."""
    epoch, fresh = decision["epoch"], list(decision.get("fresh", ()))
    verdict = keys.ELASTIC_ENTERED_VERDICT.format(epoch=epoch)
    marks = [keys.ELASTIC_ENTERED.format(epoch=epoch, rank=r) for r in fresh]
    if rank in fresh:
        board.post(keys.ELASTIC_ENTERED.format(epoch=epoch, rank=rank), "1")
    began = time.monotonic()
    while True:
        said = board.peek([verdict])[0]
        if said is not None:
            return list(json.loads(said))
        missing = [fresh[i] for i in board.unposted(marks)]
        lost = sorted(set(missing) & set(dead()))
        if not missing or lost or time.monotonic() - began > ENTER_S:
            return list(json.loads(board.decide(verdict, json.dumps(lost or missing))))
        time.sleep(POLL_S)


def recovering(board: Board, epoch: int, rank: int, detect_s: float | None) -> float | None:
    """Say that a recovery of ``epoch`` began (this rank caught a failure): every rank's
    watcher then breaks its connections of that epoch, so none stays blocked in a collective
    with a peer that is stalled, or itself blocked elsewhere. The first rank to say so also
    leaves how long its failed call had waited (``detect_s``); returns that first rank's
    figure, for a rank whose own call failed only because the watcher broke it (no figure of
    its own). Worked example: rank 5 killed; rank 4's all_reduce fails after 0.04 s and says
    "4 detect=0.040000"; rank 0's next call is refused at once: its record reads 0.04 s too."""
    said = board.decide(keys.ELASTIC_RECOVERING.format(epoch=epoch),
                        f"{rank}" + ("" if detect_s is None else f" detect={detect_s:.6f}"))
    found = re.search(r"\bdetect=([\d.]+)", said)
    return float(found.group(1)) if found else None
