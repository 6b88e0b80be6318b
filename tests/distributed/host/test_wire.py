"""The launcher's record of lost nodes as ranks read it (``host/wire.py``), and what reads it: the
join tokens of a lost node's processes are dead (``elastic/chain._gone``); and the ranks' etcd
store under ``tensorplay-run --store etcd``."""

from __future__ import annotations

import json

import pytest

from tensorplay.distributed.elastic import chain
from tensorplay.distributed.errors import LaunchEnvError
from tensorplay.distributed.host import wire

LOSS = {"node": 1, "claim": 1, "ranks": [4, 5, 6, 7], "replaced": False,
        "text": "node 1 (hostB, ranks 4-7) is lost: its launcher is gone"}


def _told(monkeypatch, tmp_path, losses, verdict=None):
    path = tmp_path / "losses"
    wire.write(str(path), losses)
    monkeypatch.setenv(wire.LOSSES_FILE, str(path))
    if verdict is not None:
        (tmp_path / "verdict").write_text(json.dumps(verdict))
        monkeypatch.setenv(wire.VERDICT_FILE, str(tmp_path / "verdict"))
    else:
        monkeypatch.delenv(wire.VERDICT_FILE, raising=False)


def test_outside_tensorplay_run_nothing_is_lost(monkeypatch):
    monkeypatch.delenv(wire.LOSSES_FILE, raising=False)
    monkeypatch.delenv(wire.VERDICT_FILE, raising=False)
    assert (wire.read(), wire.lost_ranks(), wire.told_lost()) == ([], [], [])
    assert wire.naming([0, 4]) is None
    assert not wire.gone("977 hostB 1.1")


def test_a_lost_node_s_ranks_are_dead_until_a_launcher_takes_it_back(monkeypatch, tmp_path):
    _told(monkeypatch, tmp_path, [LOSS])
    assert wire.lost_ranks() == [4, 5, 6, 7]
    assert wire.naming([0, 1, 2, 3]) is None
    assert wire.naming([3, 5])["text"] == LOSS["text"]
    _told(monkeypatch, tmp_path, [{**LOSS, "replaced": True}])
    assert wire.lost_ranks() == []
    assert wire.naming([3, 5]) is None


def test_join_tokens_of_a_lost_launcher_are_dead_those_of_its_replacement_alive(
        monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORPLAY_HOSTNAME", "hostA")  # the deciding member runs on host A
    _told(monkeypatch, tmp_path, [{**LOSS, "replaced": True}])
    assert wire.gone("977 hostB 1.1") and chain._gone("977 hostB 1.1")
    assert not wire.gone("1204 hostB 1.2") and not chain._gone("1204 hostB 1.2")
    assert not chain._gone("977 hostB")  # a token without its launcher (one node): alive


def test_the_end_of_job_waits_for_no_rank_the_launcher_said_is_gone(monkeypatch, tmp_path):
    _told(monkeypatch, tmp_path, [LOSS, {**LOSS, "node": 2, "claim": 1, "ranks": [8, 9],
                                         "replaced": True}],
          verdict={"text": "node 3 (hostD, ranks 12-15) went silent", "ranks": [12, 13]})
    assert wire.told_lost() == [4, 5, 6, 7, 12, 13]


def test_ranks_admitted_from_a_new_launcher_are_not_named_before_the_launcher_hears_of_it(
        monkeypatch, tmp_path):
    # node 1's second launcher (claim 2) started ranks 4-7 and the members admitted them, but
    # this rank's launcher has not yet marked the loss of "1.1" replaced
    _told(monkeypatch, tmp_path, [LOSS])
    again = {4: "1.2", 5: "1.2", 6: "1.2", 7: "1.2"}
    assert wire.lost_ranks(again) == []
    assert wire.naming(range(8), again) is None
    assert wire.lost_ranks({4: "1.2"}) == [5, 6, 7]  # only rank 4 is known to be new
    assert wire.naming([0, 5], {4: "1.2"})["text"] == LOSS["text"]
    assert wire.lost_ranks({4: "1.1"}) == [4, 5, 6, 7]  # admitted from the lost launcher
    assert wire.instance_of("1204 hostB 1.2") == "1.2"
    assert wire.instance_of("1204 hostB") == ""


def test_the_etcd_store_of_the_ranks_is_read_from_its_variable():
    env = {wire.STORE: "etcd://10.0.0.1:29500,10.0.0.2:29502/jobs/j1/ranks/"}
    assert wire.etcd_store(env) == (["10.0.0.1:29500", "10.0.0.2:29502"], "jobs/j1/ranks/")
    assert wire.etcd_store({wire.STORE: "etcd://127.0.0.1:2379/"}) == (["127.0.0.1:2379"], "")
    assert wire.etcd_store({}) is None


@pytest.mark.parametrize("bad", ["127.0.0.1:2379/ranks/", "etcd://127.0.0.1:2379",
                                 "etcd://host/ranks/", "etcd:///ranks/"])
def test_a_malformed_etcd_store_names_the_variable_and_the_fix(bad):
    with pytest.raises(LaunchEnvError) as caught:
        wire.etcd_store({wire.STORE: bad})
    assert "TENSORPLAY_RUN_STORE" in str(caught.value) and "Fix:" in str(caught.value)
