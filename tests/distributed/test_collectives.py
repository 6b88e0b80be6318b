"""Every collective moves real bytes between 8 gloo ranks, with torch and numpy inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.slow

KINDS = ["torch", "numpy"]


def _make(kind: str, values) -> torch.Tensor | np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    return torch.from_numpy(array.copy()) if kind == "torch" else array.copy()


def _list(value) -> list:
    return np.asarray(value).tolist()


def reductions(rank: int, kind: str):
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT,
               dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        x = _make(kind, [rank + 1.0, -rank])
        assert dist.all_reduce(x, op=op) is None
        out[op.name] = _list(x)
    x = _make(kind, [rank])
    work = dist.all_reduce(x, async_op=True)
    out["async"] = (work.wait(), _list(x))
    y = _make(kind, [rank + 1.0])
    dist.reduce(y, dst=3, op=dist.ReduceOp.MAX)
    out["reduce"] = _list(y)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_all_reduce_every_op_and_reduce(world8, kind):
    results = world8.run(reductions, kind)
    for rank, got in enumerate(results):
        assert got["SUM"] == [36.0, -28.0]
        assert got["AVG"] == [4.5, -3.5]
        assert got["PRODUCT"] == [40320.0, 0.0]
        assert got["MIN"] == [1.0, -7.0]
        assert got["MAX"] == [8.0, 0.0]
        assert got["async"] == (True, [28.0])
        if rank == 3:
            assert got["reduce"] == [8.0]


def movers(rank: int, kind: str):
    out = {}
    b = _make(kind, [rank, rank])
    dist.broadcast(b, src=5)
    out["broadcast"] = _list(b)
    parts = [_make(kind, [0.0]) for _ in range(8)]
    dist.all_gather(parts, _make(kind, [rank * 10.0]))
    out["all_gather"] = [_list(p)[0] for p in parts]
    whole = _make(kind, [0.0] * 16)
    dist.all_gather_into_tensor(whole, _make(kind, [rank, -rank]))
    out["all_gather_into_tensor"] = _list(whole)
    chunk = _make(kind, [0.0, 0.0])
    dist.reduce_scatter_tensor(chunk, _make(kind, list(range(16))))
    out["reduce_scatter_tensor"] = _list(chunk)
    received = _make(kind, [0.0] * 8)
    dist.all_to_all_single(received, _make(kind, [rank * 100 + i for i in range(8)]))
    out["all_to_all_single"] = _list(received)
    gathered = [_make(kind, [0.0]) for _ in range(8)] if rank == 2 else None
    dist.gather(_make(kind, [rank + 0.5]), gathered, dst=2)
    out["gather"] = None if gathered is None else [_list(g)[0] for g in gathered]
    mine = _make(kind, [0.0])
    pieces = [_make(kind, [i * 3.0]) for i in range(8)] if rank == 6 else None
    dist.scatter(mine, pieces, src=6)
    out["scatter"] = _list(mine)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_data_movement_collectives(world8, kind):
    results = world8.run(movers, kind)
    for rank, got in enumerate(results):
        assert got["broadcast"] == [5.0, 5.0]
        assert got["all_gather"] == [r * 10.0 for r in range(8)]
        assert got["all_gather_into_tensor"] == [v for r in range(8) for v in (r, -r)]
        assert got["reduce_scatter_tensor"] == [8.0 * (2 * rank), 8.0 * (2 * rank + 1)]
        assert got["all_to_all_single"] == [s * 100.0 + rank for s in range(8)]
        assert got["gather"] == ([r + 0.5 for r in range(8)] if rank == 2 else None)
        assert got["scatter"] == [rank * 3.0]


@pytest.mark.parametrize("kind", KINDS)
def test_send_recv_barrier(world8, kind):
    results = world8.run(point_to_point_and_barrier, kind)
    for rank, got in enumerate(results):
        if rank % 2:
            assert got == (rank - 1, [(rank - 1) * 1.5, 7.0])
        else:
            assert got is None


def point_to_point_and_barrier(rank: int, kind: str):
    x = _make(kind, [rank * 1.5, 7.0])
    result = None
    if rank % 2 == 0:
        dist.send(x, dst=rank + 1)
    else:
        result = (dist.recv(x, src=rank - 1), _list(x))
    dist.barrier()
    return result


def numpy_in_place(rank: int):
    base = np.zeros((4, 2), dtype=np.float32)
    view = base[:, 0]  # not contiguous: copied in and out
    view[:] = rank
    dist.all_reduce(view)
    flat = np.full(3, rank, dtype=np.int64)
    address = flat.__array_interface__["data"][0]
    dist.all_reduce(flat)
    torch_base = torch.zeros(4, 2)
    torch_view = torch_base[:, 1]  # a non-contiguous tensor takes the same copy in and out
    torch_view.fill_(rank)
    dist.all_reduce(torch_view)
    return (base.tolist(), flat.tolist(), flat.__array_interface__["data"][0] == address,
            torch_base.tolist())


def under_a_torch_function_mode(rank: int):
    import torch.distributed as torch_dist
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.full((2,), float(rank))
    with Seen() as mode:
        dist.all_reduce(x)
    return x.tolist(), torch_dist.all_reduce.__name__ in mode.calls


def test_all_reduce_under_a_torch_function_mode_goes_through_torch(world8):
    """The short path skips torch's wrapper only when no torch-function override is active."""
    assert world8.run(under_a_torch_function_mode) == [([28.0, 28.0], True)] * 8


def test_numpy_results_land_in_callers_array(world8):
    for base, flat, same_buffer, torch_base in world8.run(numpy_in_place):
        assert base == [[28.0, 0.0]] * 4
        assert flat == [28, 28, 28]
        assert same_buffer
        assert torch_base == [[0.0, 28.0]] * 4


def on_mesh_groups(rank: int):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = torch.tensor([float(rank)])
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    dp = np.array([rank], dtype=np.int64)
    dist.all_reduce(dp, group=mesh.get_group("dp"))
    root = torch.tensor([float(rank)])
    dist.broadcast(root, src=mesh.get_rank((0, 2)) if rank < 4 else 6, group=mesh.get_group("tp"))
    return tp.item(), int(dp[0]), root.item()


def test_collectives_run_independently_along_each_dim(world8):
    for rank, (tp, dp, root) in enumerate(world8.run(on_mesh_groups)):
        row = rank // 4
        assert tp == sum(range(4 * row, 4 * row + 4))
        assert dp == (rank % 4) + (rank % 4 + 4)
        assert root == (2.0 if rank < 4 else 6.0)


def bad_calls(rank: int):
    errors = {}
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    for name, call in {
        "dtype": lambda: dist.all_reduce(torch.zeros(2, dtype=torch.complex64)),
        "type": lambda: dist.all_reduce([1.0, 2.0]),
        "src": lambda: dist.broadcast(torch.zeros(1), src=(rank + 4) % 8, group=tp),
        "numel": lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(1)),
        "list": lambda: dist.all_gather([torch.zeros(1)], torch.zeros(1)),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the test inspects it
            errors[name] = (type(err).__name__, str(err))
    other = dist.new_group([0, 1] if rank >= 2 else [2, 3])
    try:
        dist.all_reduce(torch.zeros(1), group=other)
        errors["member"] = None
    except Exception as err:  # noqa: BLE001
        errors["member"] = (type(err).__name__, str(err))
    return errors


def test_bad_collective_calls_raise_typed_errors_naming_the_argument(world8):
    for errors in world8.run(bad_calls):
        assert errors["dtype"][0] == "ArgumentError" and "tensor=" in errors["dtype"][1]
        assert errors["type"][0] == "ArgumentTypeError" and "tensor=" in errors["type"][1]
        assert errors["src"][0] == "ArgumentError" and "src=" in errors["src"][1]
        assert errors["numel"][0] == "ArgumentError" and "output_tensor" in errors["numel"][1]
        assert errors["list"][0] == "ArgumentError" and "tensor_list" in errors["list"][1]
        assert errors["member"][0] == "NotAMemberError" and "Fix" in errors["member"][1]


def missing_barrier_job(rank: int):
    import time

    if rank == 2:  # never reaches the barrier; leaves once the others have given up (3 s)
        time.sleep(7)
        return None
    start = time.monotonic()
    try:
        dist.barrier()
    except dist.DistributedTimeoutError as err:
        return err.missing, str(err), time.monotonic() - start
    return "passed"


@pytest.mark.faults
def test_a_barrier_that_times_out_names_who_never_came():
    from tests import spawn, timing

    results = spawn.run(missing_barrier_job, 3, pg_timeout=3, timeout=90)
    for rank in (0, 1):
        missing, text, elapsed = results[rank]
        assert missing == [2] and "rank 2 had not arrived" in text and "barrier()" in text
        assert elapsed < timing.bound(3, 27), timing.describe()  # pg_timeout=3
