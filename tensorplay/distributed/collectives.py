"""Collectives on our ProcessGroups, run by torch.distributed; torch tensors and numpy arrays.

A numpy array is wrapped as a tensor that shares its memory, so results land in the caller's
array without a copy (a non-contiguous array is copied in and out). ``src``/``dst`` are global
ranks, as in torch.distributed. In a fake world every collective returns at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import _arrivals
from .backends.torch_c10d import COALESCING, absent, allreduce_options
from .errors import (
    BackendError,
    DistributedTimeoutError,
    RankFailedError,
    bad_argument,
    bad_type,
)
from .process_group import ProcessGroup, ReduceOp, Work
from .world import current_world, resolve_group

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}
# keyed by id(): Enum hashing runs Python code, and the members are singletons
_TORCH_OPS_BY_ID = {id(ours): theirs for ours, theirs in _TORCH_OPS.items()}
_ALLREDUCE_OPTS_BY_ID = {id(ours): allreduce_options(theirs) for ours, theirs in _TORCH_OPS.items()}
_has_torch_function = torch._C._has_torch_function_unary
# torch 2.13 renamed the tensor forms; older releases only have the old names.
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GLOO_DTYPES = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
}


class _Buffer:
    """A tensor view of a user's tensor or numpy array, copied back after when needed."""

    __slots__ = ("copy_back", "tensor", "value")

    def __init__(self, value: Any, name: str, group: ProcessGroup):
        self.value = value
        self.copy_back = False
        if isinstance(value, torch.Tensor):  # the common case first: this runs on every call
            self.tensor = value if value.is_contiguous() else value.contiguous()
            self.copy_back = self.tensor is not value
        elif isinstance(value, np.ndarray):
            if not value.flags.writeable:
                raise bad_argument(
                    name, "<read-only ndarray>", "is read-only", "pass a writeable array"
                )
            if value.flags.c_contiguous:
                self.tensor = torch.from_numpy(value)
            else:
                self.tensor = torch.from_numpy(np.ascontiguousarray(value))
                self.copy_back = True
        else:
            raise bad_type(name, value, "torch.Tensor or numpy.ndarray", "pass a tensor or array")
        _check_device(self.tensor, name, group)

    def finish(self) -> None:
        """Copy the result back into a non-contiguous original."""
        if not self.copy_back:
            return
        if isinstance(self.value, np.ndarray):
            self.value[...] = self.tensor.numpy()
        else:
            self.value.copy_(self.tensor)


def _check_device(tensor: torch.Tensor, name: str, group: ProcessGroup) -> None:
    """Refuse tensors the group's backend cannot move."""
    if group.backend == "gloo":
        if not tensor.is_cpu:
            raise bad_argument(
                name, f"<tensor on {tensor.device}>", "gloo groups move CPU tensors only",
                "call .cpu() first, or use a 'cuda' mesh on the nccl backend",
            )
        if tensor.dtype not in _GLOO_DTYPES:
            raise bad_argument(
                name, f"<tensor of {tensor.dtype}>", "gloo cannot move this dtype",
                "convert to float32, float64, int32, int64, uint8, int8 or bool",
            )
    elif group.backend == "nccl" and not tensor.is_cuda:
        raise bad_argument(
            name, f"<tensor on {tensor.device}>", "nccl groups move CUDA tensors only",
            "move it with .cuda(), or use a 'cpu' mesh (gloo)",
        )


def _op(op: object) -> Any:
    torch_op = _TORCH_OPS_BY_ID.get(id(op))  # Enum hashing runs Python code; id() does not
    if torch_op is not None:
        return torch_op
    if isinstance(op, dist.ReduceOp.RedOpType):
        return op
    raise bad_type("op", op, "tensorplay ReduceOp", "pass e.g. ReduceOp.SUM")


def _rank_arg(name: str, rank: object, group: ProcessGroup) -> int:
    """Check that a global src/dst rank is a member of ``group``."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise bad_type(name, rank, "int global rank", "pass one of the group's ranks")
    if group.group_rank(rank) is None:
        raise bad_argument(
            name, rank, f"is not a member of the group {group.name}",
            f"pass one of the group's global ranks (size {group.size()})",
        )
    return rank


def _run(
    what: str,
    pg: ProcessGroup,
    async_op: bool,
    buffers: Sequence[_Buffer],
    call: Callable[[Any], Any],
) -> Work | None:
    """Run ``call(engine_group)`` on a member of the resolved group ``pg``.

    Engine failures become our timeout and rank-failure errors.
    """
    pg.require_member(what)
    if pg.engine_group is None:  # a fake world: nothing moves
        return Work() if async_op else None
    try:
        work = call(pg.engine_group)
        if async_op:
            return Work(_Guarded(work, what, pg), lambda: _finish(buffers))
    except RuntimeError as err:
        raise translate(err, what, pg) from err
    _finish(buffers)
    return None


def _finish(buffers: Sequence[_Buffer]) -> None:
    """Copy results back into the callers' non-contiguous tensors and arrays."""
    for buffer in buffers:
        buffer.finish()


class _Guarded:
    """Engine work whose wait() raises our errors."""

    def __init__(self, work: Any, what: str, group: ProcessGroup):
        self.work, self.what, self.group = work, what, group

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:
            raise translate(err, self.what, self.group) from err


def translate(err: RuntimeError, what: str, group: ProcessGroup) -> Exception:
    """Turn an engine's failure into a timeout or rank-failure error naming the group."""
    text = str(err)
    lowered = text.lower()
    timeout_s = current_world(what).timeout.total_seconds()
    members = group.ranks if group.size() <= 4096 else None
    if "timed out" in lowered or "timeout" in lowered:
        return DistributedTimeoutError(
            f"{what} on group {group.name}", timeout_s, None,
            f"Members: {members}. Engine said: {text.splitlines()[0][:300]}",
        )
    if any(s in lowered for s in ("connection", "closed", "reset by peer", "broken pipe")):
        return RankFailedError(
            f"{what} on group {group.name} failed: a peer rank died or its connection broke "
            f"(members {members}). Engine said: {text.splitlines()[0][:300]}. Fix: look for "
            f"the first rank that failed in the launcher's output."
        )
    return BackendError(f"{what} on group {group.name} failed: {text[:500]}")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group; every member gets the result in place."""
    pg = group if type(group) is ProcessGroup else resolve_group(group, "all_reduce()")
    engine = pg.engine_group  # set only on a member of a live real group (release() clears it)
    opts = _ALLREDUCE_OPTS_BY_ID.get(id(op))
    if (engine is not None and opts is not None and type(tensor) is torch.Tensor
            and not async_op and tensor.is_contiguous()
            and (tensor.is_cpu and tensor.dtype in _GLOO_DTYPES if pg.backend == "gloo"
                 else tensor.is_cuda and not tensor.is_complex())
            and not _has_torch_function(tensor) and not COALESCING):
        # The hottest call of a training step: a member's plain tensor that its group's
        # backend can move, with one of our ops. It goes to the c10d group itself, as
        # torch.distributed.all_reduce would after its own checks, which this one makes.
        # Every other call takes the path below, whose checks name what is wrong. Each
        # Python step here costs ~5x its idle time, right after a blocking call
        # (bench/mesh_init.py table (c)).
        try:
            engine.allreduce([tensor], opts).wait()
        except RuntimeError as err:
            raise translate(err, "all_reduce()", pg) from err
        return None
    torch_op = _op(op)
    buf = _Buffer(tensor, "tensor", pg)
    return _run("all_reduce()", pg, async_op, [buf], lambda g: dist.all_reduce(
        buf.tensor, op=torch_op, group=g, async_op=async_op))


def broadcast(tensor, src, group=None, async_op=False):
    """Copy global rank ``src``'s ``tensor`` to every member."""
    pg = resolve_group(group, "broadcast()")
    buf = _Buffer(tensor, "tensor", pg)
    src = _rank_arg("src", src, pg)
    return _run("broadcast()", pg, async_op, [buf], lambda g: dist.broadcast(
        buf.tensor, src=src, group=g, async_op=async_op))


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group into global rank ``dst``'s tensor."""
    pg = resolve_group(group, "reduce()")
    buf = _Buffer(tensor, "tensor", pg)
    dst = _rank_arg("dst", dst, pg)
    torch_op = _op(op)
    return _run("reduce()", pg, async_op, [buf], lambda g: dist.reduce(
        buf.tensor, dst=dst, op=torch_op, group=g, async_op=async_op))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Fill ``tensor_list[i]`` with group rank i's ``tensor``."""
    pg = resolve_group(group, "all_gather()")
    buf = _Buffer(tensor, "tensor", pg)
    outs = _buffer_list(tensor_list, "tensor_list", pg, pg.size())
    return _run("all_gather()", pg, async_op, outs, lambda g: dist.all_gather(
        [o.tensor for o in outs], buf.tensor, group=g, async_op=async_op))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenate every member's ``input_tensor`` (group order) into ``output_tensor``.

    Any output shape with the right number of elements works: (size * n,) or (size, n).
    """
    pg = resolve_group(group, "all_gather_into_tensor()")
    out = _Buffer(output_tensor, "output_tensor", pg)
    inp = _Buffer(input_tensor, "input_tensor", pg)
    _check_numel("output_tensor", out, inp.tensor.numel() * pg.size())
    return _run("all_gather_into_tensor()", pg, async_op, [out],
                lambda g: _GATHER_INTO(
                    out.tensor.view(-1), inp.tensor.view(-1), group=g, async_op=async_op))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` across members; group rank i gets the i-th equal chunk in ``output``."""
    pg = resolve_group(group, "reduce_scatter_tensor()")
    out = _Buffer(output, "output", pg)
    inp = _Buffer(input, "input", pg)
    _check_numel("input", inp, out.tensor.numel() * pg.size())
    torch_op = _op(op)
    return _run("reduce_scatter_tensor()", pg, async_op, [out],
                lambda g: _SCATTER_FROM(
                    out.tensor.view(-1), inp.tensor.view(-1), op=torch_op, group=g,
                    async_op=async_op))


def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
):
    """Split ``input`` along dim 0, send chunk i to group rank i, gather chunks into ``output``."""
    pg = resolve_group(group, "all_to_all_single()")
    out = _Buffer(output, "output", pg)
    inp = _Buffer(input, "input", pg)
    return _run("all_to_all_single()", pg, async_op, [out],
                lambda g: dist.all_to_all_single(
                    out.tensor, inp.tensor, output_split_sizes, input_split_sizes,
                    group=g, async_op=async_op))


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    pg = resolve_group(group, "gather()")
    buf = _Buffer(tensor, "tensor", pg)
    dst = _rank_arg("dst", dst, pg)
    is_dst = pg.group_rank(dst) == pg.rank()
    outs = _buffer_list(gather_list, "gather_list", pg, pg.size()) if is_dst else []
    if not is_dst and gather_list:
        raise bad_argument("gather_list", "<list>", f"is only used on dst={dst}",
                           "pass gather_list=None on the other ranks")
    return _run("gather()", pg, async_op, outs, lambda g: dist.gather(
        buf.tensor, [o.tensor for o in outs] if is_dst else None, dst=dst, group=g,
        async_op=async_op))


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """Send ``scatter_list[i]`` on global rank ``src`` to group rank i's ``tensor``."""
    pg = resolve_group(group, "scatter()")
    buf = _Buffer(tensor, "tensor", pg)
    src = _rank_arg("src", src, pg)
    is_src = pg.group_rank(src) == pg.rank()
    ins = _buffer_list(scatter_list, "scatter_list", pg, pg.size()) if is_src else []
    return _run("scatter()", pg, async_op, [buf], lambda g: dist.scatter(
        buf.tensor, [i.tensor for i in ins] if is_src else None, src=src, group=g,
        async_op=async_op))


def send(tensor, dst, group=None):
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    pg = resolve_group(group, "send()")
    buf = _Buffer(tensor, "tensor", pg)
    dst = _rank_arg("dst", dst, pg)
    _run("send()", pg, False, [], lambda g: dist.send(buf.tensor, dst=dst, group=g))


def recv(tensor, src, group=None):
    """Receive into ``tensor`` from global rank ``src`` (blocking); returns ``src``."""
    pg = resolve_group(group, "recv()")
    buf = _Buffer(tensor, "tensor", pg)
    src = _rank_arg("src", src, pg)
    _run("recv()", pg, False, [buf], lambda g: dist.recv(buf.tensor, src=src, group=g))
    return src


def barrier(group=None, async_op=False):
    """Wait until every member of ``group`` has reached this call.

    A blocking barrier that times out names the members that never came: a member whose wait
    lasts posts its arrival in the store (``_arrivals``; a quick barrier writes nothing).
    """
    pg = resolve_group(group, "barrier()")
    world = current_world("barrier()")
    if async_op or pg.engine_group is None:
        return _run("barrier()", pg, async_op, [],
                    lambda g: dist.barrier(group=g, async_op=async_op))
    pg.barriers += 1
    prefix = f"tensorplay/barrier/{pg.name}/{pg.barriers}/"
    mark = f"{prefix}{world.rank}"
    _arrivals.begin(world.store, mark)
    try:
        return _run("barrier()", pg, False, [], lambda g: dist.barrier(group=g))
    except DistributedTimeoutError as err:
        _arrivals.settle(world.store, mark)
        raise DistributedTimeoutError(
            f"barrier() #{pg.barriers} on group {pg.name}", err.timeout_s,
            absent(world.store, pg.ranks, prefix),
        ) from err
    finally:
        _arrivals.end()


def _buffer_list(values, name: str, group: ProcessGroup, count: int) -> list[_Buffer]:
    if not isinstance(values, list | tuple) or len(values) != count:
        raise bad_argument(
            name, f"<{type(values).__name__} of {len(values) if values is not None else 0}>",
            f"needs a list of {count} tensors or arrays (one per member)",
            f"pass {count} tensors shaped like the input",
        )
    return [_Buffer(v, f"{name}[{i}]", group) for i, v in enumerate(values)]


def _check_numel(name: str, buf: _Buffer, expected: int) -> None:
    if buf.tensor.numel() != expected:
        raise bad_argument(
            name, f"<{buf.tensor.numel()} elements>",
            f"needs {expected} elements (input size x group size)", "resize it",
        )
