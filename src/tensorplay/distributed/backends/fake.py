"""The "fake" engine: a world that exists only in this process.

Any rank of any world size can be simulated: groups cost nothing to create and collectives
return at once, leaving data as it is (as PyTorch's fake backend does), after checking their
buffers as a real engine would. Use it to plan and check a mesh for 100,000 GPUs on a laptop.
Loads no torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..process_group import Work
from . import arrays
from .protocol import Capabilities, Engine, FailureKind, Joined, Started, StoreFailure


class FakeGroupOps:
    """Collectives of a simulated group: buffers are checked, nothing moves."""

    def __init__(self, size: int):
        self._size = size

    @staticmethod
    def _done(async_op: bool) -> Work | None:
        return Work() if async_op else None

    def all_reduce(self, tensor: Any, op: Any, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        return self._done(async_op)

    def broadcast(self, tensor: Any, src: int, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        return self._done(async_op)

    def reduce(self, tensor: Any, dst: int, op: Any, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        return self._done(async_op)

    def all_gather(self, tensor_list: Any, tensor: Any, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        arrays.check_count("tensor_list", tensor_list, self._size)
        return self._done(async_op)

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool) -> Work | None:
        arrays.kind("output_tensor", output)
        arrays.kind("input_tensor", input)
        arrays.check_numel("output_tensor", output, arrays.numel(input) * self._size)
        return self._done(async_op)

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any,
                              async_op: bool) -> Work | None:
        arrays.kind("output", output)
        arrays.kind("input", input)
        arrays.check_numel("input", input, arrays.numel(output) * self._size)
        return self._done(async_op)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any,
                          input_split_sizes: Any, async_op: bool) -> Work | None:
        arrays.kind("output", output)
        arrays.kind("input", input)
        return self._done(async_op)

    def gather(self, tensor: Any, gather_list: Any, dst: int, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        return self._done(async_op)

    def scatter(self, tensor: Any, scatter_list: Any, src: int, async_op: bool) -> Work | None:
        arrays.kind("tensor", tensor)
        return self._done(async_op)

    def send(self, tensor: Any, dst: int) -> None:
        arrays.kind("tensor", tensor)

    def recv(self, tensor: Any, src: int) -> None:
        arrays.kind("tensor", tensor)

    def barrier(self, async_op: bool) -> Work | None:
        return self._done(async_op)


class FakeEngine:
    """The simulated engine (``Engine`` and ``Joined``, no capability): no processes, no
    store, no engine groups; so no mesh objects of its own (``NativeMeshes``) and nothing to
    sever (``Severable``). It keeps nothing of a world, so it is its own worlds' engine too
    (``Started.engine``)."""

    name = "fake"
    capabilities = Capabilities(simulated=True, has_store=False)

    def default_backend(self) -> str:
        return "fake"

    def check_available(self, backend: str) -> None:
        """The fake engine is always available."""

    def start(self, backend: str, init_method: str, *, rank: int, world_size: int,
              timeout: timedelta, master: tuple[str, int] | None) -> Started:
        """Nothing to start: no engine group, no store; this engine runs the world."""
        return Started(None, None, self)

    def new_group(self, name: str, ranks: Any, backend: str, timeout: timedelta,
                  desc: str, *, apart: bool = False) -> Any:
        """Groups of the fake world have no engine object."""
        return None

    def ops(self, engine_group: Any, group: Any, failed: Any) -> FakeGroupOps:
        return FakeGroupOps(group.size())

    def group_members(self, obj: object) -> tuple[list[int], str] | None:
        """The fake world has no engine groups to adopt."""
        return None

    def classify(self, err: BaseException) -> FailureKind | None:
        """Nothing in a simulated world fails on its own."""
        return None

    def store_failure(self, err: BaseException) -> StoreFailure | None:
        """A simulated world has no store: no error is its failure."""
        return None

    def store_reachable(self) -> bool:
        """A simulated world has no store to reach."""
        return False

    def backend_for_device(self, device_type: str, world_backend: str) -> str:
        return world_backend

    def use_device(self, device_type: str) -> None:
        """A simulated rank has no device to pick."""

    def rank_array(self, array: Any) -> Any:
        """The numpy array itself (the registry's ``rank_array`` gives a simulated world's
        as the engine it stands in for would)."""
        return array

    def running(self) -> None:
        """A simulated world is never started outside the package."""
        return None

    def adopt(self, timeout: timedelta) -> Started:
        """What ``start`` gives: a simulated world has nothing to join (``running()`` is
        never set, so nothing asks)."""
        return Started(None, None, self)

    def destroy(self) -> None:
        """Nothing to tear down."""


ENGINE = FakeEngine()
JOINED = FakeEngine  # the class of Started.engine: the engine itself (it keeps no world)
_CLAIMS: tuple[Engine, Joined] = (ENGINE,) * 2  # mypy: the core, per process and per world
