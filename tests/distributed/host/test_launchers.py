"""Tests for tensorplay.distributed.host.launchers: launcher detection from explicit
environment dicts (torchrun, Slurm, Open MPI, MPICH), their precedence and their errors."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest

from tensorplay.distributed.errors import LaunchEnvError
from tensorplay.distributed.host import launchers
from tensorplay.distributed.host.launchers import (
    LAUNCHERS,
    LaunchEnv,
    Launcher,
    agent_store_attempt,
    detect,
    local_rank_from_env,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}

SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}

OMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "16",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}

HYDRA = {"PMI_RANK": "9", "PMI_SIZE": "12", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}


def env_of(*parts: dict[str, str], **extra: str) -> dict[str, str]:
    """Merge launcher dicts and extra variables into one environment."""
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    merged.update(extra)
    return merged


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    """A copy of env with names removed."""
    return {k: v for k, v in env.items() if k not in names}


@contextlib.contextmanager
def raises_naming(*needles: str):
    """Expect a LaunchEnvError whose message contains every needle, in any order."""
    with pytest.raises(LaunchEnvError) as caught:
        yield caught
    missing = [n for n in needles if n not in str(caught.value)]
    assert not missing, f"{missing} not in message: {caught.value}"


# --- no launcher ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PATH": "/usr/bin", "HOME": "/root"},
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
        {"LOCAL_RANK": "0"},
        {"RANK": "", "WORLD_SIZE": "  "},
        # a Slurm batch script run without srun: job variables but no step
        {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"},
    ],
)
def test_no_launcher_gives_none(env):
    assert detect(env) is None


def test_detect_reads_os_environ_by_default(monkeypatch):
    launcher_prefixes = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "TENSORPLAY_")
    for name in list(os.environ):
        if name.startswith((*launcher_prefixes, "SLURM_", "OMPI_", "PMI_", "MPI_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect() == LaunchEnv(1, 2, None, None, None, None, "env")


# --- torchrun / tensorplay-run / env:// -------------------------------------------------------


def test_torchrun():
    assert detect(TORCHRUN) == LaunchEnv(
        rank=3,
        world_size=8,
        local_rank=1,
        local_world_size=2,
        master_addr="10.0.0.1",
        master_port=29500,
        source="torchrun",
    )


def test_tensorplay_run_source_beats_torchelastic_marker():
    env = env_of(TORCHRUN, TENSORPLAY_LAUNCHER="tensorplay-run")
    assert detect(env).source == "tensorplay-run"


def test_plain_env_with_only_rank_and_world_size():
    launch = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert launch == LaunchEnv(0, 1, None, None, None, None, "env")


def test_unknown_tensorplay_launcher_value_is_plain_env():
    env = {"RANK": "0", "WORLD_SIZE": "2", "TENSORPLAY_LAUNCHER": "other"}
    assert detect(env).source == "env"


def test_values_are_stripped():
    launch = detect({"RANK": " 2 ", "WORLD_SIZE": "4\n", "MASTER_ADDR": " host "})
    assert (launch.rank, launch.world_size, launch.master_addr) == (2, 4, "host")


# --- Slurm --------------------------------------------------------------------------------------


def test_srun():
    assert detect(SRUN) == LaunchEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        master_addr="gpu007",
        master_port=launchers.SLURM_PORT_BASE + 123456 % launchers.SLURM_PORT_SPAN,
        source="slurm",
    )


def test_srun_master_port_is_the_same_on_every_task():
    ports = {detect(env_of(SRUN, SLURM_PROCID=str(r))).master_port for r in range(8)}
    assert ports == {18456}


def test_srun_master_addr_and_port_from_env_win():
    launch = detect(env_of(SRUN, MASTER_ADDR="head", MASTER_PORT="4000"))
    assert (launch.master_addr, launch.master_port) == ("head", 4000)


def test_srun_without_job_id_has_no_port():
    assert detect(without(SRUN, "SLURM_JOB_ID")).master_port is None


def test_srun_without_nodelist_has_no_address():
    launch = detect(without(SRUN, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    assert launch.master_addr is None


def test_srun_step_nodelist_beats_job_nodelist():
    env = env_of(SRUN, SLURM_STEP_NODELIST="b[2-3]", SLURM_JOB_NODELIST="a[1-4]")
    assert detect(env).master_addr == "b2"


def test_srun_job_nodelist_when_no_step_nodelist():
    env = env_of(without(SRUN, "SLURM_STEP_NODELIST"), SLURM_JOB_NODELIST="a1,b2")
    assert detect(env).master_addr == "a1"


@pytest.mark.parametrize("name", ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"])
def test_srun_world_size_from_any_task_count(name):
    env = without(SRUN, *launchers.SLURM_SIZE_VARS)
    assert detect(env_of(env, **{name: "6"})).world_size == 6


def test_srun_step_task_count_beats_job_task_count():
    env = env_of(SRUN, SLURM_STEP_NUM_TASKS="6", SLURM_NTASKS="32")
    assert detect(env).world_size == 6


@pytest.mark.parametrize(
    ("name", "value", "node", "expected"),
    [
        ("SLURM_NTASKS_PER_NODE", "4", "1", 4),
        ("SLURM_NTASKS_PER_NODE", "4(x2)", "1", 4),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x2)", "0", 4),
        ("SLURM_TASKS_PER_NODE", "3,2", "0", 3),
        ("SLURM_TASKS_PER_NODE", "3(x2),2", "2", 2),
        ("SLURM_TASKS_PER_NODE", "3,2", "5", None),  # node id past the list: unknown
    ],
)
def test_srun_local_world_size_forms(name, value, node, expected):
    env = without(SRUN, *launchers.SLURM_TASKS_PER_NODE_VARS)
    env = env_of(env, SLURM_NODEID=node, SLURM_LOCALID="0", **{name: value})
    assert detect(env).local_world_size == expected


def test_srun_uneven_tasks_without_node_id_is_unknown():
    env = without(SRUN, *launchers.SLURM_TASKS_PER_NODE_VARS, "SLURM_NODEID")
    assert detect(env_of(env, SLURM_TASKS_PER_NODE="3,2")).local_world_size is None


def test_srun_step_tasks_per_node_beats_requested_count():
    env = env_of(SRUN, SLURM_STEP_TASKS_PER_NODE="2(x4)", SLURM_NTASKS_PER_NODE="8")
    assert detect(env).local_world_size == 2


@pytest.mark.parametrize("marker", launchers.SLURM_STEP_VARS)
def test_any_step_variable_marks_an_srun_step(marker):
    batch = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect(batch) is None
    assert detect(env_of(batch, **{marker: "1"})).source == "slurm"


# --- Open MPI and MPICH ------------------------------------------------------------------------


def test_openmpi():
    assert detect(OMPI) == LaunchEnv(6, 16, 2, 4, None, None, "openmpi")


def test_openmpi_with_forwarded_master():
    launch = detect(env_of(OMPI, MASTER_ADDR="node1", MASTER_PORT="29400"))
    assert (launch.master_addr, launch.master_port) == ("node1", 29400)


def test_mpich_hydra():
    assert detect(HYDRA) == LaunchEnv(9, 12, 1, 3, None, None, "mpich")


def test_mpich_with_forwarded_master():
    launch = detect(env_of(HYDRA, MASTER_ADDR="node1", MASTER_PORT="29400"))
    assert (launch.master_addr, launch.master_port, launch.source) == ("node1", 29400, "mpich")


def test_mpi_without_local_variables():
    launch = detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (launch.local_rank, launch.local_world_size) == (None, None)


# --- precedence --------------------------------------------------------------------------------


def test_torchrun_inside_srun_uses_rank_and_world_size():
    launch = detect(env_of(SRUN, TORCHRUN))
    assert (launch.rank, launch.world_size, launch.source) == (3, 8, "torchrun")
    assert launch.master_addr == "10.0.0.1"


def test_env_variables_beat_broken_scheduler_variables():
    broken = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "a1", "OMPI_COMM_WORLD_RANK": "x"}
    assert detect(env_of(broken, RANK="0", WORLD_SIZE="1")).source == "env"


def test_env_beats_openmpi_and_mpich():
    assert detect(env_of(OMPI, HYDRA, RANK="0", WORLD_SIZE="2")).source == "env"


def test_openmpi_beats_mpich():
    assert detect(env_of(HYDRA, OMPI)).source == "openmpi"


def test_srun_with_agreeing_pmi_variables_is_slurm():
    pmi = {"PMI_RANK": SRUN["SLURM_PROCID"], "PMI_SIZE": SRUN["SLURM_NTASKS"]}
    launch = detect(env_of(SRUN, pmi))
    assert (launch.source, launch.master_addr) == ("slurm", "gpu007")


def test_mpirun_inside_allocation_beats_disagreeing_slurm_step():
    # mpirun's remote daemons are started by srun: ranks see a step of one task per node.
    daemon_step = env_of(SRUN, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2")
    launch = detect(env_of(daemon_step, OMPI))
    assert (launch.source, launch.rank, launch.world_size) == ("openmpi", 6, 16)


def test_mpi_beats_unusable_slurm_step():
    launch = detect(env_of({"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "a1"}, HYDRA))
    assert launch.source == "mpich"


def test_slurm_beats_unusable_mpi_variables():
    assert detect(env_of(SRUN, PMI_RANK="5")).source == "slurm"


def test_chosen_source_and_shadowed_launcher_are_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="tensorplay.distributed")
    launchers._announce.cache_clear()
    detect(env_of(SRUN, TORCHRUN, RANK="2"))
    text = caplog.text
    assert "launcher: torchrun (rank 2 of 8)" in text
    assert "slurm says rank 5 of 8, ignored" in text


def test_same_outcome_is_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="tensorplay.distributed")
    launchers._announce.cache_clear()
    env = {"RANK": "4", "WORLD_SIZE": "7"}
    assert detect(env) == detect(env)
    assert caplog.text.count("launcher: env (rank 4 of 7)") == 1


# --- incomplete sets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"RANK": "1"}, ["RANK='1'", "WORLD_SIZE"]),
        ({"WORLD_SIZE": "4"}, ["WORLD_SIZE='4'", "RANK"]),
        (
            {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "a1"},
            ["SLURM_PROCID='1'", "SLURM_NTASKS", "srun"],
        ),
        ({"OMPI_COMM_WORLD_RANK": "2"}, ["OMPI_COMM_WORLD_RANK='2'", "OMPI_COMM_WORLD_SIZE"]),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_SIZE='2'", "OMPI_COMM_WORLD_RANK"]),
        ({"PMI_RANK": "0"}, ["PMI_RANK='0'", "PMI_SIZE"]),
        ({"PMI_SIZE": "3"}, ["PMI_SIZE='3'", "PMI_RANK"]),
    ],
)
def test_incomplete_sets_name_present_and_missing(env, needles):
    with raises_naming("incomplete", *needles, "Fix:"):
        detect(env)


# --- contradictory values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"RANK": "8", "WORLD_SIZE": "8"}, ["RANK=8", "WORLD_SIZE=8", "0..7"]),
        ({"RANK": "-1", "WORLD_SIZE": "8"}, ["RANK=-1", ">= 0"]),
        ({"RANK": "one", "WORLD_SIZE": "8"}, ["RANK='one'", "not an integer"]),
        ({"RANK": "1.0", "WORLD_SIZE": "8"}, ["RANK='1.0'", "not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0", ">= 1"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK='x'"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-2"}, ["LOCAL_RANK=-2"]),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE=0"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, ["MASTER_PORT='0'", "1..65535"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65536"}, ["MASTER_PORT='65536'"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "-5"}, ["MASTER_PORT='-5'"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
        (env_of(SRUN, SLURM_PROCID="8"), ["SLURM_PROCID=8", "SLURM_STEP_NUM_TASKS=8"]),
        (env_of(SRUN, SLURM_LOCALID="4"), ["SLURM_LOCALID=4", "SLURM_STEP_TASKS_PER_NODE"]),
        (env_of(SRUN, SLURM_STEP_TASKS_PER_NODE="four"), ["SLURM_STEP_TASKS_PER_NODE='four'"]),
        (env_of(SRUN, SLURM_STEP_TASKS_PER_NODE="0(x2)"), ["SLURM_STEP_TASKS_PER_NODE='0(x2)'"]),
        (env_of(SRUN, SLURM_STEP_NODELIST="gpu[01-02"), ["SLURM_STEP_NODELIST='gpu[01-02'"]),
        (env_of(SRUN, SLURM_JOB_ID="abc"), ["SLURM_JOB_ID='abc'"]),
        (env_of(OMPI, OMPI_COMM_WORLD_RANK="16"), ["OMPI_COMM_WORLD_RANK=16", "SIZE=16"]),
        (env_of(OMPI, OMPI_COMM_WORLD_LOCAL_RANK="4"), ["LOCAL_RANK=4", "LOCAL_SIZE=4"]),
        (env_of(HYDRA, PMI_RANK="12"), ["PMI_RANK=12", "PMI_SIZE=12"]),
        (env_of(HYDRA, MPI_LOCALRANKID="3"), ["MPI_LOCALRANKID=3", "MPI_LOCALNRANKS=3"]),
    ],
)
def test_contradictory_values_name_variables_and_values(env, needles):
    with raises_naming(*needles) as caught:
        detect(env)
    assert "Fix:" in str(caught.value)


def test_launch_env_error_is_a_value_error():
    with pytest.raises(ValueError):
        detect({"RANK": "1"})


# --- LOCAL_RANK, torchrun's agent store ------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"LOCAL_RANK": "3"}, 3),
        (TORCHRUN, 1),
        (SRUN, 1),
        (OMPI, 2),
        (HYDRA, 1),
        (env_of(OMPI, LOCAL_RANK="0"), 0),
        ({"RANK": "0", "WORLD_SIZE": "1"}, None),
    ],
)
def test_local_rank_from_env(env, expected):
    assert local_rank_from_env(env) == expected


def test_local_rank_from_env_rejects_garbage():
    with raises_naming("LOCAL_RANK='gpu0'"):
        local_rank_from_env({"LOCAL_RANK": "gpu0"})


def test_torchrun_agent_store_attempt():
    assert agent_store_attempt({}) is None
    assert agent_store_attempt({"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert agent_store_attempt({"TORCHELASTIC_USE_AGENT_STORE": "True"}) == 0
    assert agent_store_attempt(
        {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}) == 2


def test_the_mpi_launchers_differ_in_their_variables_only():
    openmpi, mpich = LAUNCHERS[2:]
    assert (openmpi.name, openmpi.rank_var, openmpi.size_vars) == (
        "openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",))
    assert mpich.fix == "start the processes with mpiexec, which sets PMI_RANK and PMI_SIZE."
    assert type(openmpi) is type(mpich) is Launcher


def test_launchers_are_tried_in_the_documented_order():
    assert [launcher.name for launcher in LAUNCHERS] == ["env", "slurm", "openmpi", "mpich"]
