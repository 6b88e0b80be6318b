"""Canonicalise the arguments of mesh calls at the door: check, normalise, or raise clearly.

Pure: no processes. Each function returns the checked value or raises ArgumentError /
ArgumentTypeError naming the argument, the bad value, what is accepted and the fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

from ..backends import BACKENDS, engine_name
from ..errors import ArgumentTypeError, UnknownDimError, bad_argument, bad_type, check_int, is_int

DEVICE_TYPES = ("cpu", "cuda")


def device_type(value: object) -> str:
    """'cpu' or 'cuda'; 'cuda:0' is refused (the device index comes from LOCAL_RANK)."""
    if not isinstance(value, str):
        raise bad_type("device_type", value, "str", f"pass one of {DEVICE_TYPES}")
    lowered = value.strip().lower()
    if ":" in lowered:
        raise bad_argument(
            "device_type", value, "takes a device type, not a device",
            f"pass {lowered.split(':')[0]!r}; each rank's device index comes from LOCAL_RANK",
        )
    if lowered not in DEVICE_TYPES:
        raise bad_argument(
            "device_type", value, "unknown device type", f"use one of {DEVICE_TYPES}"
        )
    return lowered


def _int(name: str, value: object) -> int:
    return check_int(name, value, "pass whole numbers")


def mesh_shape(value: object, world_size: int) -> tuple[int, ...]:
    """Positive ints whose product is the world size; at most one -1, inferred."""
    return _sizes(value, world_size, "mesh_shape", "world",
                  " (or use DeviceMesh(device_type, ranks) for a subset)")


def _sizes(value: object, total: int, arg: str, whole: str, hint: str = "") -> tuple[int, ...]:
    """Positive ints (one -1 inferred) multiplying to ``total``, the size of the ``whole``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise bad_type(arg, value, "tuple of ints", f"pass e.g. {arg}=(2, 4)")
    sizes = [_int(f"{arg}[{i}]", v) for i, v in enumerate(value)]
    if not sizes:
        raise bad_argument(arg, value, "is empty", f"pass e.g. ({total},)")
    if sizes.count(-1) > 1:
        raise bad_argument(arg, value, "has more than one -1", "leave at most one -1")
    bad = [s for s in sizes if s < 1 and s != -1]
    if bad:
        raise bad_argument(
            arg, value, f"sizes must be positive (or one -1); got {bad[0]}", "use sizes >= 1",
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if total % known:
            raise bad_argument(
                arg, value, f"the other sizes ({known}) do not divide the {whole} "
                f"size {total}", f"choose sizes whose product divides the {whole} size",
            )
        sizes[sizes.index(-1)] = total // known
    if math.prod(sizes) != total:
        raise bad_argument(
            arg, value, f"holds {math.prod(sizes)} ranks but the {whole} has {total}",
            f"make the product of the sizes equal the {whole} size{hint}",
        )
    return tuple(sizes)


def dim_names(value: object, ndim: int, arg: str = "mesh_dim_names") -> tuple[str, ...] | None:
    """None, or ``ndim`` distinct non-empty strings."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise bad_type(arg, value, f"tuple of {ndim} str", "pass e.g. ('dp', 'tp')")
    names = tuple(value)
    if len(names) != ndim:
        raise bad_argument(
            arg, value, f"has {len(names)} names for {ndim} dims", f"give exactly {ndim} names"
        )
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise bad_type(f"{arg}[{i}]", name, "str", "name every dim with a string")
        if not name:
            raise bad_argument(arg, value, "contains an empty name", "use non-empty names")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_argument(arg, value, f"repeats {dup!r}", "give each dim its own name")
    return names


def explicit_mesh(value: object, world_size: int) -> tuple[tuple[int, ...], list[int]]:
    """(shape, row-major ranks) of an explicit rank array: lists, numpy or torch."""
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        array = value
    else:
        try:
            array = np.array(value, dtype=object)
        except ValueError as err:  # ragged nesting
            raise bad_argument(
                "mesh", value, "is ragged", "give every row the same length"
            ) from err
        if array.dtype == object and array.ndim >= 1:
            cells = array.reshape(-1)
            if any(isinstance(v, list | tuple | np.ndarray) for v in cells):
                raise bad_argument("mesh", value, "is ragged", "give every row the same length")
    if array.ndim == 0:
        raise bad_argument("mesh", value, "is a single value, not an array of ranks",
                           f"pass a list of ranks, e.g. [{value!r}]")
    if array.size == 0:
        raise bad_argument("mesh", value, "is empty", "pass a non-empty array of ranks")
    flat = array.reshape(-1).tolist()
    for v in flat:
        if not is_int(v):
            raise bad_argument("mesh", value, f"holds {v!r} ({type(v).__name__}); ranks are "
                               "ints", "pass whole-number ranks", kind=ArgumentTypeError)
    ranks = [int(v) for v in flat]
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise bad_argument(
            "mesh", value, f"rank {bad[0]} is outside the world of {world_size} ranks",
            f"use ranks 0..{world_size - 1}",
        )
    if len(set(ranks)) != len(ranks):
        dup = next(r for r in ranks if ranks.count(r) > 1)
        raise bad_argument("mesh", value, f"rank {dup} appears twice", "list each rank once")
    return tuple(array.shape), ranks


def mesh_dim(value: object, names: tuple[str, ...] | None, ndim: int, arg: str = "mesh_dim") -> int:
    """Index of a dim given by index or name."""
    if isinstance(value, str):
        if names is None or value not in names:
            raise bad_argument(
                arg, value, "is not a dim name of this mesh",
                f"use one of {names}" if names else "this mesh has no names; pass an index",
                kind=UnknownDimError,
            )
        return names.index(value)
    index = check_int(arg, value, "pass e.g. 0 or 'tp'", "int index or str name")
    if not -ndim <= index < ndim:
        raise bad_argument(arg, value, f"is out of range for a {ndim}-d mesh",
                           f"use 0..{ndim - 1}" + (f" or a name in {names}" if names else ""))
    return index % ndim


def elastic(value: object, minimum: object, names: tuple[str, ...] | None,
            shape: tuple[int, ...], roles: Sequence[str | None] | None = None
            ) -> tuple[int, int] | None:
    """(dim index, minimum) of init_device_mesh's ``elastic`` and ``elastic_min``; None when
    the mesh is not elastic. The minimum counts slices of that dim: 1..its size.
    ``elastic=True`` picks the one dim whose role is "replicate": on (2, 4) ("dp", "tp") with
    roles {"dp": "replicate", "tp": "tensor"}, dim 0."""
    if value is None or value is False:
        if minimum != 1:
            raise bad_argument("elastic_min", minimum, "is set but elastic is not",
                               "pass elastic='dp' (the replica dim) too, or drop elastic_min")
        return None
    if value is True:
        replicate = [d for d, role in enumerate(roles or ()) if role == "replicate"]
        if len(replicate) != 1:
            named = [names[d] if names else str(d) for d in replicate]
            problem = (f"picks the one 'replicate' dim, but the roles name {len(named)} "
                       f"({', '.join(map(repr, named))})" if named else
                       "picks the one 'replicate' dim, but no dim has that role")
            raise bad_argument("elastic", value, problem,
                               "give exactly one dim the role 'replicate' in mesh_dim_roles, "
                               "or name the elastic dim: elastic='dp'")
        value = replicate[0]
    dim = mesh_dim(value, names, len(shape), "elastic")
    least = check_int("elastic_min", minimum, "pass e.g. elastic_min=1")
    if not 1 <= least <= shape[dim]:
        raise bad_argument("elastic_min", minimum, f"must be in 1..{shape[dim]} (the size of "
                           f"the elastic dim)", "pass the fewest replicas the job may train on")
    return dim, least


def slice_names(value: object) -> tuple[str, ...]:
    """The names of mesh[...]: one str or a non-empty tuple of distinct str."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple):
        raise bad_type("mesh[...]", value, "dim name or tuple of names", "use mesh['tp']")
    if not names:
        raise bad_argument("mesh[...]", value, "is empty", "name at least one dim")
    for name in names:
        if not isinstance(name, str):
            raise bad_argument("mesh[...]", value, f"holds {name!r} ({type(name).__name__}); "
                               "dims are sliced by name", "slice by names, e.g. mesh['tp']",
                               kind=ArgumentTypeError)
    if len(set(names)) != len(names):
        raise bad_argument("mesh[...]", value, "repeats a name", "name each dim once")
    return names


def backend_override(
    value: object, names: tuple[str, ...] | None, ndim: int, world_backend: str
) -> tuple[str, ...]:
    """One backend per dim: the override where given, else the world's."""
    chosen = [world_backend] * ndim
    if value is None:
        return tuple(chosen)
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != ndim:
            raise bad_argument("backend_override", value, f"needs {ndim} entries",
                               "pass one backend per dim or a dict {dim: backend}")
        items = list(enumerate(value))
    else:
        raise bad_type("backend_override", value, "dict {dim: backend}", "pass {'dp': 'gloo'}")
    for key, backend in items:
        dim = mesh_dim(key, names, ndim, "backend_override")
        if backend is None:
            continue
        if not isinstance(backend, str) or engine_name(backend.lower()) is None:
            raise bad_argument("backend_override", value, f"unknown backend {backend!r}",
                               f"use one of {BACKENDS}")
        backend = backend.lower()
        if engine_name(backend) != engine_name(world_backend):
            raise bad_argument("backend_override", value,
                               f"{backend!r} cannot run in a {world_backend!r} world",
                               f"use {world_backend!r}")
        chosen[dim] = backend
    return tuple(chosen)


def positive_sizes(value: object, total: int, arg: str = "sizes") -> tuple[int, ...]:
    """Sizes that multiply to ``total``, the size of a dim; one -1 is inferred."""
    return _sizes(value, total, arg, "dim")
