"""The bad-input catalogue: every bad input we know, the error it gets, and its message.

Each case is one row of docs/bad_inputs.md: the call (run here with eval, so the docs show
exactly what runs), the exception class, and the start of its message. Every message must name
the argument (``arg``) and say "Fix". Most cases run as rank 3 of a simulated world of 8
("fake"); collectives that check dtype and device run in a real 1-rank gloo world. The MPI
engine's cases ("mpi": a 1-rank MPI world; "mpi-none": no world) run in a child process, so
that MPI never starts in this one (a running MPI world is adopted by init_process_group()).

Regenerate the docs table after changing CASES:
    python tests/distributed/test_bad_inputs.py > /tmp/table.md   (then paste it in)
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.errors import (
    AlreadyInitializedError,
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    DistributedError,
    LaunchEnvError,
    NotAMemberError,
    NotInitializedError,
    UnknownDimError,
)
from tensorplay.distributed.job import lifecycle as world_module

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TENSORPLAY_TIMEOUT", "TENSORPLAY_LAUNCHER", "GROUP_RANK",
               "TENSORPLAY_STRICT", "TENSORPLAY_PROGRESS_S",
               "TORCHELASTIC_RUN_ID")
LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")


@dataclass(frozen=True)
class Case:
    """One bad input: where it runs, the call, and what it must raise."""

    id: str
    world: str  # "fake" (rank 3 of 8), "none", "destroyed", "renewed" (destroyed, then a
    # new fake world), "gloo" (1 real rank), "mpi" (1 MPI rank), "mpi-none" (MPI, no world)
    call: str  # evaluated with the names of _namespace()
    error: type[Exception]
    start: str  # the message starts with this
    arg: str  # the message names this argument (or call)
    env: dict[str, str] = field(default_factory=dict)


C = Case
CASES = [
    # -- mesh_shape ----------------------------------------------------------------------
    C("shape-empty", "fake", "init_device_mesh('cpu', ())", ArgumentError,
      "mesh_shape=(): is empty", "mesh_shape"),
    C("shape-zero", "fake", "init_device_mesh('cpu', (0, 8))", ArgumentError,
      "mesh_shape=(0, 8): sizes must be positive", "mesh_shape"),
    C("shape-negative", "fake", "init_device_mesh('cpu', (-2, -4))", ArgumentError,
      "mesh_shape=(-2, -4): sizes must be positive", "mesh_shape"),
    C("shape-float", "fake", "init_device_mesh('cpu', (2.0, 4))", ArgumentTypeError,
      "mesh_shape[0]=2.0: expected int, got float", "mesh_shape"),
    C("shape-bool", "fake", "init_device_mesh('cpu', (True, 8))", ArgumentTypeError,
      "mesh_shape[0]=True: expected int, got bool", "mesh_shape"),
    C("shape-str", "fake", "init_device_mesh('cpu', '24')", ArgumentTypeError,
      "mesh_shape='24': expected tuple of ints, got str", "mesh_shape"),
    C("shape-none", "fake", "init_device_mesh('cpu', None)", ArgumentTypeError,
      "mesh_shape=None: expected tuple of ints, got NoneType", "mesh_shape"),
    C("shape-product-small", "fake", "init_device_mesh('cpu', (3, 2))", ArgumentError,
      "mesh_shape=(3, 2): holds 6 ranks but the world has 8", "mesh_shape"),
    C("shape-product-large", "fake", "init_device_mesh('cpu', (4, 4))", ArgumentError,
      "mesh_shape=(4, 4): holds 16 ranks but the world has 8", "mesh_shape"),
    C("shape-two-minus-one", "fake", "init_device_mesh('cpu', (-1, -1))", ArgumentError,
      "mesh_shape=(-1, -1): has more than one -1", "mesh_shape"),
    C("shape-minus-one-not-dividing", "fake", "init_device_mesh('cpu', (3, -1))",
      ArgumentError, "mesh_shape=(3, -1): the other sizes (3) do not divide the world size 8",
      "mesh_shape"),
    # -- mesh_dim_names ------------------------------------------------------------------
    C("names-duplicate", "fake", "init_device_mesh('cpu', (2, 4), mesh_dim_names=('a', 'a'))",
      ArgumentError, "mesh_dim_names=('a', 'a'): repeats 'a'", "mesh_dim_names"),
    C("names-too-few", "fake", "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp',))",
      ArgumentError, "mesh_dim_names=('dp',): has 1 names for 2 dims", "mesh_dim_names"),
    C("names-too-many", "fake", "init_device_mesh('cpu', (8,), mesh_dim_names=('dp', 'tp'))",
      ArgumentError, "mesh_dim_names=('dp', 'tp'): has 2 names for 1 dims", "mesh_dim_names"),
    C("names-not-str", "fake", "init_device_mesh('cpu', (2, 4), mesh_dim_names=(0, 1))",
      ArgumentTypeError, "mesh_dim_names[0]=0: expected str, got int", "mesh_dim_names"),
    C("names-empty-name", "fake", "init_device_mesh('cpu', (2, 4), mesh_dim_names=('', 'tp'))",
      ArgumentError, "mesh_dim_names=('', 'tp'): contains an empty name", "mesh_dim_names"),
    C("names-one-string", "fake", "init_device_mesh('cpu', (2, 4), mesh_dim_names='dptp')",
      ArgumentTypeError, "mesh_dim_names='dptp': expected tuple of 2 str, got str",
      "mesh_dim_names"),
    C("names-explicit-mesh", "fake",
      "DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp',))",
      ArgumentError, "mesh_dim_names=('dp',): has 1 names for 2 dims", "mesh_dim_names"),
    # -- device_type ---------------------------------------------------------------------
    C("device-with-index", "fake", "init_device_mesh('cuda:0', (8,))", ArgumentError,
      "device_type='cuda:0': takes a device type, not a device", "device_type"),
    C("device-unknown", "fake", "init_device_mesh('tpu', (8,))", ArgumentError,
      "device_type='tpu': unknown device type", "device_type"),
    C("device-not-str", "fake", "init_device_mesh(0, (8,))", ArgumentTypeError,
      "device_type=0: expected str, got int", "device_type"),
    C("device-torch-device", "fake", "init_device_mesh(torch.device('cpu'), (8,))",
      ArgumentTypeError, "device_type=device(type='cpu'): expected str, got device",
      "device_type"),
    # -- explicit meshes -----------------------------------------------------------------
    C("mesh-ragged", "fake", "DeviceMesh('cpu', [[0, 1], [2]])", ArgumentError,
      "mesh=[[0, 1], [2]]: is ragged", "mesh"),
    C("mesh-duplicate-rank", "fake", "DeviceMesh('cpu', [[0, 1], [1, 2]])", ArgumentError,
      "mesh=[[0, 1], [1, 2]]: rank 1 appears twice", "mesh"),
    C("mesh-rank-outside", "fake", "DeviceMesh('cpu', [0, 8])", ArgumentError,
      "mesh=[0, 8]: rank 8 is outside the world of 8 ranks", "mesh"),
    C("mesh-rank-negative", "fake", "DeviceMesh('cpu', [-1, 0])", ArgumentError,
      "mesh=[-1, 0]: rank -1 is outside the world of 8 ranks", "mesh"),
    C("mesh-rank-float", "fake", "DeviceMesh('cpu', [0.0, 1.0])", ArgumentTypeError,
      "mesh=[0.0, 1.0]: holds 0.0 (float); ranks are ints", "mesh"),
    C("mesh-float-tensor", "fake", "DeviceMesh('cpu', torch.tensor([0.0, 1.0]))",
      ArgumentTypeError, "mesh=array([0., 1.], dtype=float32): holds 0.0 (float)", "mesh"),
    C("mesh-rank-bool", "fake", "DeviceMesh('cpu', [True, False])", ArgumentTypeError,
      "mesh=[True, False]: holds True (bool); ranks are ints", "mesh"),
    C("mesh-empty", "fake", "DeviceMesh('cpu', [])", ArgumentError, "mesh=[]: is empty",
      "mesh"),
    C("mesh-scalar", "fake", "DeviceMesh('cpu', 5)", ArgumentError,
      "mesh=5: is a single value, not an array of ranks", "mesh"),
    # -- slicing -------------------------------------------------------------------------
    C("slice-unknown", "fake", "mesh['pp']", UnknownDimError,
      "mesh[...]='pp': is not a dim name of this mesh", "mesh[...]"),
    C("slice-repeated", "fake", "mesh['dp', 'dp']", ArgumentError,
      "mesh[...]=('dp', 'dp'): repeats a name", "mesh[...]"),
    C("slice-empty", "fake", "mesh[()]", ArgumentError, "mesh[...]=(): is empty", "mesh[...]"),
    C("slice-out-of-order", "fake", "mesh['tp', 'dp']", ArgumentError,
      "mesh[...]=('tp', 'dp'): names are out of mesh order", "mesh[...]"),
    C("slice-by-index", "fake", "mesh[0]", ArgumentTypeError,
      "mesh[...]=0: expected dim name or tuple of names, got int", "mesh[...]"),
    C("slice-name-not-str", "fake", "mesh['dp', 1]", ArgumentTypeError,
      "mesh[...]=('dp', 1): holds 1 (int); dims are sliced by name", "mesh[...]"),
    C("slice-unnamed-mesh", "fake", "unnamed['dp']", ArgumentError,
      "mesh[...]='dp': is not a dim name of this mesh", "mesh[...]"),
    # -- get_group / get_local_rank / get_rank / size ------------------------------------
    C("group-index-high", "fake", "mesh.get_group(2)", ArgumentError,
      "mesh_dim=2: is out of range for a 2-d mesh", "mesh_dim"),
    C("group-index-low", "fake", "mesh.get_group(-3)", ArgumentError,
      "mesh_dim=-3: is out of range for a 2-d mesh", "mesh_dim"),
    C("group-unknown-name", "fake", "mesh.get_group('pp')", UnknownDimError,
      "mesh_dim='pp': is not a dim name of this mesh", "mesh_dim"),
    C("group-name-on-unnamed", "fake", "unnamed.get_group('dp')", ArgumentError,
      "mesh_dim='dp': is not a dim name of this mesh", "mesh_dim"),
    C("group-no-dim-nd", "fake", "mesh.get_group()", ArgumentError,
      "mesh_dim=None: is required on a 2-d mesh", "mesh_dim"),
    C("group-float-dim", "fake", "mesh.get_group(1.0)", ArgumentTypeError,
      "mesh_dim=1.0: expected int index or str name, got float", "mesh_dim"),
    C("local-rank-index-high", "fake", "mesh.get_local_rank(2)", ArgumentError,
      "mesh_dim=2: is out of range for a 2-d mesh", "mesh_dim"),
    C("local-rank-unknown-name", "fake", "mesh.get_local_rank('pp')", UnknownDimError,
      "mesh_dim='pp': is not a dim name of this mesh", "mesh_dim"),
    C("local-rank-no-dim-nd", "fake", "mesh.get_local_rank()", ArgumentError,
      "mesh_dim=None: is required on a 2-d mesh", "mesh_dim"),
    C("size-unknown-name", "fake", "mesh.size('pp')", UnknownDimError,
      "mesh_dim='pp': is not a dim name of this mesh", "mesh_dim"),
    C("rank-at-bad-coordinate", "fake", "mesh.get_rank((2, 0))", ArgumentError,
      "coordinate=(2, 0): is not a coordinate of shape (2, 4)", "coordinate"),
    # -- flatten / unflatten / backend_override ------------------------------------------
    C("flatten-empty-name", "fake", "mesh.flatten('')", ArgumentError,
      "name='': must be a non-empty str", "name"),
    C("flatten-name-taken", "fake", "mesh.flatten('dp')", ArgumentError,
      "name='dp': is already a dim of the root mesh", "name"),
    C("unflatten-not-dividing", "fake", "flat.unflatten('dp', (3, -1), ('a', 'b'))",
      ArgumentError, "sizes=(3, -1): the other sizes (3) do not divide the dim size 8",
      "sizes"),
    C("unflatten-names-missing", "fake", "flat.unflatten('dp', (2, 4))", ArgumentError,
      "names=None: is required on a named mesh", "names"),
    C("unflatten-unknown-dim", "fake", "flat.unflatten('tp', (2, 4), ('a', 'b'))",
      ArgumentError, "dim='tp': is not a dim name of this mesh", "dim"),
    C("override-unknown-backend", "fake",
      "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'), "
      "backend_override={'dp': 'ucc'})",
      ArgumentError, "backend_override={'dp': 'ucc'}: unknown backend 'ucc'",
      "backend_override"),
    C("override-unknown-dim", "fake",
      "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'), "
      "backend_override={'pp': 'fake'})",
      UnknownDimError, "backend_override='pp': is not a dim name of this mesh",
      "backend_override"),
    C("override-wrong-world", "fake",
      "init_device_mesh('cpu', (8,), backend_override=('gloo',))",
      ArgumentError, "backend_override=('gloo',): 'gloo' cannot run in a 'fake' world",
      "backend_override"),
    # -- membership ----------------------------------------------------------------------
    C("mesh-without-this-rank", "fake", "outside.get_group()", NotAMemberError,
      "get_group(): rank 3 is not in this mesh", "get_group()"),
    C("mesh-without-this-rank-slice", "fake", "outside_named['x']", NotAMemberError,
      "mesh['x']: rank 3 is not in this mesh", "mesh['x']"),
    C("collective-not-a-member", "fake", "dist.all_reduce(torch.ones(1), group=pair)",
      NotAMemberError, "all_reduce(): rank 3 is not in the group [0-1]", "all_reduce()"),
    C("collective-src-not-in-group", "fake",
      "dist.broadcast(torch.ones(1), src=5, group=quad)", ArgumentError,
      "src=5: is not a member of the 'tp' group [0-3]", "src"),
    C("new-group-duplicates", "fake", "dist.new_group([0, 0])", ArgumentError,
      "ranks=[0, 0]: contains duplicates", "ranks"),
    C("new-group-outside", "fake", "dist.new_group([0, 8])", ArgumentError,
      "ranks=[0, 8]: ranks 8 are outside the world of 8 ranks", "ranks"),
    # -- no world ------------------------------------------------------------------------
    C("no-world-init-device-mesh", "none", "init_device_mesh('cpu', (8,))",
      NotInitializedError, "init_device_mesh() needs a process group", "init_device_mesh()"),
    C("no-world-device-mesh", "none", "DeviceMesh('cpu', [0, 1])", NotInitializedError,
      "DeviceMesh() needs a process group", "DeviceMesh()"),
    C("no-world-new-group", "none", "dist.new_group([0])", NotInitializedError,
      "new_group() needs a process group", "new_group()"),
    C("no-world-collective", "none", "dist.all_reduce(torch.ones(1))", NotInitializedError,
      "all_reduce() needs a process group", "all_reduce()"),
    C("no-world-destroy", "none", "dist.destroy_process_group()", NotInitializedError,
      "destroy_process_group() needs a process group", "destroy_process_group()"),
    C("destroyed-get-group", "destroyed", "mesh.get_group('tp')", NotInitializedError,
      "get_group(): this mesh belongs to a destroyed world", "get_group()"),
    C("destroyed-get-coordinate", "destroyed", "mesh.get_coordinate()", NotInitializedError,
      "get_coordinate(): this mesh belongs to a destroyed world", "get_coordinate()"),
    C("destroyed-flatten", "destroyed", "mesh.flatten()", NotInitializedError,
      "flatten(): this mesh belongs to a destroyed world", "flatten()"),
    C("destroyed-collective", "destroyed", "dist.all_reduce(torch.ones(1), group=quad)",
      NotInitializedError, "all_reduce(): the 'tp' group [0-3] belongs to a destroyed world",
      "all_reduce()"),
    C("destroyed-mesh-in-new-world", "renewed", "mesh.get_group('tp')", NotInitializedError,
      "get_group(): this mesh belongs to a destroyed world", "get_group()"),
    C("destroyed-init-device-mesh", "destroyed", "init_device_mesh('cpu', (8,))",
      NotInitializedError, "init_device_mesh() needs a process group", "init_device_mesh()"),
    # -- collectives on a real gloo rank ---------------------------------------------------
    C("gloo-wrong-dtype", "gloo", "dist.all_reduce(torch.zeros(2, dtype=torch.complex64))",
      ArgumentError, "tensor='<tensor of torch.complex64>': gloo cannot move this dtype",
      "tensor"),
    C("gloo-wrong-device", "gloo", "dist.all_reduce(torch.zeros(2, device='meta'))",
      ArgumentError, "tensor='<tensor on meta>': gloo groups move CPU tensors only", "tensor"),
    C("gloo-not-a-tensor", "gloo", "dist.all_reduce([1.0])", ArgumentTypeError,
      "tensor=[1.0]: expected torch.Tensor or numpy.ndarray, got list", "tensor"),
    C("gloo-read-only-array", "gloo", "dist.all_reduce(np.frombuffer(bytes(16)))",
      ArgumentError, "tensor='<read-only ndarray>': is read-only", "tensor"),
    C("gloo-op-as-str", "gloo", "dist.all_reduce(torch.zeros(2), op='sum')",
      ArgumentTypeError, "op='sum': expected tensorplay ReduceOp, got str", "op"),
    C("gloo-avg-of-ints", "gloo", "dist.all_reduce(np.ones(2, dtype=np.int64), "
      "op=dist.ReduceOp.AVG)", ArgumentError,
      "op='ReduceOp.AVG': cannot average torch.int64 values", "op"),
    C("gloo-wrong-numel", "gloo",
      "dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(2))", ArgumentError,
      "output_tensor='<3 elements>': needs 2 elements", "output_tensor"),
    # -- collectives and meshes on a real MPI rank (a child process) -----------------------
    C("mpi-bfloat16-reduce", "mpi", "dist.all_reduce(torch.ones(2, dtype=torch.bfloat16))",
      ArgumentError, "tensor='<tensor of torch.bfloat16>': MPI cannot reduce bfloat16 "
      "correctly (MPICH rejects it, Open MPI returns wrong sums), so nothing was sent",
      "tensor"),
    C("mpi-complex-max", "mpi",
      "dist.all_reduce(np.ones(2, dtype=np.complex64), op=dist.ReduceOp.MAX)", ArgumentError,
      "op='ReduceOp.MAX': cannot order complex64 values", "op"),
    C("mpi-avg-of-ints", "mpi", "dist.all_reduce(np.ones(2, dtype=np.int32), "
      "op=dist.ReduceOp.AVG)", ArgumentError,
      "op='ReduceOp.AVG': cannot average int32 values", "op"),
    C("mpi-cuda-mesh", "mpi", "init_device_mesh('cuda', (1,))", ArgumentError,
      "device_type='cuda': the mpi backend moves CPU memory only", "device_type"),
    C("mpi-under-torchrun", "mpi-none", "dist.init_process_group('mpi')", LaunchEnvError,
      "init_process_group('mpi'): the launcher (torchrun) says rank 0 of 2, but MPI sees a "
      "world of 1", "init_process_group('mpi')",
      env={"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}),
    C("mpi-init-method", "mpi-none",
      "dist.init_process_group('mpi', 'tcp://127.0.0.1:1', rank=0, world_size=1)",
      ArgumentError, "init_method='tcp://127.0.0.1:1': the mpi backend joins the world that "
      "mpiexec started", "init_method"),
    # -- init_process_group ----------------------------------------------------------------
    C("init-unknown-backend", "none", "dist.init_process_group('ucc', rank=0, world_size=1)",
      ArgumentError, "backend='ucc': unknown backend", "backend"),
    C("init-backend-not-str", "none", "dist.init_process_group(3, rank=0, world_size=1)",
      ArgumentTypeError, "backend=3: expected str, got int", "backend"),
    C("init-rank-too-big", "none", "dist.init_process_group('fake', rank=8, world_size=8)",
      ArgumentError, "rank=8: must be in 0..7 for world_size=8", "rank"),
    C("init-rank-bool", "none", "dist.init_process_group('fake', rank=True, world_size=2)",
      ArgumentTypeError, "rank=True: expected int, got bool", "rank"),
    C("init-world-size-zero", "none", "dist.init_process_group('fake', rank=0, world_size=0)",
      ArgumentError, "world_size=0: must be at least 1", "world_size"),
    C("init-world-size-float", "none",
      "dist.init_process_group('fake', rank=0, world_size=2.0)", ArgumentTypeError,
      "world_size=2.0: expected int, got float", "world_size"),
    C("init-timeout-zero", "none",
      "dist.init_process_group('fake', rank=0, world_size=2, timeout=0)", ArgumentError,
      "timeout=0: must be positive", "timeout"),
    C("init-timeout-str", "none",
      "dist.init_process_group('fake', rank=0, world_size=2, timeout='60')", ArgumentTypeError,
      "timeout='60': expected datetime.timedelta or seconds, got str", "timeout"),
    C("init-timeout-env", "none", "dist.init_process_group('fake', rank=0, world_size=2)",
      LaunchEnvError, "TENSORPLAY_TIMEOUT='soon': expected a positive number of seconds",
      "TENSORPLAY_TIMEOUT", env={"TENSORPLAY_TIMEOUT": "soon"}),
    C("init-strict-not-bool", "none",
      "dist.init_process_group('fake', rank=0, world_size=2, strict='yes')", ArgumentTypeError,
      "strict='yes': expected bool, got str", "strict"),
    C("init-strict-env", "none", "dist.init_process_group('fake', rank=0, world_size=2)",
      LaunchEnvError, "TENSORPLAY_STRICT='yes': expected 1 or 0", "TENSORPLAY_STRICT",
      env={"TENSORPLAY_STRICT": "yes"}),
    C("init-progress-env", "none", "dist.init_process_group('fake', rank=0, world_size=2)",
      LaunchEnvError, "TENSORPLAY_PROGRESS_S='-1': expected a non-negative number of seconds",
      "TENSORPLAY_PROGRESS_S", env={"TENSORPLAY_PROGRESS_S": "-1"}),
    C("init-method-scheme", "none",
      "dist.init_process_group('gloo', 'http://127.0.0.1:1', rank=0, world_size=1)",
      ArgumentError, "init_method='http://127.0.0.1:1': unknown scheme", "init_method"),
    C("init-method-no-port", "none",
      "dist.init_process_group('gloo', 'tcp://127.0.0.1', rank=0, world_size=1)",
      ArgumentError, "init_method='tcp://127.0.0.1': needs a host and a port", "init_method"),
    C("init-method-not-str", "none",
      "dist.init_process_group('gloo', 5, rank=0, world_size=1)", ArgumentTypeError,
      "init_method=5: expected str, got int", "init_method"),
    C("init-env-no-master", "none", "dist.init_process_group('gloo', rank=0, world_size=2)",
      LaunchEnvError, "init_process_group(init_method='env://'): MASTER_ADDR and MASTER_PORT "
      "not set", "MASTER_ADDR"),
    C("init-no-rank", "none", "dist.init_process_group('fake')", LaunchEnvError,
      "init_process_group: rank not given and RANK is not set", "RANK"),
    C("init-twice", "fake", "dist.init_process_group('fake', rank=0, world_size=8)",
      AlreadyInitializedError, "init_process_group: this process already joined a world",
      "init_process_group"),
    # -- torch's DeviceMesh and distributed tensors ------------------------------------------
    C("to-torch-simulated", "fake", "mesh.to_torch()", BackendError,
      "to_torch(): a simulated ('fake') world has no torch process groups", "to_torch()"),
    C("to-torch-simulated-slice", "fake", "mesh['tp'].to_torch()", BackendError,
      "to_torch(): a simulated ('fake') world has no torch process groups", "to_torch()"),
    C("to-torch-destroyed", "destroyed", "mesh.to_torch()", NotInitializedError,
      "to_torch(): this mesh belongs to a destroyed world", "to_torch()"),
    C("from-torch-no-world", "none", "DeviceMesh.from_torch(None)", NotInitializedError,
      "DeviceMesh.from_torch() needs a process group", "DeviceMesh.from_torch()"),
    C("from-torch-simulated", "fake", "DeviceMesh.from_torch(mesh)", BackendError,
      "DeviceMesh.from_torch(): a simulated ('fake') world cannot adopt torch_mesh",
      "torch_mesh"),
    C("from-torch-not-a-mesh", "gloo", "DeviceMesh.from_torch([0])", ArgumentTypeError,
      "torch_mesh=[0]: expected a torch DeviceMesh, got list", "torch_mesh"),
    C("distribute-tensor-bad-mesh", "fake", "distribute_tensor(torch.ones(4), 'tp')",
      ArgumentTypeError, "device_mesh='tp': expected tensorplay DeviceMesh (or torch's), "
      "got str", "device_mesh"),
    C("distribute-tensor-simulated", "fake", "distribute_tensor(torch.ones(4), mesh['tp'], "
      "[Shard(0)])", BackendError,
      "to_torch(): a simulated ('fake') world has no torch process groups", "to_torch()"),
    C("from-local-bad-mesh", "fake", "DTensor.from_local(torch.ones(2), [0, 1])",
      ArgumentTypeError, "device_mesh=[0, 1]: expected tensorplay DeviceMesh (or torch's), "
      "got list", "device_mesh"),
    C("parallelize-bad-mesh", "fake", "parallelize_module(torch.nn.Linear(2, 2), 5)",
      ArgumentTypeError, "device_mesh=5: expected tensorplay DeviceMesh (or torch's), got int",
      "device_mesh"),
]
if not torch.distributed.is_nccl_available():
    CASES.append(C("init-nccl-unavailable", "none",
                   "dist.init_process_group('nccl', 'tcp://127.0.0.1:1', rank=0, world_size=1)",
                   BackendError, "backend='nccl' is not available in this torch build",
                   "backend"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_meshes() -> dict[str, object]:
    """The meshes the fake-world calls use, on rank 3 of 8."""
    return {
        "mesh": init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")),
        "unnamed": init_device_mesh("cpu", (2, 4)),
        "flat": init_device_mesh("cpu", (8,), mesh_dim_names=("dp",)),
        "outside": DeviceMesh("cpu", [0, 1]),
        "outside_named": DeviceMesh("cpu", [0, 1], mesh_dim_names=("x",)),
        "pair": dist.new_group([0, 1]),
        "quad": dist.new_group([0, 1, 2, 3]),
    }


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and no world before or after the test."""
    for name in list(os.environ):
        if name in LAUNCH_VARS or name.startswith(LAUNCH_PREFIXES):
            monkeypatch.delenv(name)
    if dist.is_initialized():
        dist.destroy_process_group()
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def _setup(case: Case) -> dict[str, object]:
    from tensorplay.distributed import tensor
    from tensorplay.distributed.tensor.parallel import parallelize_module

    names: dict[str, object] = {"init_device_mesh": init_device_mesh, "DeviceMesh": DeviceMesh,
                                "dist": dist, "torch": torch, "np": np,
                                "distribute_tensor": tensor.distribute_tensor,
                                "DTensor": tensor.DTensor, "Shard": tensor.Shard,
                                "parallelize_module": parallelize_module}
    if case.world in ("fake", "destroyed", "renewed"):
        dist.init_process_group("fake", rank=3, world_size=8)
        names.update(_fake_meshes())
        if case.world != "fake":
            dist.destroy_process_group()
        if case.world == "renewed":
            dist.init_process_group("fake", rank=3, world_size=8)
    elif case.world == "gloo":
        dist.init_process_group("gloo", f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=30)
    return names


IN_PROCESS = [c for c in CASES if not c.world.startswith("mpi")]
IN_MPI_CHILD = [c for c in CASES if c.world.startswith("mpi")]
_CHILD = """
import json, sys
import numpy as np
torch = __import__("torch") if "torch." in sys.argv[2] else None  # 2 s to import: when used
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
if sys.argv[1] == "mpi":
    dist.init_process_group("mpi", rank=0, world_size=1, timeout=30)
try:
    eval(sys.argv[2])
    print(json.dumps(None))
except Exception as err:
    print(json.dumps([[c.__name__ for c in type(err).__mro__], str(err)]))
"""


def _made(world) -> tuple:
    """What a refused call must leave as it was: groups made and registered, SPMD counts."""
    return world.registry.created, len(world.registry.groups()), world.spmd.counts()


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.id for c in IN_PROCESS])
def test_bad_input(case: Case, clean_env):
    for name, value in case.env.items():
        clean_env.setenv(name, value)
    names = _setup(case)
    world = world_module._WORLD
    before = None if world is None else _made(world)
    with pytest.raises(case.error) as caught:
        eval(case.call, names)  # noqa: S307 - our own table of calls
    err = caught.value
    message = str(err)
    assert isinstance(err, DistributedError)
    assert message.startswith(case.start), message
    assert case.arg in message, message
    assert "Fix" in message, message
    if isinstance(err, ArgumentError):
        assert isinstance(err, ValueError)
    if isinstance(err, ArgumentTypeError):
        assert isinstance(err, TypeError)
    if isinstance(err, UnknownDimError):  # code written for PyTorch's mesh catches KeyError
        assert isinstance(err, KeyError)
    assert world_module._WORLD is world  # a bad init_process_group joins no world
    if case.world == "fake":
        assert _made(world) == before  # nothing made
        good = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert good.get_coordinate() == [0, 3]
        assert good.get_group("tp").ranks == [0, 1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                    reason="mpi4py is not installed (pip install -e '.[mpi]')")
@pytest.mark.parametrize("case", IN_MPI_CHILD, ids=[c.id for c in IN_MPI_CHILD])
def test_bad_input_on_mpi(case: Case):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    done = subprocess.run([sys.executable, "-c", _CHILD, case.world, case.call],
                          env={**env, **case.env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    caught = json.loads(done.stdout.strip().splitlines()[-1])
    assert caught is not None, f"{case.call} did not raise"
    types, message = caught
    assert case.error.__name__ in types and "DistributedError" in types, types
    assert message.startswith(case.start), message
    assert case.arg in message and "Fix" in message, message


def test_a_failed_init_leaves_no_world_and_a_good_one_follows(clean_env):
    with pytest.raises(ArgumentError):
        dist.init_process_group("fake", rank=8, world_size=8)
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=7, world_size=8)
    assert dist.get_rank() == 7


def test_an_unknown_dim_is_caught_as_a_key_error(clean_env):
    dist.init_process_group("fake", rank=3, world_size=8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    try:
        mesh["pp"]
    except KeyError as err:
        assert str(err).startswith("mesh[...]='pp': is not a dim name of this mesh")
    else:
        raise AssertionError("mesh['pp'] did not raise")


def test_there_are_many_cases():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def markdown_rows() -> list[str]:
    """The catalogue table of docs/bad_inputs.md, one row per case."""
    rows = ["| id | where | call | error | message starts with |",
            "| --- | --- | --- | --- | --- |"]
    for c in CASES:
        env = "".join(f"{k}={v} " for k, v in c.env.items())
        rows.append(f"| {c.id} | {c.world} | `{env}{c.call}` | {c.error.__name__} | "
                    f"`{c.start}` |")
    return rows


def test_docs_catalogue_matches_the_cases():
    catalogue = DOC.read_text().split("## The catalogue", 1)[1].split("\n## ", 1)[0]
    documented = [line for line in catalogue.splitlines() if line.startswith("| ")]
    expected = markdown_rows()
    missing = [row for row in expected if row not in documented]
    extra = [row for row in documented if row not in expected
             and not row.startswith("| init-nccl-unavailable ")]
    assert not missing and not extra, (
        f"docs/bad_inputs.md is out of date; regenerate with "
        f"python tests/distributed/test_bad_inputs.py\nmissing: {missing}\nextra: {extra}")


if __name__ == "__main__":
    print("\n".join(markdown_rows()))
