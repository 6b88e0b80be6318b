"""The names four modules being split elsewhere still read as ``env.<name>``: each is
``host/launchers.py``'s or ``host/knobs.py``'s, the same object.

Read by ``backends/mpi.py`` (``detect``, ``hostname``, ``DEFAULT_TIMEOUT_S``),
``backends/torch_c10d.py`` (``agent_store_attempt``, ``hostname``, ``local_rank_from_env``),
``job/failures.py`` (``agent_store_attempt``, ``hostname``) and ``mesh/value.py``
(``eager_groups_from_env``). New code imports ``launchers`` or ``knobs``; this module goes
once those four do.
"""

from __future__ import annotations

from .knobs import DEFAULT_TIMEOUT_S, eager_groups_from_env, hostname
from .launchers import agent_store_attempt, detect, local_rank_from_env

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "agent_store_attempt",
    "detect",
    "eager_groups_from_env",
    "hostname",
    "local_rank_from_env",
]
