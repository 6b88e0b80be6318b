"""tensorplay-run as a task of an srun step: the launchers of one step form one job.

The way torchrun is used on Slurm is one launcher per node: ``srun --ntasks-per-node 1
tensorplay-run --nproc-per-node 4 train.py`` in a batch script of ``-N 2``. Each launcher is a
task of the same step, so Slurm already says what torchrun asks for by hand: the node count is
the step's task count (SLURM_STEP_NUM_TASKS), this node's index is the task's (SLURM_PROCID),
node 0 is where task 0 runs (the first host of SLURM_STEP_NODELIST, expanded by
``host/slurm.py``, unless MASTER_ADDR names another), and the port is derived from the job id as
for ranks srun starts itself (``host/launchers.py``: job 123456 -> 18456). ``fill`` takes those
for the flags the command line leaves out; a flag that contradicts the step is refused, never
obeyed, because obeying it runs N copies of the job side by side or leaves every node waiting
for a node 0 that is not there:

- ``--nnodes 1`` in a step of 2 tasks: two jobs of one node each, each training alone;
- ``--node-rank $SLURM_NODEID`` written in the batch script: the batch shell expands it once,
  before srun, so every launcher gets 0.

A wrong ``--nnodes`` is refused by every launcher alike. A wrong ``--node-rank`` is refused
only by the tasks it contradicts (``--node-rank 0`` is right for task 0), so each refusing
launcher also tells node 0 (``join.refuse``: the refusal posted as the job's join verdict in
node 0's store), which would otherwise wait --join-timeout-s (300 s) for it: node 0 prints the
same refusal and exits 1 within a second. Where task 0 is the one refused, no store is served
and the others wait out --join-timeout-s, then say node 0's store never answered.

Outside a step, or in a step of one task, nothing changes: ``--nnodes`` 1, ``--node-rank`` 0.
``signal_words`` is what the launcher's last line says of a signal from Slurm.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from ..errors import ArgumentError, LaunchEnvError, bad_argument
from ..host import launchers, slurm


class StepRefusal(ArgumentError):
    """--node-rank contradicts the srun step; says where node 0 serves the job's store, and
    what node 0 should print (``told``)."""

    def __init__(self, text: str, step: slurm.Step, addr: str, port: int | None):
        super().__init__(text)
        self.step, self.addr, self.port = step, addr, port
        self.told = (f"node {step.task} (task {step.task} of Slurm step {step.name}) refused "
                     f"to join: {text.rstrip('.')}")


def fill(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """Fill ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` from the srun
    step this launcher is a task of, where the command line left them out (None); refuse the
    ones that contradict it. Outside a step of several tasks: the one-node defaults."""
    env = os.environ if env is None else env
    found = slurm.step(env)
    if found is None or found.tasks == 1:
        a.nnodes = 1 if a.nnodes is None else a.nnodes
        a.node_rank = 0 if a.node_rank is None else a.node_rank
        return
    said = (f"srun started {found.tasks} launchers in step {found.name} "
            f"(SLURM_STEP_NUM_TASKS={found.tasks}), this one task {found.task} (SLURM_PROCID)")
    if a.nnodes is not None and a.nnodes != found.tasks:
        raise bad_argument("--nnodes", a.nnodes, f"contradicts the Slurm step: {said}, so "
                           f"the {found.tasks} launchers would run {found.tasks} separate "
                           "jobs side by side", "leave out --nnodes (the step gives it), or "
                           f"run srun with --ntasks {a.nnodes} (one launcher per node)")
    refusal = None
    if a.node_rank is not None and a.node_rank != found.task:
        refusal = bad_argument("--node-rank", a.node_rank, f"contradicts the Slurm step: "
                               f"{said}; a $SLURM_NODEID or $SLURM_PROCID in a batch script is "
                               "expanded once, before srun, so every launcher gets the same "
                               "value", "leave out --node-rank (each task's SLURM_PROCID gives "
                               "it)")
    a.nnodes, a.node_rank = found.tasks, found.task
    _fill_master(a, found, env)  # first: a refusal says where node 0 is, to tell it
    if refusal is not None:
        raise StepRefusal(str(refusal), found, a.master_addr, a.master_port)


def _fill_master(a: argparse.Namespace, found: slurm.Step, env: Mapping[str, str]) -> None:
    """--master-addr (MASTER_ADDR, else the step's first host) and --master-port (MASTER_PORT,
    else one derived from the job id) where the command line left them out."""
    if a.master_addr is None and env.get("MASTER_ADDR", "").strip():
        a.master_addr = env["MASTER_ADDR"].strip()  # as for ranks srun starts itself
    if a.master_addr is None:
        try:
            a.master_addr = slurm.first_host(found.nodelist)
        except ValueError as err:
            raise bad_argument("--master-addr", None, f"not given, and SLURM_STEP_NODELIST="
                               f"{found.nodelist!r} does not say node 0's host ({err})",
                               "pass --master-addr, the host of task 0") from None
    if a.master_port is None:
        try:
            a.master_port = launchers.slurm_port(env)
        except LaunchEnvError as err:
            raise bad_argument("--master-port", None, f"not given, and {err}",
                               "pass --master-port, or unset MASTER_PORT") from None


def signal_words(env: Mapping[str, str]) -> str:
    """What a signal to this launcher means under Slurm, for its last line: ' (Slurm cancelled
    job 41 (scancel), 3 s after it started)'; '' outside a Slurm job (or in a batch script
    without srun, whose own shell Slurm signals too)."""
    found = slurm.step(env)
    if found is None:
        return ""
    return f" ({slurm.ending(found.job_id)})"
