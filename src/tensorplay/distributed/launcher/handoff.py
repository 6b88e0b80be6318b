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
``--log-dir``, ``--max-restarts``, ...) are refused, naming the flag and what to use instead;
``--no-warm`` and ``--preload`` only shape the warm process, which an MPI job does not have.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from .. import backends
from ..errors import bad_argument
from .options import PROG

MPIEXEC = "mpiexec"
INSTALL = 'pip install -e ".[mpi]" in a checkout, or pip install "tensorplay-distributed[mpi]"'
# flags with no meaning under mpiexec that change nothing a job sees: accepted as they are
HARMLESS = frozenset({"nproc_per_node", "module", "script", "script_args", "no_warm", "preload"})


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


def command(a: argparse.Namespace, python: str, mpiexec: str = MPIEXEC) -> list[str]:
    """The mpiexec command line of the job that ``a`` (the checked flags) describes."""
    return [mpiexec, "-n", str(a.nproc_per_node), python, *target(a)]


def check(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse what mpiexec cannot do, naming the flag (several nodes first)."""
    line = shlex.join(command(a, python_word()))
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
        if dest in HARMLESS or getattr(a, dest) == parser.get_default(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        raise bad_argument(
            flag, getattr(a, dest),
            f"torch is not installed, so tensorplay-run would run the job under mpiexec "
            f"({line}), which has no {flag}",
            f"leave out {flag}, or run mpiexec yourself with its own options "
            f"(mpiexec --help)")


def hand_off(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the job under mpiexec (this process becomes it), or say the line to use and return
    the usage-error status; flags mpiexec cannot honour raise ArgumentError first."""
    check(a, parser)
    python = python_word()
    found = find_mpiexec()
    mpiexec, word = found if found is not None else (None, MPIEXEC)
    line = shlex.join(command(a, python, word))
    if mpiexec is None or not backends.mpiexec_engine_installed():
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
        os.execv(mpiexec, command(a, sys.executable, mpiexec))  # `python` above names this one
    except OSError as err:  # returns only on failure
        print(f"{PROG}: error: could not run {mpiexec}: {err}. Run the line above yourself.",
              file=sys.stderr)
    return 2

