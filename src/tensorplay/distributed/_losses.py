"""Nodes lost from an elastic job, as the launcher tells its ranks: one JSON file per node.

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

Pure: the standard library only. Reading is one small file read (a few hundred bytes per loss).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

LOSSES_FILE = "TENSORPLAY_RUN_LOSSES_FILE"  # set by tensorplay-run on several nodes
VERDICT_FILE = "TENSORPLAY_RUN_VERDICT_FILE"  # the launcher's verdict: why the job stops, and
# the ranks of the node it lost, if one (read by ``_failures`` while a rank waits)
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
