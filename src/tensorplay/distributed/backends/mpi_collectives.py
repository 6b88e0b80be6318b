"""The collectives of one MPI communicator (``protocol.GroupOps``): numpy arrays and CPU tensors.

A numpy array, or a CPU torch tensor seen through ``.numpy()``, is handed to MPI as it is:
results land in the caller's memory without a copy (a non-contiguous one is copied in and
out). Each call is MPI's blocking collective, as raw mpi4py would make it (MPICH's nonblocking
ones cost 20-35% more at small sizes, bench/README.md), with the process's watchdog thread
(``mpi_watch.py``) watching it: past the world's timeout, or when a member has left, it says
why and aborts the job. ``async_op=True`` starts the nonblocking twin; its Work's wait() is
watched the same way. Reductions of types MPI cannot reduce correctly (bfloat16: MPICH rejects
it, Open MPI returns wrong sums) are refused before anything is sent; the collectives that
only move data move them as bytes. ``ReduceOp.AVG`` is MPI's sum, divided.

On the (2, 4) mesh, rank 5's ``all_reduce(a, group=mesh.get_group("tp"))`` is one
``Allreduce(IN_PLACE, a, SUM)`` on the communicator of ranks [4, 5, 6, 7].
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..errors import FIX_FAILED, RankFailedError, bad_argument, bad_type, rank_words
from ..process_group import ReduceOp, Work
from . import arrays

if TYPE_CHECKING:
    from .mpi import MpiWorld

_MOVABLE_KINDS = "biufc"  # bool, ints, floats, complex: numpy kinds with an MPI type
_MPI_OPS = {id(ReduceOp.SUM): MPI.SUM, id(ReduceOp.AVG): MPI.SUM,
            id(ReduceOp.PRODUCT): MPI.PROD, id(ReduceOp.MIN): MPI.MIN,
            id(ReduceOp.MAX): MPI.MAX}
_BOOL_OPS = {id(ReduceOp.SUM): MPI.LOR, id(ReduceOp.MAX): MPI.LOR,
             id(ReduceOp.PRODUCT): MPI.LAND, id(ReduceOp.MIN): MPI.LAND}
_ORDERED = (id(ReduceOp.MIN), id(ReduceOp.MAX))
_PLAIN_OPS = {k: v for k, v in _MPI_OPS.items() if k != id(ReduceOp.AVG)}  # no step after


def _cannot_reduce(name: str, shown: str, dtype: object) -> Exception:
    if "bfloat16" in str(dtype):
        problem = ("MPI cannot reduce bfloat16 correctly (MPICH rejects it, Open MPI returns "
                   "wrong sums), so nothing was sent")
    else:
        problem = f"MPI has no type to reduce {dtype}, so nothing was sent"
    return bad_argument(name, shown, problem, "convert to float32 first (t.float() or "
                        "a.astype(np.float32)), reduce, and convert back; or use the gloo "
                        "backend")


class _Buffer:
    """The contiguous numpy array MPI moves for a user's array or CPU tensor, and the copy
    back into the original when that array is a copy."""

    __slots__ = ("array", "_back")

    def __init__(self, value: Any, name: str, reduce: bool):
        self._back: Callable[[], None] | None = None
        if arrays.kind(name, value) == "numpy":
            held = value if value.flags.c_contiguous else np.ascontiguousarray(value)
            if held is not value:
                self._back = lambda: value.__setitem__(Ellipsis, held)
            if held.dtype.kind not in _MOVABLE_KINDS:
                if reduce:
                    raise _cannot_reduce(name, f"<ndarray of {held.dtype}>", held.dtype)
                held = held.reshape(-1).view(np.uint8)  # moved as bytes
            self.array = held
            return
        if value.device.type != "cpu":
            raise bad_argument(name, f"<tensor on {value.device}>", "the mpi backend moves "
                               "CPU memory only", "call .cpu() first, or use the nccl backend")
        tensor = value.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            self._back = lambda: value.detach().copy_(tensor)
        try:
            self.array = tensor.numpy()
        except (TypeError, RuntimeError):  # bfloat16, float8, ...: no numpy type
            if reduce:
                raise _cannot_reduce(name, f"<tensor of {value.dtype}>", value.dtype) from None
            self.array = tensor.reshape(-1).view(sys.modules["torch"].uint8).numpy()

    def finish(self) -> None:
        if self._back is not None:
            self._back()


def _op(op: object, array: np.ndarray) -> Any:
    """MPI's op for ours on ``array``'s dtype (bool: logical; AVG: a sum, divided after)."""
    key = id(op)  # Enum hashing runs Python code; the members are singletons
    if key not in _MPI_OPS:
        raise bad_type("op", op, "tensorplay ReduceOp", "pass e.g. ReduceOp.SUM")
    kind = array.dtype.kind
    if op is ReduceOp.AVG and kind not in "fc":
        raise bad_argument("op", "ReduceOp.AVG", f"cannot average {array.dtype} values",
                           "use ReduceOp.SUM and divide, or convert to a floating dtype")
    if kind == "b":
        return _BOOL_OPS[key]
    if kind == "c" and key in _ORDERED:
        raise bad_argument("op", f"ReduceOp.{op.name}", f"cannot order {array.dtype} values",  # type: ignore[attr-defined]
                           "use SUM, PRODUCT or AVG, or reduce real and imaginary parts")
    return _MPI_OPS[key]


class _Pending:
    """An async collective's request; wait() blocks under the watchdog, like a blocking call."""

    def __init__(self, ops: MpiGroupOps, request: Any, what: str):
        self.ops, self.request, self.what = ops, request, what

    def wait(self) -> None:
        self.ops._blocking(self.what, self.request.Wait, (), None)


class MpiGroupOps:
    """Collectives on one communicator, called on a member of it."""

    def __init__(self, engine: MpiWorld, comm: Any, group: Any,
                 failed: Callable[[BaseException, str], Exception]):
        self._engine = engine
        self._watch = engine.watch  # this process's watchdog
        self._bound = engine.timeout_s  # how long a call waits: its world's timeout
        self._comm = comm
        self._group = group
        self._members = group.rank_seq
        self._size = group.size()
        self._failed = failed

    def _blocking(self, what: str, call: Callable[..., Any], args: tuple,
                  members: Sequence[int] | None) -> Any:
        """Run a blocking MPI call with the watchdog watching it (the world's timeout, and the
        members that leave)."""
        try:
            return self._watch.watched(self._bound, what, self._group,
                                       self._members if members is None else members, call,
                                       *args)
        except MPI.Exception as err:
            raise self._error(err, what) from err

    def _error(self, err: BaseException, what: str) -> Exception:
        """Our error for MPI's ``err``: under ULFM, the failed ranks named."""
        lost = self._engine.lost_ranks(self._comm, err)
        if lost:
            return RankFailedError(
                f"{what} on {self._group.label} failed: {rank_words(lost)} failed (MPI says "
                f"so: the job runs under ULFM, so the other ranks go on). {FIX_FAILED}",
                ranks=lost)
        return self._failed(err, what)

    def _run(self, what: str, async_op: bool, name: str, args: tuple,
             finish: Callable[[], None] | None = None) -> Work | None:
        """MPI's blocking ``name`` (e.g. "Allreduce") on ``args``, or with ``async_op`` its
        nonblocking twin ("Iallreduce") and a Work; ``finish`` runs once it is done."""
        if async_op:
            try:
                request = getattr(self._comm, "I" + name.lower())(*args)
            except MPI.Exception as err:
                raise self._error(err, what) from err
            return Work(_Pending(self, request, what), finish)
        self._blocking(what, getattr(self._comm, name), args, None)
        if finish is not None:
            finish()
        return None

    def _root(self, rank: int) -> int:
        return self._group.group_rank(rank)

    def _outs(self, values: Any, name: str, like: np.ndarray) -> list[_Buffer]:
        """One buffer per member, each of ``like``'s dtype and size."""
        arrays.check_count(name, values, self._size)
        outs = [_Buffer(v, f"{name}[{i}]", False) for i, v in enumerate(values)]
        for i, out in enumerate(outs):
            if out.array.dtype != like.dtype or out.array.size != like.size:
                raise bad_argument(f"{name}[{i}]", f"<{out.array.size} of {out.array.dtype}>",
                                   f"needs {like.size} elements of {like.dtype}, as the input",
                                   "pass buffers shaped like the input")
        return outs

    def all_reduce(self, tensor: Any, op: Any, async_op: bool) -> Work | None:
        mpi_op = _PLAIN_OPS.get(id(op))
        if (mpi_op is not None and type(tensor) is np.ndarray and not async_op
                and tensor.dtype.kind in "iuf" and tensor.flags.c_contiguous
                and tensor.flags.writeable):
            # The hottest call: a plain array MPI reduces as it is, with SUM, PRODUCT, MIN
            # or MAX. It goes straight to MPI, as raw mpi4py would call it, after the checks
            # that the path below makes with words (bench/mpi.py: ~1 µs above raw mpi4py).
            watch = self._watch
            watch.call = ("all_reduce()", self._group, time.monotonic(), self._members,
                          self._bound)
            try:
                self._comm.Allreduce(MPI.IN_PLACE, tensor, mpi_op)
            except MPI.Exception as err:
                raise self._error(err, "all_reduce()") from err
            finally:
                watch.call = None
            return None
        buf = _Buffer(tensor, "tensor", True)
        array = buf.array
        mpi_op = _op(op, array)
        size = self._size

        def finish() -> None:
            if op is ReduceOp.AVG:
                array[...] /= size
            buf.finish()

        return self._run("all_reduce()", async_op, "Allreduce", (MPI.IN_PLACE, array, mpi_op),
                         finish)

    def broadcast(self, tensor: Any, src: int, async_op: bool) -> Work | None:
        buf = _Buffer(tensor, "tensor", False)
        return self._run("broadcast()", async_op, "Bcast", (buf.array, self._root(src)),
                         buf.finish)

    def reduce(self, tensor: Any, dst: int, op: Any, async_op: bool) -> Work | None:
        buf = _Buffer(tensor, "tensor", True)
        array, root = buf.array, self._root(dst)
        mpi_op = _op(op, array)
        here = root == self._group.rank()
        size = self._size

        def finish() -> None:
            if here and op is ReduceOp.AVG:
                array[...] /= size
            buf.finish()

        return self._run("reduce()", async_op, "Reduce", (
            MPI.IN_PLACE if here else array, array if here else None, mpi_op, root), finish)

    def all_gather(self, tensor_list: Any, tensor: Any, async_op: bool) -> Work | None:
        array = _Buffer(tensor, "tensor", False).array
        outs = self._outs(tensor_list, "tensor_list", array)
        staged = np.empty((self._size, array.size), dtype=array.dtype)

        def finish() -> None:
            for out, row in zip(outs, staged, strict=True):
                out.array.reshape(-1)[...] = row
                out.finish()

        return self._run("all_gather()", async_op, "Allgather", (array, staged), finish)

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool) -> Work | None:
        out = _Buffer(output, "output_tensor", False)
        inp = _Buffer(input, "input_tensor", False).array
        arrays.check_numel("output_tensor", out.array, inp.size * self._size)
        _same_dtype("output_tensor", out.array, inp)
        return self._run("all_gather_into_tensor()", async_op, "Allgather", (inp, out.array),
                         out.finish)

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any,
                              async_op: bool) -> Work | None:
        out = _Buffer(output, "output", True)
        inp = _Buffer(input, "input", True).array
        arrays.check_numel("input", inp, out.array.size * self._size)
        _same_dtype("output", out.array, inp)
        mpi_op = _op(op, inp)
        array, size = out.array, self._size

        def finish() -> None:
            if op is ReduceOp.AVG:
                array[...] /= size
            out.finish()

        return self._run("reduce_scatter_tensor()", async_op, "Reduce_scatter_block",
                         (inp, array, mpi_op), finish)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any,
                          input_split_sizes: Any, async_op: bool) -> Work | None:
        out = _Buffer(output, "output", False)
        inp = _Buffer(input, "input", False).array
        _same_dtype("output", out.array, inp)
        rows_out = _rows(output, out.array)
        rows_in = _rows(input, inp)
        send = _counts("input_split_sizes", input_split_sizes, rows_in, inp.size, self._size)
        recv = _counts("output_split_sizes", output_split_sizes, rows_out, out.array.size,
                       self._size)
        return self._run("all_to_all_single()", async_op, "Alltoallv",
                         ([inp, send], [out.array, recv]), out.finish)

    def gather(self, tensor: Any, gather_list: Any, dst: int, async_op: bool) -> Work | None:
        array = _Buffer(tensor, "tensor", False).array
        root = self._root(dst)
        outs = self._outs(gather_list, "gather_list", array) if gather_list is not None else []
        staged = np.empty((self._size, array.size), dtype=array.dtype) if outs else None

        def finish() -> None:
            for out, row in zip(outs, staged if staged is not None else (), strict=True):
                out.array.reshape(-1)[...] = row
                out.finish()

        return self._run("gather()", async_op, "Gather", (array, staged, root), finish)

    def scatter(self, tensor: Any, scatter_list: Any, src: int, async_op: bool) -> Work | None:
        buf = _Buffer(tensor, "tensor", False)
        root = self._root(src)
        staged = None
        if scatter_list is not None:
            ins = self._outs(scatter_list, "scatter_list", buf.array)
            staged = np.stack([i.array.reshape(-1) for i in ins])
        return self._run("scatter()", async_op, "Scatter", (staged, buf.array, root),
                         buf.finish)

    def send(self, tensor: Any, dst: int) -> None:
        array = _Buffer(tensor, "tensor", False).array
        self._blocking("send()", self._comm.Send, (array, self._root(dst)), [dst])

    def recv(self, tensor: Any, src: int) -> None:
        buf = _Buffer(tensor, "tensor", False)
        self._blocking("recv()", self._comm.Recv, (buf.array, self._root(src)), [src])
        buf.finish()

    def barrier(self, async_op: bool) -> Work | None:
        return self._run("barrier()", async_op, "Barrier", ())


def _same_dtype(name: str, out: np.ndarray, inp: np.ndarray) -> None:
    if out.dtype != inp.dtype:
        raise bad_argument(name, f"<{out.dtype}>", f"differs from the input's {inp.dtype}",
                           "pass an output of the input's dtype")


def _rows(value: Any, array: np.ndarray) -> int:
    """Elements per row along dim 0 (the unit of split sizes) of the user's buffer."""
    shape = tuple(value.shape)
    return array.size // shape[0] if shape and shape[0] else 1


def _counts(name: str, splits: Any, row: int, total: int, size: int) -> tuple[list, list]:
    """(counts, displacements) in elements for Alltoallv: equal chunks when ``splits`` is
    None, else one split per member along dim 0."""
    if splits is None:
        if total % size:
            raise bad_argument(name, None, f"{total} elements do not split evenly over "
                               f"{size} members", "pass split sizes, or a divisible size")
        counts = [total // size] * size
    else:
        splits = list(splits)
        if len(splits) != size or sum(splits) * row != total:
            raise bad_argument(name, splits, f"needs {size} sizes adding up to dim 0 "
                               f"({total // row})", "pass one size per member")
        counts = [s * row for s in splits]
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    return counts, starts
