"""The cross-rank check's protocol, run by threads that share one in-memory store.

Each thread plays one rank of a world whose store is a torch HashStore, so the whole exchange
(digests, rank 0's verdict, the mismatch texts) runs without processes. Deaths, timeouts and
late ranks in real jobs are in test_faults.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from tensorplay.distributed import _consensus
from tensorplay.distributed.errors import MeshMismatchError


def _world(rank: int, size: int, store):
    """A real World over a shared in-memory store: agree() needs no processes."""
    from tensorplay.distributed.backends import engine_for
    from tensorplay.distributed.world import World

    return World(rank, size, "gloo", timedelta(seconds=20), engine_for("gloo"), store)


def _run_ranks(requests: list[dict]) -> list[BaseException | None]:
    """Call agree() on one thread per request (thread i is rank i); return what each raised."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    out: list[BaseException | None] = [None] * len(requests)

    def rank_main(rank: int) -> None:
        try:
            _consensus.agree(_world(rank, len(requests), store), "init_device_mesh()",
                             requests[rank])
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank never returned"
    return out


def test_equal_requests_pass_on_every_rank():
    assert _run_ranks([{"mesh_shape": (2, 2), "names": ["dp", "tp"]}] * 4) == [None] * 4


def test_different_requests_raise_the_same_error_on_every_rank():
    requests = [{"mesh_shape": (2, 2)}] * 3 + [{"mesh_shape": (4, 1)}] * 2
    errors = _run_ranks(requests)
    assert all(isinstance(e, MeshMismatchError) for e in errors), errors
    assert {str(e) for e in errors} == {str(errors[0])}
    assert errors[0].values == {"(2, 2)": [0, 1, 2], "(4, 1)": [3, 4]}
    assert "mesh_shape in init_device_mesh()" in str(errors[0])


def test_many_distinct_requests_spell_out_the_first_few_and_count_the_rest():
    size = _consensus.SHOWN_VALUES + 3
    errors = _run_ranks([{"mesh_shape": (r, 1)} for r in range(size)])
    assert all(isinstance(e, MeshMismatchError) for e in errors), errors
    values = errors[0].values
    assert len(values) == _consensus.SHOWN_VALUES + 1
    assert values["(0, 1)"] == [0]
    assert values["<3 more distinct requests>"] == [size - 3, size - 2, size - 1]
