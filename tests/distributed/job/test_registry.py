"""GroupRegistry: one epoch's groups, found by ordered ranks and backend, retired together."""

from __future__ import annotations

import pytest

from tensorplay.distributed.errors import StaleEpochError
from tensorplay.distributed.geometry.spec import Ranks
from tensorplay.distributed.job.registry import GroupRegistry
from tensorplay.distributed.process_group import ProcessGroup


class Severing:
    """A Severable engine that records what it is asked to break and close."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def prepare_elastic(self) -> None:
        """Nothing to set up."""

    def sever(self, engine_group: str) -> None:
        self.calls.append(("sever", engine_group))

    def close_group(self, engine_group: str) -> None:
        self.calls.append(("close", engine_group))


def _group(ranks: list[int], engine_group: str, rank: int = 1) -> ProcessGroup:
    return ProcessGroup(Ranks.of(ranks), rank, "gloo", engine_group, engine_group)


def test_a_group_is_found_by_its_ordered_ranks_and_backend_only():
    registry = GroupRegistry(epoch=0)
    group = _group([1, 5], "g15")
    assert registry.add(group) is group
    assert registry.find(Ranks.of([1, 5]), "gloo") is group
    assert registry.find(Ranks.of([5, 1]), "gloo") is None  # another order
    assert registry.find(Ranks.of([1, 5]), "nccl") is None  # another backend
    assert registry.groups() == [group]


def test_the_uses_of_a_group_are_noted_once_each_in_order():
    registry = GroupRegistry(epoch=0)
    group = registry.add(_group([0, 1], "g01"))
    for use in ("'dp' of (dp, tp)", "'ep' of (ep,)", "'dp' of (dp, tp)"):
        registry.note_use(group, use)
    assert registry.uses(group) == ["'dp' of (dp, tp)", "'ep' of (ep,)"]
    assert registry.uses(_group([1, 0], "g10")) == []  # another order: another group


def test_retiring_severs_and_closes_every_group_but_the_kept_one_and_hands_them_back():
    registry, engine = GroupRegistry(epoch=3), Severing()
    world = registry.add(_group([0, 1, 2, 3], "world"))
    for ranks, name in (([0, 1], "g01"), ([1, 3], "g13")):
        registry.add(_group(ranks, name))
    closed = registry.retire("belongs to epoch 3", engine, sever=True, keep=world)
    assert closed == ["g01", "g13"]
    assert engine.calls == [("sever", "g01"), ("close", "g01"), ("sever", "g13"),
                            ("close", "g13")]
    assert all(g.retired for g in registry.groups())  # the kept one too: its use says so
    with pytest.raises(StaleEpochError, match="belongs to epoch 3"):
        registry.groups()[1].usable("all_reduce()")
    assert registry.retire("again", engine, sever=True, keep=world) == []  # once only


def test_an_engine_that_cannot_sever_has_its_groups_retired_only():
    registry = GroupRegistry(epoch=0)
    registry.add(_group([0, 1], "g01"))
    assert registry.retire("over", None, sever=True, keep=None) == ["g01"]  # type: ignore[arg-type]
    assert registry.groups()[0].retired


def test_engine_meshes_and_flattened_names_are_kept_per_registry():
    registry = GroupRegistry(epoch=0)
    made = []
    mesh = ("cpu", "spec")
    first = registry.native_mesh(mesh, lambda: made.append(1) or object())
    assert registry.native_mesh(mesh, lambda: made.append(2) or object()) is first
    assert made == [1]
    registry.register_flatten(("root",), "dp_cp", (0, 1))
    assert registry.flattened_names(("root",)) == {"dp_cp": (0, 1)}
    assert registry.flattened_names(("other",)) == {}
    assert GroupRegistry(epoch=1).flattened_names(("root",)) == {}  # a new epoch knows none


def test_release_stops_every_group():
    registry = GroupRegistry(epoch=0)
    group = registry.add(_group([0, 1], "g01"))
    assert not registry.released
    registry.release()
    assert registry.released
    assert registry.find(Ranks.of([0, 1]), "gloo") is None and group.ops is None
