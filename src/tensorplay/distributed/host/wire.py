"""What tensorplay-run and its ranks tell each other: the one contract between the launcher
and the rank-side code, so neither imports the other.

The launcher -> a rank, in the rank's environment:

- ``TENSORPLAY_RESTART_COUNT``: how often elastic mode restarted this one rank
  (``rank_restart_count``; 0 for a rank that started with the job);
- ``TENSORPLAY_NODE_INSTANCE``: ``"<node>.<claim>"`` of the launcher that started it;
- ``TENSORPLAY_RUN_VERDICT_FILE``: where the launcher writes why the job stops (several nodes);
- ``TENSORPLAY_RUN_LOSSES_FILE``: the nodes an elastic job lost (below).

A rank -> the launcher: one JSON line per event on the rank's report pipe
(``TENSORPLAY_RUN_NOTES``, ``tell_launcher``), such as a ``Recovery`` record (below).

## Lost nodes

Nodes lost from an elastic job, as the launcher tells its ranks: one JSON file per node.

Under ``tensorplay-run --nnodes N --max-restarts K``, a node other than node 0 that is
declared lost (its launcher gone, or silent past --node-grace-s) does not stop the job: every
launcher that remains writes the loss into the file named by ``LOSSES_FILE`` in its ranks'
environment, and marks it replaced when a new launcher takes that node index. Ranks read it:

- a recovery counts the ranks of a lost node as seen dead (``lost_ranks``), so the survivors
  agree at once instead of waiting for a majority they cannot have (4 of 8 ranks when one of
  two hosts is gone);
- the elastic watcher begins a recovery when a loss names a member (``naming``), which frees
  a rank blocked in a collective with a frozen or cut-off host;
- a join token of a process on a lost node is dead (``gone``): its node is gone with it, even
  when a replacement runs on a machine of the same name.

Each launcher instance is ``"<node>.<claim>"``: node index and how many launchers had claimed
that index when it did (1 for the first). Worked example, node 1 (hostB, ranks 4-7) killed,
then started again::

    [{"node": 1, "claim": 1, "ranks": [4, 5, 6, 7], "replaced": false,
      "text": "node 1 (hostB, ranks 4-7) is lost: its launcher is gone (...)"}]
    lost_ranks() -> [4, 5, 6, 7]; gone("977 hostB 1.1") -> True
    (a launcher claims node 1 again: claim 2; the entry gets "replaced": true)
    lost_ranks() -> []; gone("977 hostB 1.1") -> True; gone("1204 hostB 1.2") -> False

Reading is one small file read (a few hundred bytes per loss).

## The cost of one epoch change: ``Recovery``

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
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LaunchEnvError, format_ranks
from . import launchers

LOSSES_FILE = "TENSORPLAY_RUN_LOSSES_FILE"  # set by tensorplay-run on several nodes
VERDICT_FILE = "TENSORPLAY_RUN_VERDICT_FILE"  # the launcher's verdict: why the job stops, and
# the ranks of the node it lost, if one (read by ``job/failures.py`` while a rank waits)
TENSORPLAY_RESTART_COUNT = "TENSORPLAY_RESTART_COUNT"  # set by tensorplay-run's elastic mode
# "<pid>:<fd>": the rank's report pipe to tensorplay-run, usable by that process only (set by
# launcher/rank_main.py; the fd is not inherited, so a subprocess must not write to its number)
TENSORPLAY_RUN_NOTES = "TENSORPLAY_RUN_NOTES"
STORE = "TENSORPLAY_RUN_STORE"  # under --store etcd: etcd://h1:p1,h2:p2/<prefix>, the ranks' store
NODE_INSTANCE = "TENSORPLAY_NODE_INSTANCE"  # "<node>.<claim>" of the launcher of this rank


def write(path: str, losses: list[dict[str, Any]]) -> None:
    """The launcher's side: replace the file at ``path`` whole (a reader never sees half)."""
    with open(path + ".tmp", "w") as f:
        json.dump(losses, f)
    os.replace(path + ".tmp", path)


def read() -> list[dict[str, Any]]:
    """Every loss the launcher of this rank wrote (none outside tensorplay-run)."""
    path = os.environ.get(LOSSES_FILE)
    if not path:
        return []
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):  # not written yet (or being replaced): no loss yet
        return []
    return found if isinstance(found, list) else []


def lost_ranks(since: Mapping[int, str] | None = None) -> list[int]:
    """The ranks of the nodes that are lost and not replaced: [4, 5, 6, 7] after node 1 of
    (2 nodes x 4 ranks) was lost, [] again once a launcher took node 1 back. ``since``: the
    ranks admitted into the mesh from a later launcher (rank -> its instance): a loss does
    not name them, though this rank's launcher may not have heard of that launcher yet
    ({4: "1.2", ...}: ranks 4-7 run again on node 1's second launcher, so the loss of
    "1.1" names none of them)."""
    return sorted({r for loss in read() for r in loss["ranks"] if _names(loss, r, since)})


def told_lost() -> list[int]:
    """Every rank the launcher has said is gone: the lost nodes' (``lost_ranks``) and, once the
    job stops because a node was lost, that node's ranks (the verdict file's "ranks"). The end
    of job waits for none of them: on (2 nodes x 4 ranks) after node 1 went silent, [4-7]."""
    found = set(lost_ranks())
    path = os.environ.get(VERDICT_FILE)
    if path:
        try:
            with open(path) as f:
                verdict = json.load(f)
            found.update(verdict.get("ranks") or [])
        except (OSError, ValueError, AttributeError):  # none yet (or being written)
            pass
    return sorted(found)


def naming(ranks: Iterable[int], since: Mapping[int, str] | None = None
           ) -> dict[str, Any] | None:
    """The first loss not replaced that names one of ``ranks`` (None: none does);
    ``since`` as for ``lost_ranks``."""
    wanted = set(ranks)
    for loss in read():
        if any(_names(loss, r, since) for r in loss["ranks"] if r in wanted):
            return loss
    return None


def _names(loss: dict[str, Any], rank: int, since: Mapping[int, str] | None) -> bool:
    """Whether ``loss`` (not replaced) still names ``rank``: the process now running it is
    not known to come from another launcher instance than the lost one."""
    lost = _instance_lost(loss)
    return (not loss.get("replaced") and rank in loss["ranks"]
            and (since or {}).get(rank, lost) == lost)


def _instance_lost(loss: dict[str, Any]) -> str:
    """The launcher instance a loss is about: "1.1" for node 1's first launcher."""
    return f"{loss['node']}.{loss['claim']}"


def instance() -> str:
    """This rank's launcher instance, ``"<node>.<claim>"`` ("" outside a multi-node
    tensorplay-run)."""
    return os.environ.get(NODE_INSTANCE, "")


def gone(token: str) -> bool:
    """Whether a join token (``"<pid> <host> <node>.<claim>"``) names a process on a node
    that was declared lost: "977 hostB 1.1" after node 1's first launcher was lost. Tokens
    without an instance (one node) are never gone here."""
    made_by = instance_of(token)
    return bool(made_by) and any(_instance_lost(loss) == made_by for loss in read())


def instance_of(token: str) -> str:
    """The launcher instance a join token names ("1.2" of "1204 hostB 1.2"; "" without)."""
    parts = token.split()
    return parts[2] if len(parts) >= 3 else ""


def rank_restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times tensorplay-run's elastic mode restarted this one rank (0: it started
    with the job). A restarted rank joins the running job's elastic mesh instead of starting
    one (torchrun restarts the whole world instead: TORCHELASTIC_RESTART_COUNT)."""
    raw = (os.environ if environ is None else environ).get(TENSORPLAY_RESTART_COUNT, "").strip()
    return launchers.as_int(TENSORPLAY_RESTART_COUNT, raw, 0) if raw else 0


def etcd_store(environ: Mapping[str, str] | None = None) -> tuple[list[str], str] | None:
    """The ranks' store under ``tensorplay-run --store etcd``: its members' endpoints and the
    prefix of the ranks' keys; None when ``STORE`` is unset (the store is a TCPStore).
    ``etcd://10.0.0.1:29500,10.0.0.2:29502/ranks/`` -> (["10.0.0.1:29500",
    "10.0.0.2:29502"], "ranks/"). LaunchEnvError naming the variable when malformed."""
    raw = (os.environ if environ is None else environ).get(STORE, "").strip()
    if not raw:
        return None
    where, slash, prefix = raw.removeprefix("etcd://").partition("/")
    endpoints = [e for e in where.split(",") if e]
    bad = [e for e in endpoints if not e.rpartition(":")[2].isdigit() or ":" not in e]
    if not raw.startswith("etcd://") or not slash or not endpoints or bad:
        raise LaunchEnvError(f"{STORE}={raw!r} is not etcd://HOST:PORT[,HOST:PORT...]/PREFIX. "
                             f"Fix: leave it to tensorplay-run --store etcd, which sets it for "
                             f"its ranks, or unset it")
    return endpoints, prefix


def tell_launcher(event: str, **fields: object) -> bool:
    """Send one JSON line to tensorplay-run's report pipe of this rank (what the launcher's
    closing summary lists, such as an elastic recovery's cost); False when this process has
    none (another launcher, a subprocess of a rank) or the launcher is gone. Worked example:
    ``tell_launcher("recovery", record={...})`` writes ``{"event": "recovery", "record":
    {...}}``; a line must stay under 4 KiB (PIPE_BUF) to reach the pipe whole."""
    import json

    raw = os.environ.get(TENSORPLAY_RUN_NOTES, "").strip()
    pid, _, fd = (raw or "").partition(":")
    if not pid.isdigit() or not fd.isdigit() or int(pid) != os.getpid():
        return False
    line = json.dumps({"event": event, **fields}) + "\n"
    try:
        os.write(int(fd), line.encode())
    except OSError:
        return False
    return True



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
