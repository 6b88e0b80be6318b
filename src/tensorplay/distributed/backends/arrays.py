"""The checks every engine makes on the buffers handed to a collective, for torch and numpy.

Torch tensors and numpy arrays are both first-class inputs. This module tells them apart
without importing either (a tensor or an array exists only if its library was imported
already), so a simulated world and a torch-free engine check buffers the same way, and
importing the package stays light:

    kind("x", np.zeros(4))        # 'numpy'
    numel(np.zeros((2, 3)))        # 6
    check_count("tensor_list", [a, b], 4)   # ArgumentError: needs a list of 4 ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..errors import bad_argument, bad_type


def kind(name: str, value: Any) -> str:
    """'torch' or 'numpy' for a usable buffer; raises for anything else or a read-only array."""
    if _is_ndarray(value):
        if not value.flags.writeable:
            raise bad_argument(name, "<read-only ndarray>", "is read-only",
                               "pass a writeable array")
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return "torch"
    raise bad_type(name, value, "torch.Tensor or numpy.ndarray", "pass a tensor or array")


def _is_ndarray(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def numel(value: Any) -> int:
    """Number of elements of a tensor or array."""
    return value.size if _is_ndarray(value) else value.numel()


def check_numel(name: str, value: Any, expected: int) -> None:
    """Raise unless ``value`` holds ``expected`` elements (input size x group size)."""
    if numel(value) != expected:
        raise bad_argument(name, f"<{numel(value)} elements>",
                           f"needs {expected} elements (input size x group size)", "resize it")


def check_count(name: str, values: Any, count: int) -> Sequence[Any]:
    """``values`` as a list or tuple of ``count`` buffers (one per member), checked."""
    if not isinstance(values, list | tuple) or len(values) != count:
        raise bad_argument(
            name, f"<{type(values).__name__} of {len(values) if values is not None else 0}>",
            f"needs a list of {count} tensors or arrays (one per member)",
            f"pass {count} tensors shaped like the input",
        )
    for i, value in enumerate(values):
        kind(f"{name}[{i}]", value)
    return values
