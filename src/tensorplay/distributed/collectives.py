"""Collectives on our ProcessGroups, run by the group's engine; torch tensors and numpy arrays.

Each call resolves its group, checks what is the same for every engine (membership, src and
dst ranks, who passes the lists) and hands the rest to the collectives the engine bound to the
group (``group.ops``, a ``protocol.GroupOps``), which check and move the buffers. ``src``/``dst``
are global ranks, as in torch.distributed. In a simulated world every collective returns at
once, after the same checks.
"""

from __future__ import annotations

from typing import Any

from .backends import arrays
from .control import keys
from .errors import bad_argument, check_int
from .job import progress
from .job.lifecycle import current_world, resolve_group
from .job.watch import unless_told
from .process_group import ProcessGroup, ReduceOp, Work


def _rank_arg(name: str, rank: object, group: ProcessGroup) -> int:
    """Check that a global src/dst rank is a member of ``group``."""
    rank = check_int(name, rank, "pass one of the group's ranks", "int global rank")
    if group.group_rank(rank) is None:
        raise bad_argument(
            name, rank, f"is not a member of {group.label}",
            f"pass one of the group's global ranks (size {group.size()})",
        )
    return rank


@progress.entry("all_reduce()", group="pg")
def all_reduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group; every member gets the result in place."""
    pg = group if type(group) is ProcessGroup else resolve_group(group, "all_reduce()")
    ops = pg.ops  # the hottest call of a training step: one attribute, then the engine
    if ops is None:
        ops = pg.usable("all_reduce()")
    pg.calls += 1
    return ops.all_reduce(tensor, op, async_op)


@progress.entry("broadcast()", group="pg")
def broadcast(tensor: Any, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Work | None:
    """Copy global rank ``src``'s ``tensor`` to every member."""
    pg = resolve_group(group, "broadcast()")
    src = _rank_arg("src", src, pg)
    ops = pg.usable("broadcast()")
    pg.calls += 1
    return ops.broadcast(tensor, src, async_op)


@progress.entry("reduce()", group="pg")
def reduce(tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group into global rank ``dst``'s tensor."""
    pg = resolve_group(group, "reduce()")
    dst = _rank_arg("dst", dst, pg)
    ops = pg.usable("reduce()")
    pg.calls += 1
    return ops.reduce(tensor, dst, op, async_op)


@progress.entry("all_gather()", group="pg")
def all_gather(tensor_list: list, tensor: Any, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Fill ``tensor_list[i]`` with group rank i's ``tensor``."""
    pg = resolve_group(group, "all_gather()")
    ops = pg.usable("all_gather()")
    pg.calls += 1
    return ops.all_gather(tensor_list, tensor, async_op)


@progress.entry("all_gather_into_tensor()", group="pg")
def all_gather_into_tensor(output_tensor: Any, input_tensor: Any,
                           group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """Concatenate every member's ``input_tensor`` (group order) into ``output_tensor``.

    Any output shape with the right number of elements works: (size * n,) or (size, n).
    """
    pg = resolve_group(group, "all_gather_into_tensor()")
    ops = pg.usable("all_gather_into_tensor()")
    pg.calls += 1
    return ops.all_gather_into_tensor(
        output_tensor, input_tensor, async_op)


@progress.entry("reduce_scatter_tensor()", group="pg")
def reduce_scatter_tensor(output: Any, input: Any, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """Reduce ``input`` across members; group rank i gets the i-th equal chunk in ``output``."""
    pg = resolve_group(group, "reduce_scatter_tensor()")
    ops = pg.usable("reduce_scatter_tensor()")
    pg.calls += 1
    return ops.reduce_scatter_tensor(
        output, input, op, async_op)


@progress.entry("all_to_all_single()", group="pg")
def all_to_all_single(
    output: Any, input: Any, output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None, group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0, send chunk i to group rank i, gather chunks into ``output``."""
    pg = resolve_group(group, "all_to_all_single()")
    ops = pg.usable("all_to_all_single()")
    pg.calls += 1
    return ops.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op)


@progress.entry("gather()", group="pg")
def gather(tensor: Any, gather_list: list | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    pg = resolve_group(group, "gather()")
    dst = _rank_arg("dst", dst, pg)
    ops = pg.usable("gather()")
    if pg.group_rank(dst) == pg.rank():
        arrays.check_count("gather_list", gather_list, pg.size())
    elif gather_list:
        raise bad_argument("gather_list", "<list>", f"is only used on dst={dst}",
                           "pass gather_list=None on the other ranks")
    else:
        gather_list = None
    pg.calls += 1
    return ops.gather(tensor, gather_list, dst, async_op)


@progress.entry("scatter()", group="pg")
def scatter(tensor: Any, scatter_list: list | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Send ``scatter_list[i]`` on global rank ``src`` to group rank i's ``tensor``."""
    pg = resolve_group(group, "scatter()")
    src = _rank_arg("src", src, pg)
    ops = pg.usable("scatter()")
    if pg.group_rank(src) == pg.rank():
        arrays.check_count("scatter_list", scatter_list, pg.size())
    else:
        scatter_list = None
    pg.calls += 1
    return ops.scatter(tensor, scatter_list, src, async_op)


@progress.entry("send()", group="pg")
def send(tensor: Any, dst: int, group: ProcessGroup | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    pg = resolve_group(group, "send()")
    dst = _rank_arg("dst", dst, pg)
    pg.usable("send()", make=False).send(tensor, dst)  # point to point: not counted per group


@progress.entry("recv()", group="pg")
def recv(tensor: Any, src: int, group: ProcessGroup | None = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (blocking); returns ``src``."""
    pg = resolve_group(group, "recv()")
    src = _rank_arg("src", src, pg)
    pg.usable("recv()", make=False).recv(tensor, src)
    return src


@progress.entry("barrier()", group="pg")
def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Wait until every member of ``group`` has reached this call.

    A blocking barrier that times out names the members that never came (the control plane's
    ``arrivals``: on a store, a member whose wait lasts posts its arrival; a quick barrier
    writes nothing).
    """
    pg = resolve_group(group, "barrier()")
    ops = pg.usable("barrier()")
    world = current_world("barrier()")
    pg.calls += 1
    if async_op:
        return ops.barrier(True)
    n = world.spmd.next(keys.BARRIER_COUNT.format(group=pg.name))
    step = f"barrier() #{n} on {pg.label}"
    with world.control.arrivals(step, pg.name, pg.ranks, n):
        return unless_told(step, world, pg.backend, lambda: ops.barrier(False))
