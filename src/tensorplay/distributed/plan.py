"""The planning command: lay out a mesh on paper and print what one rank would see.

    tensorplay-plan --shape 2,4 --names dp,tp --hosts 2 --rank 5
    python -m tensorplay.distributed.device_mesh --shape 2,4 --names dp,tp --hosts 2 --rank 5

Both print the same report: rank 5 of the (2, 4) mesh is at (1, 1), its "tp" group is
[4, 5, 6, 7] and its "dp" group [1, 5], and with 2 hosts of 8 // 2 = 4 ranks all 4 "dp" groups
cross hosts while the 2 "tp" groups do not. --elastic dp adds what losing each host costs an
elastic mesh on "dp" (host0: slice 0, host1: slice 1; 1 of 2 lost each). --plot mesh.png also
draws it; --host-aware lays ranks out host by host first (on --hosts 2 --round-robin, a
(4, 4) mesh becomes [0, 2, ..., 14, 1, 3, ..., 15] and its "tp" groups stay inside one host;
with --elastic dp, a host lost then costs 2 of the 4 "dp" slices, not all 4).

A plan is geometry and text, so no world is started: the arguments are checked by mesh/args.py
as init_device_mesh checks them, the mesh is the MeshSpec init_device_mesh would build (row
major, or geometry/topology.py's host_aware_order), the hosts are simulated, and
geometry/describe.py and geometry/plot.py report it. Nothing here imports torch, the world or
device_mesh, so a million-rank plan (--shape -1,8,8 --world 1048576) costs a second of numpy
and device_mesh's __main__ can call main() without an import cycle.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from .errors import DistributedError, format_ranks
from .geometry.describe import describe
from .geometry.plot import FORMATS, plot
from .geometry.spec import MeshSpec
from .geometry.topology import (
    CROSSING_LIMIT,
    Hosts,
    advice,
    dim_label,
    host_aware_order,
    hosts_round_robin,
    hosts_simulated,
    slices_per_host,
)
from .mesh import args as _mesh_args

PROG = "tensorplay-plan"
"""The name in usage and errors when run as the console script (the default)."""

DEVICE_MESH_PROG = "python -m tensorplay.distributed.device_mesh"
"""The name when run as device_mesh's __main__: main(prog=DEVICE_MESH_PROG)."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints (e.g. 2,4 or -1,8)") from None
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name (e.g. dp,tp)")
    return names


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plan a device mesh without any hardware: simulate the world, build the "
                    "mesh, and print what one rank sees (coordinate, groups, hosts crossed).",
    )
    parser.add_argument("--shape", type=_ints, required=True,
                        help="mesh shape, e.g. 2,4; one -1 is inferred from --world")
    parser.add_argument("--names", type=_names, help="dim names, e.g. dp,tp")
    parser.add_argument("--world", type=int, help="world size (default: the product of --shape)")
    parser.add_argument("--hosts", type=int, default=1,
                        help="simulated hosts; ranks fill them in blocks (default 1)")
    parser.add_argument("--round-robin", action="store_true",
                        help="deal ranks to hosts round-robin (rank r on host r %% hosts), as "
                             "some launchers do, instead of in blocks")
    parser.add_argument("--rank", type=int, default=0, help="the rank to describe (default 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="device type of the mesh (default cpu)")
    parser.add_argument("--plot", metavar="PATH", help="also draw the mesh to PATH (.png, .svg)")
    parser.add_argument("--host-aware", action="store_true",
                        help="order ranks host by host so the inner dims stay inside one host")
    parser.add_argument("--elastic", metavar="DIM",
                        help="the elastic dim (name or index): print which of its slices each "
                             "host holds, i.e. what losing that host costs the elastic mesh")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the command; returns the exit status (0 ok, 1 plot failed, 2 bad arguments).

    ``argv`` defaults to sys.argv[1:]; ``prog`` names the command in usage and errors.
    """
    parser = _parser(prog)
    args = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(args) - 1):  # "--shape -1,8" would read -1,8 as an option
        if args[i] == "--shape" and args[i + 1][:2].lstrip("-").isdigit():
            args[i : i + 2] = [f"--shape={args[i + 1]}", ""]
    args = [a for a in args if a != ""]
    try:
        ns = parser.parse_args(args)
    except SystemExit as stop:  # argparse printed usage and the error (or --help)
        return int(stop.code or 0)
    shape = ns.shape
    if ns.world is None:
        if -1 in shape:
            return _usage(parser, f"--shape {_join(shape)} has a -1: give --world to infer it")
        if any(s < 1 for s in shape):
            return _usage(parser, f"--shape {_join(shape)}: sizes must be positive (or one -1)")
        world = math.prod(shape)
    else:
        world = ns.world
    if world < 1:
        return _usage(parser, f"--world {world}: must be at least 1")
    if ns.hosts < 1 or world % ns.hosts:
        return _usage(parser, f"--hosts {ns.hosts}: must be a positive divisor of the world "
                              f"size {world}")
    if not 0 <= ns.rank < world:
        return _usage(parser, f"--rank {ns.rank}: must be in 0..{world - 1}")
    if ns.names is not None and len(ns.names) != len(shape):
        return _usage(parser, f"--names {','.join(ns.names)}: {len(ns.names)} names for "
                              f"{len(shape)} dims")
    if ns.elastic is not None and _dim(ns.elastic, ns.names, len(shape)) is None:
        return _usage(parser, f"--elastic {ns.elastic}: not a dim of the mesh (a name of "
                              f"--names, or an index in 0..{len(shape) - 1})")
    if ns.plot is not None:
        suffix = ns.plot[ns.plot.rfind("."):].lower() if "." in ns.plot else ""
        if suffix not in FORMATS:
            return _usage(parser, f"--plot {ns.plot}: suffix {suffix or '(none)'!r} is not "
                                  f"one of {', '.join(FORMATS)}")
    try:
        return _run(ns, shape, world, prog)
    except DistributedError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace, shape: tuple[int, ...], world: int, prog: str) -> int:
    """Check as init_device_mesh does, build the spec it would build, report and draw it."""
    device = _mesh_args.device_type(ns.device)
    shape = _mesh_args.mesh_shape(shape, world)  # infers the -1: (-1, 8, 8) -> (16384, 8, 8)
    names = _mesh_args.dim_names(ns.names, len(shape))
    hosts = (hosts_round_robin if ns.round_robin else hosts_simulated)(world, ns.hosts)
    spec = MeshSpec.row_major(shape, names)
    if ns.host_aware:
        order = host_aware_order(shape, hosts)
        if order is None:
            print("host-aware: row-major order already keeps the inner dims inside hosts "
                  "(or hosts cannot be split evenly); keeping it\n")
        else:
            spec = MeshSpec.from_ranks(shape, order, names)
            print("host-aware: ranks laid out host by host\n")
    print(describe(spec, ns.rank, host_of=hosts, device_type=device))
    if not ns.host_aware and spec.size <= CROSSING_LIMIT and advice(spec, hosts) is not None:
        print("(in this command: add --host-aware)")
    dim = None if ns.elastic is None else _dim(ns.elastic, names, len(shape))
    if dim is not None and spec.size <= CROSSING_LIMIT:
        print("\n" + _host_losses(spec, dim, hosts))
    if ns.plot:
        try:
            written = plot(spec, ns.plot, host_of=hosts, rank=ns.rank)
        except ImportError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 1
        print(f"\nwrote {written}")
    return 0


def _dim(text: str, names: Sequence[str] | None, ndim: int) -> int | None:
    """--elastic's dim: a name of the mesh, or an index; None when it is neither."""
    if names and text in names:
        return list(names).index(text)
    return int(text) if text.isdigit() and int(text) < ndim else None


def _host_losses(spec: MeshSpec, dim: int, hosts: Hosts) -> str:
    """What losing each host costs an elastic mesh on ``dim``: 'hostB: slice 1 (1 of 2 slices
    lost; 1 left)', hosts that cost the same grouped."""
    label, total = dim_label(spec, dim), spec.shape[dim]
    by_cost: dict[tuple[int, ...], list[str]] = {}
    for host, slices in slices_per_host(spec, dim, hosts).items():
        by_cost.setdefault(tuple(slices), []).append(host)
    lines = [f"elastic {label}: a host lost costs the slices of {label} holding its ranks"]
    for lost, names in by_cost.items():
        who = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} hosts)"
        what = f"slice {lost[0]}" if len(lost) == 1 else f"slices {format_ranks(list(lost))}"
        lines.append(f"  {who}: {what} ({len(lost)} of {total} lost; {total - len(lost)} "
                     f"left)")
    return "\n".join(lines)


def _usage(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _join(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


if __name__ == "__main__":
    sys.exit(main(prog="python -m tensorplay.distributed.plan"))
