"""The exceptions tensorplay.distributed raises, and the one helper that words them.

Every message names the argument, shows the bad value, says what is accepted and how to fix it.
Each condition has exactly one class (the same table is in docs/bad_inputs.md):

=============================================================  ===========================
condition                                                      class (also a ...)
=============================================================  ===========================
a bad value for an argument of a public call                   ArgumentError (ValueError)
an argument of the wrong type                                  ArgumentTypeError (TypeError)
a mesh name that is not a dim of the mesh: ``mesh["pp"]``       UnknownDimError (KeyError)
this rank is not in the group or mesh it was asked to act in   NotAMemberError (ValueError)
launcher variables missing, malformed or contradictory         LaunchEnvError (ValueError)
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK...)
init_process_group() while a world is already joined           AlreadyInitializedError
no world joined, or a group or mesh of a destroyed world       NotInitializedError
ranks passed different values to a call that must match       MeshMismatchError
ranks made different collective calls on a group (a stray      CallMismatchError
  call, or a call another rank skipped)
a bounded wait expired (names who never arrived)               DistributedTimeoutError
a peer died or its connection broke (names it when known)      RankFailedError
a torch function read a torch-only attribute of our mesh       NotATorchMeshError
  (``mesh._layout``, ``mesh._get_root_mesh``, ...)               (AttributeError)
a mesh cannot shrink past its lost ranks (below its minimum)   ShrinkError
a group or mesh of an epoch the job has left (elastic)         StaleEpochError
the engine is missing a backend, or failed in another way      BackendError
=============================================================  ===========================
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping


class DistributedError(Exception):
    """Base class of every error raised by tensorplay.distributed.

    ``waited_s``: on an error a collective raised, how long that call had waited when the
    engine failed it (an elastic recovery reports it as its detection time); else None.
    """

    waited_s: float | None = None


class ArgumentError(DistributedError, ValueError):
    """A public call got a bad value for one of its arguments."""


class ArgumentTypeError(ArgumentError, TypeError):
    """A public call got a value of the wrong type for one of its arguments."""


class NotInitializedError(DistributedError, RuntimeError):
    """A call needs init_process_group() first (or came after destroy_process_group())."""


class AlreadyInitializedError(DistributedError, RuntimeError):
    """init_process_group() was called while this process is already in a world."""


class UnknownDimError(ArgumentError, KeyError):
    """A mesh was sliced by a name that is not one of its dims (a KeyError, as in PyTorch)."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # KeyError would quote the whole message


class NotAMemberError(ArgumentError):
    """This rank was asked to act in a group or mesh that does not contain it."""


class NotATorchMeshError(DistributedError, AttributeError):
    """Our DeviceMesh was asked for a torch-only attribute (``mesh._layout``): it was handed
    to a torch function, which takes ``mesh.to_torch()``. An AttributeError, so ``hasattr``
    and ``getattr(mesh, name, default)`` still answer as for any missing attribute."""


class BackendError(DistributedError, RuntimeError):
    """The engine (gloo, nccl, mpi) is unavailable or failed."""


class LaunchEnvError(DistributedError, ValueError):
    """Launcher environment variables are missing, incomplete or contradictory."""


class MeshMismatchError(DistributedError, RuntimeError):
    """Ranks asked for different things in a call that must be identical on every rank.

    ``values`` maps each distinct value (as text) to the ranks that passed it.
    """

    def __init__(self, what: str, values: Mapping[str, Iterable[int]]):
        self.what = what
        self.values = {value: sorted(ranks) for value, ranks in values.items()}
        lines = [f"ranks disagree on {what}; every rank must pass the same value:"]
        for value, ranks in self.values.items():
            lines.append(f"  {value}: passed by {rank_words(ranks)}")
        lines.append("Fix: make the call identical on every rank (SPMD); nothing was created.")
        super().__init__("\n".join(lines))


class CallMismatchError(DistributedError, RuntimeError):
    """Ranks made different collective calls on one group: a stray or a skipped call.

    ``counts`` maps each number of calls to the ranks that made it; ``calls`` (strict mode)
    maps each distinct call to the ranks that made it instead.
    """

    def __init__(self, group: str, counts: Mapping[int, Iterable[int]] | None = None, *,
                 calls: Mapping[str, Iterable[int]] | None = None, seq: int | None = None):
        self.group = group
        self.counts = {n: sorted(r) for n, r in (counts or {}).items()}
        self.calls = {c: sorted(r) for c, r in (calls or {}).items()}
        if self.calls:
            lines = [f"ranks made different calls on {group} at its call #{seq}:"]
            lines += [f"  {rank_words(ranks)}: {call}" for call, ranks in self.calls.items()]
        else:
            by_size = sorted(self.counts.items(), key=lambda item: (len(item[1]), -item[0]))
            made = "; ".join(f"{rank_words(ranks)} made {n}" for n, ranks in by_size)
            lines = [f"ranks made different numbers of collective calls on {group}: {made}."]
        lines.append("Every result on this group since the first difference is wrong (calls pair "
                     "up in order). Fix: make every member call the same collectives in the "
                     "same order (SPMD); TENSORPLAY_STRICT=1 names the first call that differs "
                     "and where it was made.")
        super().__init__("\n".join(lines))


class DistributedTimeoutError(DistributedError, TimeoutError):
    """A bounded wait expired. ``step`` names the wait, ``missing`` the ranks not seen.

    ``who`` replaces the sentence about absent ranks when the cause is known otherwise (this
    rank came late, say); ``fix`` replaces the default advice.
    """

    def __init__(
        self,
        step: str,
        timeout_s: float,
        missing: Iterable[int] | None,
        detail: str = "",
        *,
        who: str | None = None,
        fix: str | None = None,
    ):
        self.step = step
        self.timeout_s = timeout_s
        self.missing = None if missing is None else sorted(missing)
        if who is None:
            who = (
                "the peers did not answer"
                if self.missing is None
                else f"{rank_words(self.missing)} had not arrived"
            )
        text = f"timed out after {timeout_s:g} s in {step}: {who}."
        if detail:
            text += f" {detail}"
        text += " " + (fix or (
            "Fix: check that every rank makes the same calls in the same order and that no rank"
            " died; raise the limit with init_process_group(timeout=...) or TENSORPLAY_TIMEOUT."
        ))
        super().__init__(text)


class RankFailedError(DistributedError, RuntimeError):
    """A peer rank died or its connection broke while this rank waited for it.

    ``ranks`` lists the ranks known to have failed or gone missing, None when unknown.
    """

    # True on an error raised from the launcher's verdict (job/watch.unless_told): its message
    # already says it all, so named_failures passes it on as it is
    told: bool = False

    def __init__(self, message: str, *, ranks: Iterable[int] | None = None):
        self.ranks = None if ranks is None else sorted(ranks)
        super().__init__(message)


class ShrinkError(DistributedError, RuntimeError):
    """A mesh cannot go on without its lost ranks: its elastic dim would fall below the
    minimum the user set (or the survivors are no majority). The job must restart."""


class StaleEpochError(DistributedError, RuntimeError):
    """This rank used a group or mesh of an epoch the job has left (an elastic mesh recovered
    or grew since), or reached a recovery after the others had gone on without it."""


class MembersFinished(SystemExit):
    """Not an error: a rank outside an elastic mesh (a spare, or a replacement that came too
    late) learnt in ``grow()`` or ``init_device_mesh`` that the members finished the job
    without it. It is ``SystemExit(0)``: left uncaught it ends the process quietly with exit
    code 0, so an elastic loop cannot mistake it for "go on" and spin; catch it to clean up
    first. ``epoch`` is the epoch the members finished in."""

    def __init__(self, message: str, *, epoch: int):
        super().__init__(0)
        self.message = message
        self.epoch = epoch

    def __str__(self) -> str:
        return self.message


# the advice after a lost rank, where no layer recovers from losses (the engines say it too)
FIX_FAILED = (
    "Fix: find the first rank that failed in the launcher's output (a crash, an out-of-memory "
    "kill, a signal) and fix that; then restart the whole job (a world with a dead rank "
    "cannot be repaired)."
)


def rank_words(ranks: Iterable[int]) -> str:
    """'rank 3' for one rank, 'ranks 0-2, 5' for several."""
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {format_ranks(ordered)}"


def rank_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as (first, last) runs: [0, 1, 2, 3, 7] -> [(0, 3), (7, 7)]. The
    one place rank runs are found (format_ranks words them; compact_runs packs them)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def _run_text(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}-{last}"


def format_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    """Write ranks compactly: [0, 1, 2, 3, 7] -> '0-3, 7'; long lists end with '... (N in all)'."""
    runs = rank_runs(ranks)
    words = [_run_text(first, last) for first, last in runs]
    if len(words) > limit:
        total = sum(last - first + 1 for first, last in runs)
        return ", ".join(words[:limit]) + f", ... ({total} in all)"
    return ", ".join(words) if words else "(none)"


def compact_runs(ranks: Iterable[int]) -> str:
    """Ranks as runs without spaces, for a store value: [0, 1, 2, 5] -> '0-2,5' (read back by
    parse_runs)."""
    return ",".join(_run_text(first, last) for first, last in rank_runs(ranks))


def parse_runs(text: str) -> list[int]:
    """The ranks of compact_runs' text: '0-2,5' -> [0, 1, 2, 5]."""
    ranks: list[int] = []
    for run in text.split(","):
        first, _, last = run.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def is_int(value: object) -> bool:
    """Whether ``value`` is a whole number (an int or a numpy integer), never a bool: the one
    test of an integer argument (``True`` is no rank, no size, no step)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, fix: str, expected: str = "int") -> int:
    """``value`` as an int, or the ArgumentTypeError naming ``name``: ``check_int("rank",
    "3", "pass this process's rank")`` -> "rank='3': expected int, got str. Fix: ..."."""
    if not is_int(value):
        raise bad_type(name, value, expected, fix)
    return int(value)  # type: ignore[call-overload]  # an Integral


def bad_argument(
    name: str,
    value: object,
    problem: str,
    fix: str,
    *,
    kind: type[ArgumentError] = ArgumentError,
) -> ArgumentError:
    """Build the error for one bad argument: 'name=value: problem. Fix: fix.'"""
    return kind(f"{name}={value!r}: {problem}. Fix: {fix}.")


def bad_type(name: str, value: object, expected: str, fix: str) -> ArgumentTypeError:
    """Build the error for an argument of the wrong type."""
    problem = f"expected {expected}, got {type(value).__name__}"
    return bad_argument(name, value, problem, fix, kind=ArgumentTypeError)  # type: ignore[return-value]
