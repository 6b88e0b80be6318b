"""launcher/slurm_step.py: the launchers of one srun step form one job, or are refused.

Here the step is the variables srun sets for a task (as seen under Slurm 22.05);
test_under_slurm.py runs the same through a real srun.
"""

from __future__ import annotations

import os

import pytest

from tensorplay.distributed.errors import ArgumentError
from tensorplay.distributed.launcher import slurm_step
from tensorplay.distributed.launcher.options import build_parser, check_args

STEP = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[07-08]", "SLURMD_NODENAME": "node08"}


def task(k: int, **more: str) -> dict[str, str]:
    return STEP | {"SLURM_PROCID": str(k)} | more


def filled(argv: list[str], env: dict[str, str]):
    a = build_parser().parse_args([*argv, "train.py"])
    slurm_step.fill(a, env)
    return a


def test_task_k_of_a_step_is_node_k_of_one_job():
    for k in (0, 1):
        a = filled(["--nproc-per-node", "4"], task(k))
        assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == (2, k, "node07", 18456)


def test_master_port_and_addr_given_are_kept():
    a = filled(["--master-addr", "10.0.0.7", "--master-port", "29500"], task(1))
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == (2, 1, "10.0.0.7", 29500)


def test_master_addr_and_port_from_the_environment_as_for_srun_ranks():
    a = filled([], task(0, MASTER_PORT="29400", MASTER_ADDR="10.0.0.9"))
    assert (a.master_addr, a.master_port) == ("10.0.0.9", 29400)


def test_flags_that_agree_with_the_step_are_accepted():
    a = filled(["--nnodes", "2", "--node-rank", "1"], task(1))
    assert (a.nnodes, a.node_rank) == (2, 1)


def test_nnodes_that_contradicts_the_step_is_refused():
    with pytest.raises(ArgumentError) as err:
        filled(["--nnodes", "1"], task(1))
    words = str(err.value)
    assert "--nnodes=1" in words and "srun started 2 launchers in step 123456.0" in words
    assert "2 separate jobs side by side" in words and "--ntasks 1" in words


def test_node_rank_expanded_once_in_the_batch_script_is_refused():
    with pytest.raises(ArgumentError) as err:
        filled(["--node-rank", "0"], task(1))  # srun ... --node-rank $SLURM_NODEID
    words = str(err.value)
    assert "--node-rank=0" in words and "this one task 1 (SLURM_PROCID)" in words
    assert "expanded once, before srun" in words


def test_a_node_list_without_a_first_host_is_refused_naming_master_addr():
    with pytest.raises(ArgumentError, match="--master-addr.*SLURM_STEP_NODELIST='node\\[07-'"):
        filled([], task(0, SLURM_STEP_NODELIST="node[07-"))


@pytest.mark.parametrize("env", [{}, task(0, SLURM_STEP_NUM_TASKS="1"),
                                 {k: v for k, v in task(0).items()
                                  if k != "SLURM_STEP_NUM_TASKS"}])
def test_outside_a_step_of_several_tasks_the_one_node_defaults(env):
    a = filled([], env)
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == (1, 0, None, None)
    b = filled(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port",
                "5"], env)
    assert (b.nnodes, b.node_rank) == (2, 1)


def test_check_args_fills_from_the_step(monkeypatch, tmp_path):
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(os, "environ", task(1))
    a = build_parser().parse_args([str(tmp_path / "train.py")])
    check_args(a)
    assert (a.nnodes, a.node_rank, a.master_addr) == (2, 1, "node07")


def test_signal_words_outside_slurm_say_nothing():
    assert slurm_step.signal_words({}) == ""


def test_signal_words_in_a_step_ask_slurm(tmp_path, monkeypatch):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'JobId=123456 JobState=COMPLETING Reason=None "
                        "RunTime=00:00:04 TimeLimit=UNLIMITED'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    words = slurm_step.signal_words(task(0))
    assert words == " (Slurm cancelled job 123456 (scancel), 4 s after it started)"
