"""The launch spec: the command line read once into a frozen LaunchSpec; each rank's env."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from tensorplay.distributed.launcher.options import parse_rank_list
from tensorplay.distributed.launcher.spec import child_env, parse_args


def test_child_env_sets_torchrun_variables_and_keeps_base():
    env = child_env({"PATH": "/bin", "RANK": "99"}, rank=5, local_rank=1, world_size=8,
                    local_world_size=4, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert (env["GROUP_RANK"], env["NODE_RANK"]) == ("1", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert env["PYTHONUNBUFFERED"] == "1" and env["TENSORPLAY_LAUNCHER"] == "tensorplay-run"
    assert all(isinstance(v, str) for v in env.values())


def test_child_env_sets_one_omp_thread_per_rank_unless_the_user_chose():
    def omp(base: dict, local_world_size: int) -> str | None:
        return child_env(base, rank=0, local_rank=0, world_size=8, node_rank=0,
                         local_world_size=local_world_size, master_addr="h",
                         master_port=1).get("OMP_NUM_THREADS")

    assert omp({}, 4) == "1"  # as torchrun does
    assert omp({"OMP_NUM_THREADS": "3"}, 4) == "3"
    assert omp({}, 1) is None  # one rank per node: nothing to share


def test_parse_rank_list_accepts_lists_and_ranges():
    assert parse_rank_list("0,3", 4) == {0, 3}
    assert parse_rank_list("0-2, 5", 8) == {0, 1, 2, 5}


def test_the_spec_is_built_once_and_frozen(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("")
    spec = parse_args(["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "10.0.0.1", "--master-port", "29500",
                       "--log-ranks", "0-1", str(job), "--lr", "0.1"])
    assert (spec.world_size, list(spec.local_ranks), spec.global_rank(1)) == (8, [4, 5, 6, 7], 5)
    assert spec.shown == {0, 1} and spec.script_args == ("--lr", "0.1")
    assert spec.verdict_file is not None and spec.verdict_file.endswith("verdict")
    env = spec.rank_env(1)
    assert (env["RANK"], env["MASTER_ADDR"], env["TENSORPLAY_RUN_VERDICT_FILE"]) == (
        "5", "10.0.0.1", spec.verdict_file)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.master_port = 1  # type: ignore[misc]


def test_a_ranks_title_is_the_command_it_runs_after_its_rank(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("")
    python = os.path.basename(sys.executable)
    spec = parse_args(["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "10.0.0.1", "--master-port", "29500",
                       str(job), "--name", "a b", "--lr", "0.1"])
    line = f"{python} {job} --name 'a b' --lr 0.1"
    assert spec.script_line() == line
    assert spec.rank_title(1) == f"tensorplay-run rank 5/8: {line}"
    assert spec.rank_title(3, restart=2) == f"tensorplay-run rank 7/8 (restart 2): {line}"
    module = parse_args(["--nproc-per-node", "2", "-m", "mypkg.train", "--lr", "0.1"])
    assert module.rank_title(0) == f"tensorplay-run rank 0/2: {python} -m mypkg.train --lr 0.1"
    env = spec.rank_env(1)
    if sys.platform.startswith("linux"):
        assert (env["TENSORPLAY_RUN_TITLE"], env["TENSORPLAY_RUN_COMM"]) == (
            spec.rank_title(1), "rank 5")
    else:  # no /proc to write a title through
        assert "TENSORPLAY_RUN_TITLE" not in env and "TENSORPLAY_RUN_COMM" not in env


@pytest.mark.parametrize(("argv", "words"), [
    (["--store", "redis"], "--store='redis': is not a store"),
    (["--store", "etcd://hostonly"], "'hostonly' is not HOST:PORT"),
    (["--store", "etcd", "--nnodes", "3", "--store-replicas", "2"], "must be odd and in 1..3"),
    (["--store", "etcd", "--nnodes", "1", "--store-replicas", "3"], "must be odd and in 1..1"),
    (["--store-replicas", "3", "--nnodes", "3"], "needs --store etcd"),
    (["--store", "etcd://h:2379", "--store-replicas", "1"], "not for yours"),
])
def test_a_bad_store_flag_names_the_flag_and_the_fix(tmp_path, argv, words):
    from tensorplay.distributed.errors import ArgumentError

    job = tmp_path / "job.py"
    job.write_text("")
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--nproc-per-node", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                    "--master-port", "29500",
                    *argv, str(job)])
    assert words in str(caught.value) and "Fix:" in str(caught.value)


def test_without_the_etcd_client_store_etcd_says_what_to_install(tmp_path, monkeypatch):
    from tensorplay.distributed.backends import etcd
    from tensorplay.distributed.errors import ArgumentError

    monkeypatch.setattr(etcd, "missing_client", lambda: "the etcd client etcd3gw is not "
                        "installed (No module named 'etcd3gw'). Fix: x")
    job = tmp_path / "job.py"
    job.write_text("")
    with pytest.raises(ArgumentError) as caught:
        parse_args(["--nproc-per-node", "1", "--store", "etcd", str(job)])
    assert "etcd3gw is not installed" in str(caught.value)
    assert 'pip install -e ".[ha]"' in str(caught.value)


def test_under_etcd_the_ranks_get_the_store_and_no_agent_store(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("")
    spec = parse_args(["--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "1",
                       "--master-addr", "10.0.0.1", "--master-port", "29500",
                       "--store", "etcd", str(job)])
    assert (spec.store, spec.store_replicas) == ("etcd", 3)
    env = spec.rank_env(0, store_url="etcd://10.0.0.1:29500,10.0.0.2:29502/ranks/")
    assert env["TENSORPLAY_RUN_STORE"] == "etcd://10.0.0.1:29500,10.0.0.2:29502/ranks/"
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    tcp = parse_args(["--nproc-per-node", "2", str(job)])
    assert (tcp.store, "TENSORPLAY_RUN_STORE" in tcp.rank_env(0)) == ("tcp", False)
