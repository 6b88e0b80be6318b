"""What one change of an elastic mesh cost: ``mesh.last_recovery`` and the launcher's summary.

Every epoch change (a shrink after a loss, a grow back, a restarted rank's join) leaves one
``Recovery`` on each rank that entered the new epoch, timed on that rank with
time.monotonic():

- ``detect_s``: how long the collective that failed had waited when the engine failed it
  (``DistributedError.waited_s``): an upper bound on the time from the fault to this rank
  knowing of it. A rank whose call failed only because another rank's recovery broke its
  connections (no figure of its own) takes that of the rank that began the recovery
  (``chain.recovering``); None when neither has one (an error from elsewhere), and on a grow;
- ``agree_s``: from ``recover()`` to the lost ranks agreed by every survivor (closing the
  failed epoch's groups included); for a grow, the poll that decided it; None on a rank that
  waited to be admitted (its wait is not a cost of the recovery);
- ``rebuild_s``: making the new epoch's groups;
- ``sync_s``: ``sync_replicas`` on the new mesh (None until it is called).

Worked example, (2, 4) ("dp", "tp"), elastic "dp", rank 5 killed in a 0.2 s step: rank 0's
``mesh.last_recovery`` after ``recover`` is ``Recovery(epoch=1, kind='shrink', shape=(1, 4),
lost_ranks=(5,), lost_hosts=('hostA',), joined_ranks=(), detect_s=0.04, agree_s=0.11,
rebuild_s=0.09, sync_s=None)``, and ``line()`` is ``epoch 1, shrink to (1, 4): lost rank 5
(host hostA); detect 0.04 s, agree 0.11 s, rebuild 0.09 s``. The first member of the new
mesh that trained before it sends it to tensorplay-run, whose closing summary prints one such
line per epoch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import format_ranks


@dataclass
class Recovery:
    """One epoch change of an elastic mesh as this rank saw it (see the module docstring)."""

    epoch: int  # the epoch it opened
    kind: str  # "shrink" (ranks lost), "grow" (a removed slice back), "join" (this rank came in)
    shape: tuple[int, ...]  # the mesh of that epoch
    lost_ranks: tuple[int, ...]
    lost_hosts: tuple[str, ...]
    joined_ranks: tuple[int, ...]
    detect_s: float | None
    agree_s: float | None
    rebuild_s: float
    sync_s: float | None = None

    @property
    def total_s(self) -> float:
        """The phases' seconds added up (those not measured count as 0)."""
        return sum(s or 0.0 for s in (self.detect_s, self.agree_s, self.rebuild_s, self.sync_s))

    def line(self) -> str:
        """One line for a log or a summary: what changed, then each measured phase."""
        what = f"epoch {self.epoch}, {self.kind} to {self.shape}"
        if self.lost_ranks:
            s = "s" if len(self.lost_ranks) > 1 else ""
            hosts = f" (host{'s' if len(self.lost_hosts) > 1 else ''} " \
                    f"{', '.join(self.lost_hosts)})" if self.lost_hosts else ""
            what += f": lost rank{s} {format_ranks(list(self.lost_ranks))}{hosts}"
        if self.joined_ranks:
            s = "s" if len(self.joined_ranks) > 1 else ""
            what += f"{';' if self.lost_ranks else ':'} joined rank{s} " \
                    f"{format_ranks(list(self.joined_ranks))}"
        phases = [f"{name} {value:.2f} s" for name, value in (
            ("detect", self.detect_s), ("agree", self.agree_s), ("rebuild", self.rebuild_s),
            ("sync", self.sync_s)) if value is not None]
        return f"{what}; {', '.join(phases)}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Recovery:
        """The record ``to_json`` wrote (ValueError when it is not one)."""
        try:
            return cls(**{**record, **{k: tuple(record[k]) for k in (
                "shape", "lost_ranks", "lost_hosts", "joined_ranks")}})
        except (TypeError, KeyError) as err:
            raise ValueError(f"not a recovery record: {record!r}") from err
