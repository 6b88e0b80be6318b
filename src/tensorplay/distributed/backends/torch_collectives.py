"""The collectives of one c10d group (``protocol.GroupOps``): torch tensors and numpy arrays.

A numpy array is wrapped as a tensor that shares its memory, so results land in the caller's
array without a copy (a non-contiguous array is copied in and out). all_reduce on a plain
contiguous tensor goes straight to the c10d group's ``allreduce`` (see ``all_reduce``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import DistributedError, bad_argument, bad_type
from ..process_group import ReduceOp, Work
from . import arrays

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def _allreduce_options(op: Any) -> Any:
    """c10d's options for a blocking all_reduce with ``op``, made once and reused per call."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.8 tells the engine the caller will wait
        opts.asyncOp = False
    return opts


# keyed by id(): Enum hashing runs Python code, and the members are singletons
_TORCH_OPS_BY_ID = {id(ours): theirs for ours, theirs in _TORCH_OPS.items()}
_ALLREDUCE_OPTS_BY_ID = {id(ours): _allreduce_options(theirs) for ours, theirs in
                         _TORCH_OPS.items()}
_AVG_ID = id(ReduceOp.AVG)
# how long a call on a breakable group waits before it looks whether the group was refused:
# a call that ends sooner pays nothing; a refused one fails at most this long after the sever
WAIT_SLICE = timedelta(seconds=0.2)
_has_torch_function = torch._C._has_torch_function_unary
# Groups inside torch's coalescing manager: a call there must be queued by torch's wrapper.
_COALESCING: dict = getattr(c10d._world, "pg_coalesce_state", {})
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

    def __init__(self, value: Any, name: str, backend: str):
        self.value = value
        self.copy_back = False
        if isinstance(value, torch.Tensor):  # the common case first: this runs on every call
            self.tensor = value if value.is_contiguous() else value.contiguous()
            self.copy_back = self.tensor is not value
        else:
            arrays.kind(name, value)  # a numpy array, or the error saying what it should be
            if value.flags.c_contiguous:
                self.tensor = torch.from_numpy(value)
            else:
                self.tensor = torch.from_numpy(np.ascontiguousarray(value))
                self.copy_back = True
        _check_device(self.tensor, name, backend)

    def finish(self) -> None:
        """Copy the result back into a non-contiguous original."""
        if not self.copy_back:
            return
        if isinstance(self.value, np.ndarray):
            self.value[...] = self.tensor.numpy()
        else:
            self.value.copy_(self.tensor)


def _check_device(tensor: torch.Tensor, name: str, backend: str) -> None:
    """Refuse tensors the group's backend cannot move."""
    if backend == "gloo":
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
    elif backend == "nccl" and not tensor.is_cuda:
        raise bad_argument(
            name, f"<tensor on {tensor.device}>", "nccl groups move CUDA tensors only",
            "move it with .cuda(), or use a 'cpu' mesh (gloo)",
        )


def _op(op: object, tensor: torch.Tensor) -> Any:
    """torch's op for ours, refusing an average of integers (torch would fail on a cast)."""
    torch_op = _TORCH_OPS_BY_ID.get(id(op))  # Enum hashing runs Python code; id() does not
    if torch_op is None:
        if not isinstance(op, dist.ReduceOp.RedOpType):
            raise bad_type("op", op, "tensorplay ReduceOp", "pass e.g. ReduceOp.SUM")
        torch_op = op
    if torch_op == dist.ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise bad_argument("op", "ReduceOp.AVG", f"cannot average {tensor.dtype} values",
                           "use ReduceOp.SUM and divide, or convert to a floating dtype")
    return torch_op


def _finish(buffers: Sequence[_Buffer]) -> None:
    """Copy results back into the callers' non-contiguous tensors and arrays."""
    for buffer in buffers:
        buffer.finish()


def _timed(err: Exception, since: float) -> Exception:
    """Our error for a failed call that began at ``since`` (time.monotonic()), with how long
    it waited (``DistributedError.waited_s``)."""
    if isinstance(err, DistributedError):
        err.waited_s = time.monotonic() - since
    return err


class _Guarded:
    """Engine work whose wait() raises our errors; ``waiter`` waits (``TorchGroupOps._wait``)."""

    def __init__(self, work: Any, what: str, failed: Callable[[BaseException, str], Exception],
                 since: float, waiter: Callable[[Any], None]):
        self.work, self.what, self.failed, self.since = work, what, failed, since
        self.waiter = waiter

    def wait(self) -> None:
        try:
            self.waiter(self.work)
        except (RuntimeError, ConnectionError) as err:
            raise _timed(self.failed(err, self.what), self.since) from None  # it quotes the
            # engine's words


# every call of GroupOps (tensorplay.distributed.backends.protocol): what refuse() stops
_CALLS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
          "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "send", "recv",
          "barrier")


class TorchGroupOps:
    """Collectives on one c10d group, called on a member of it.

    ``breakable`` (a gloo group of an elastic world): a call waits for its work in slices
    of WAIT_SLICE, and fails once ``refuse`` was called, even where gloo misses the shutdown
    of the group's sockets (seen: a rank that reached its ring all_reduce after the sever
    waited for a peer that had not broken its side). Calls that end within a slice pay one
    attribute check for it.
    """

    def __init__(self, engine_group: Any, backend: str, size: int,
                 failed: Callable[[BaseException, str], Exception], breakable: bool = False):
        self._group = engine_group
        self._backend = backend
        self._gloo = backend == "gloo"
        self._size = size
        self._failed = failed
        self._breakable = breakable and self._gloo
        self._why: str | None = None  # why the calls are refused (``refuse``)

    def refuse(self, why: str) -> None:
        """From now on every call raises at once what a broken connection raises, ``why``
        as the engine's words, and a call still waiting (``breakable``) raises it within a
        slice: the group's connections were broken on this rank (``TorchEngine.sever``).
        Done by shadowing the calls, so that the calls of a group never broken pay nothing
        for it."""
        self._why = why

        def refused(name: str) -> Callable[..., Any]:
            def call(*_args: Any, **_kwargs: Any) -> Any:
                raise self._failed(ConnectionError(why), f"{name}()")
            return call
        for name in _CALLS:
            self.__dict__[name] = refused(name)

    def _buffer(self, value: Any, name: str) -> _Buffer:
        return _Buffer(value, name, self._backend)

    def _buffers(self, values: Any, name: str) -> list[_Buffer]:
        arrays.check_count(name, values, self._size)
        return [self._buffer(v, f"{name}[{i}]") for i, v in enumerate(values)]

    def _wait(self, work: Any) -> None:
        """``work.wait()``; on a breakable group in slices, raising ConnectionError with the
        refusal's words once ``refuse`` was called (the work itself is left to gloo: its
        group is being closed)."""
        if not self._breakable:
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # ended (or failed) as the slice ran out
                    work.wait()  # returns, or raises the work's own error
                    return
                if self._why is not None:
                    raise ConnectionError(self._why) from None

    def _run(self, what: str, async_op: bool, buffers: Sequence[_Buffer],
             call: Callable[[Any, bool], Any]) -> Work | None:
        """Run ``call(engine_group, async_op)``; engine failures become our errors. A
        blocking call on a breakable group is made asynchronous and waited for (``_wait``)."""
        since = time.monotonic()
        try:
            work = call(self._group, async_op or self._breakable)
            if async_op:
                return Work(_Guarded(work, what, self._failed, since, self._wait),
                            lambda: _finish(buffers))
            if self._breakable:
                self._wait(work)
        except (RuntimeError, ConnectionError) as err:
            raise _timed(self._failed(err, what), since) from None  # it quotes the engine
        _finish(buffers)
        return None

    def all_reduce(self, tensor: Any, op: Any, async_op: bool) -> Work | None:
        opts = _ALLREDUCE_OPTS_BY_ID.get(id(op))
        if (opts is not None and type(tensor) is torch.Tensor
                and (id(op) != _AVG_ID or tensor.is_floating_point())
                and not async_op and tensor.is_contiguous()
                and (tensor.is_cpu and tensor.dtype in _GLOO_DTYPES if self._gloo
                     else tensor.is_cuda and not tensor.is_complex())
                and not _has_torch_function(tensor) and not _COALESCING):
            # The hottest call of a training step: a member's plain tensor that its group's
            # backend can move, with one of our ops. It goes to the c10d group itself, as
            # torch.distributed.all_reduce would after its own checks, which this one makes.
            # Every other call takes the path below, whose checks name what is wrong. Each
            # Python step here costs ~5x its idle time, right after a blocking call
            # (bench/mesh_init.py table (c)).
            since = time.monotonic()
            try:
                self._wait(self._group.allreduce([tensor], opts))
            except (RuntimeError, ConnectionError) as err:
                raise _timed(self._failed(err, "all_reduce()"), since) from None  # it quotes
                # the engine's words
            return None
        buf = self._buffer(tensor, "tensor")
        torch_op = _op(op, buf.tensor)
        return self._run("all_reduce()", async_op, [buf], lambda g, a: dist.all_reduce(
            buf.tensor, op=torch_op, group=g, async_op=a))

    def broadcast(self, tensor: Any, src: int, async_op: bool) -> Work | None:
        buf = self._buffer(tensor, "tensor")
        return self._run("broadcast()", async_op, [buf], lambda g, a: dist.broadcast(
            buf.tensor, src=src, group=g, async_op=a))

    def reduce(self, tensor: Any, dst: int, op: Any, async_op: bool) -> Work | None:
        buf = self._buffer(tensor, "tensor")
        torch_op = _op(op, buf.tensor)
        return self._run("reduce()", async_op, [buf], lambda g, a: dist.reduce(
            buf.tensor, dst=dst, op=torch_op, group=g, async_op=a))

    def all_gather(self, tensor_list: Any, tensor: Any, async_op: bool) -> Work | None:
        buf = self._buffer(tensor, "tensor")
        outs = self._buffers(tensor_list, "tensor_list")
        return self._run("all_gather()", async_op, outs, lambda g, a: dist.all_gather(
            [o.tensor for o in outs], buf.tensor, group=g, async_op=a))

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool) -> Work | None:
        out = self._buffer(output, "output_tensor")
        inp = self._buffer(input, "input_tensor")
        arrays.check_numel("output_tensor", out.tensor, inp.tensor.numel() * self._size)
        return self._run("all_gather_into_tensor()", async_op, [out], lambda g, a: _GATHER_INTO(
            out.tensor.view(-1), inp.tensor.view(-1), group=g, async_op=a))

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any,
                              async_op: bool) -> Work | None:
        out = self._buffer(output, "output")
        inp = self._buffer(input, "input")
        arrays.check_numel("input", inp.tensor, out.tensor.numel() * self._size)
        torch_op = _op(op, inp.tensor)
        return self._run("reduce_scatter_tensor()", async_op, [out], lambda g, a: _SCATTER_FROM(
            out.tensor.view(-1), inp.tensor.view(-1), op=torch_op, group=g, async_op=a))

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any,
                          input_split_sizes: Any, async_op: bool) -> Work | None:
        out = self._buffer(output, "output")
        inp = self._buffer(input, "input")
        return self._run("all_to_all_single()", async_op, [out],
                         lambda g, a: dist.all_to_all_single(
                             out.tensor, inp.tensor, output_split_sizes, input_split_sizes,
                             group=g, async_op=a))

    def gather(self, tensor: Any, gather_list: Any, dst: int, async_op: bool) -> Work | None:
        buf = self._buffer(tensor, "tensor")
        is_dst = gather_list is not None
        outs = self._buffers(gather_list, "gather_list") if is_dst else []
        return self._run("gather()", async_op, outs, lambda g, a: dist.gather(
            buf.tensor, [o.tensor for o in outs] if is_dst else None, dst=dst, group=g,
            async_op=a))

    def scatter(self, tensor: Any, scatter_list: Any, src: int, async_op: bool) -> Work | None:
        buf = self._buffer(tensor, "tensor")
        is_src = scatter_list is not None
        ins = self._buffers(scatter_list, "scatter_list") if is_src else []
        return self._run("scatter()", async_op, [buf], lambda g, a: dist.scatter(
            buf.tensor, [i.tensor for i in ins] if is_src else None, src=src, group=g,
            async_op=a))

    def send(self, tensor: Any, dst: int) -> None:
        buf = self._buffer(tensor, "tensor")
        self._run("send()", False, [], lambda g, a: (dist.isend if a else dist.send)(
            buf.tensor, dst=dst, group=g))

    def recv(self, tensor: Any, src: int) -> None:
        buf = self._buffer(tensor, "tensor")
        self._run("recv()", False, [buf], lambda g, a: (dist.irecv if a else dist.recv)(
            buf.tensor, src=src, group=g))

    def barrier(self, async_op: bool) -> Work | None:
        return self._run("barrier()", async_op, [],
                         lambda g, a: dist.barrier(group=g, async_op=a))
