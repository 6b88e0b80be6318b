"""Who is who among a job's launchers: a node's name and ranks, and the elastic news of nodes
lost and taken back, posted once and read by every launcher (launcher/roster.py)."""

from __future__ import annotations

from tensorplay.distributed.launcher.roster import Node, NodeChange, Roster
from tests.distributed.launcher.memory_store import MemoryStore, client


def test_a_node_is_named_by_its_index_host_and_ranks():
    assert Node(1, "hostB", 4, 2).name() == "node 1 (hostB, ranks 4-7)"
    assert Node(2, "hostC", 1, 3).name() == "node 2 (hostC, rank 2)"
    assert Roster(3, 2).node(2).name() == "node 2 (?, ranks 4-5)"  # not joined yet


def test_a_loss_and_a_taking_back_are_news_every_launcher_reads_once():
    raw = MemoryStore()
    zero, one = Roster(2, 4), Roster(2, 4)
    zero.nodes = {0: Node(0, "hostA", 4, 2), 1: Node(1, "hostB", 4, 2)}
    lost = zero.lose(1, 1, "went silent", client(raw))
    assert lost == NodeChange("lost", 1, 1, "hostB", [4, 5, 6, 7],
                              "node 1 (hostB, ranks 4-7) is lost: went silent")
    assert zero.lose(1, 1, "went silent", client(raw)) is None  # posted once
    assert zero.lost == {1}
    back = NodeChange("back", 1, 2, "hostC", [4, 5, 6, 7], "node 1 is back")
    one.tell(back, client(raw))
    news = zero.read_news(client(raw))  # its own loss too: every launcher reads every item
    assert news == [lost, back] and zero.read_news(client(raw)) == []
    assert not zero.take(lost) and zero.take(back) and not zero.take(back)
    assert zero.live == {0: 1, 1: 2} and zero.lost == set()
    assert zero.beat_key(1) == "tensorplay-run/beat/1/2" and zero.node(1).host == "hostC"
    assert [c.kind for c in one.read_news(client(raw))] == ["lost", "back"]
