"""tensorplay.distributed.fsdp: fully_shard on our mesh, FSDP or HSDP chosen by the roles.

In this process: which dims each mesh gives torch (pure, on ``AbstractMesh``), every refusal
and its message on a simulated world of 8 (nothing is created), a 1-rank gloo world for the
calls that reach torch. On 4 real gloo ranks: FSDP over a "shard" slice and HSDP over (2, 2)
views train a small model exactly as one process does, on our groups.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.errors import (
    ArgumentError,
    ArgumentTypeError,
    NotAMemberError,
    UnknownDimError,
)
from tensorplay.distributed.fsdp import FSDPModule, data_parallel_dims, fully_shard
from tensorplay.distributed.geometry.roles import AbstractMesh
from tensorplay.distributed.job import lifecycle as world_module
from tests import spawn, timing

ROLES3 = {"dp_replicate": "replicate", "dp_shard": "shard", "tp": "tensor"}


ROOT = Path(__file__).resolve().parents[3]


def test_the_docs_show_the_example_whole():
    doc = (ROOT / "docs" / "distributed_tensors.md").read_text()
    shown = re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n<!-- /example -->", doc,
                       re.DOTALL)
    assert [path for path, _ in shown] == ["examples/fsdp_roles.py"]
    for path, text in shown:
        assert text == (ROOT / path).read_text(), f"docs/distributed_tensors.md: {path} differs"
        assert "from tensorplay.distributed.fsdp import fully_shard" in text


# -- which dims: pure ---------------------------------------------------------------------------
@pytest.mark.parametrize("mesh, roles, dims", [
    (AbstractMesh(("dp",), (4,), (None,)), None, (None, "dp")),  # torch's default: shard
    (AbstractMesh(("dp",), (4,), ("shard",)), None, (None, "dp")),
    (AbstractMesh(None, (4,), (None,)), None, (None, None)),
    (AbstractMesh(("r", "s"), (2, 2), ("replicate", "shard")), None, ("r", "s")),
    (AbstractMesh(("r", "s"), (2, 2), (None, None)), {"r": "replicate", "s": "shard"},
     ("r", "s")),
    # the call's roles replace the mesh's
    (AbstractMesh(("a", "b"), (2, 2), ("shard", "replicate")), {"a": "replicate", "b": "shard"},
     ("a", "b")),
    (AbstractMesh(("dp",), (4,), ("replicate",)), {"dp": "shard"}, (None, "dp")),
])
def test_the_roles_say_which_dim_replicates_and_which_shards(mesh, roles, dims):
    assert data_parallel_dims(mesh, roles) == dims


A = AbstractMesh
REFUSED = [
    ("tp", A(("dp", "tp"), (2, 4), ("shard", "tensor")), None,
     "holds dims that are not data-parallel (roles 'tensor')", "mesh['dp'] (FSDP)"),
    ("3d", A(("dp_replicate", "dp_shard", "tp"), (2, 2, 2), ("replicate", "shard", "tensor")),
     None, "roles 'tensor'", "mesh['dp_shard'] (FSDP) or mesh['dp_replicate', 'dp_shard'] (HSDP)"),
    ("3d-no-roles", A(("a", "b", "c"), (2, 2, 2), (None,) * 3), None, "has 3 dims",
     "mesh['dp_shard'] (FSDP) or mesh['dp_replicate', 'dp_shard'] (HSDP)"),
    ("2d-no-roles", A(("a", "b"), (2, 4), (None, None)), None, "is 2-d without roles",
     "mesh_dim_roles={'a': 'replicate', 'b': 'shard'}"),
    ("2d-no-names", A(None, (2, 4), (None, None)), None, "is 2-d without dim names",
     "mesh_dim_names"),
    ("shard-first", A(("s", "r"), (2, 4), ("shard", "replicate")), None,
     "has its 'shard' dim before its 'replicate' dim", "replicate dim first"),
    ("1d-replicate", A(("dp",), (8,), ("replicate",)), None, "its one dim has role 'replicate'",
     "give that dim role 'shard'"),
    ("1d-tensor", A(("tp",), (8,), ("tensor",)), None, "its one dim has role 'tensor'",
     "give that dim role 'shard'"),
    ("2d-half-roles", A(("a", "b"), (2, 4), (None, "shard")), None, "has 2 dims", "mesh['b']"),
    ("roles-arg-2d", A(("a", "b"), (2, 4), (None, None)), {"a": "replicate"}, "has 2 dims",
     "mesh_dim_roles=..."),
]


@pytest.mark.parametrize("mesh, roles, problem, fix", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_a_mesh_that_is_not_data_parallel_is_refused_with_its_dims_roles_and_fix(
        mesh, roles, problem, fix):
    with pytest.raises(ArgumentError) as caught:
        data_parallel_dims(mesh, roles)
    message = str(caught.value)
    names = mesh.names if mesh.names is not None else "None"
    assert message.startswith(f"mesh=AbstractMesh(names={names}"), message
    assert problem in message and "Fix: " in message and fix in message, message


def test_bad_roles_name_the_argument():
    with pytest.raises(UnknownDimError, match=r"^mesh_dim_roles=\{'c': 'shard'\}: names 'c'"):
        data_parallel_dims(A(("a", "b"), (2, 2), (None, None)), {"c": "shard"})
    with pytest.raises(ArgumentError, match=r"^mesh_dim_roles=.*unknown role 'sharded'"):
        data_parallel_dims(A(("a",), (2,), (None,)), {"a": "sharded"})


# -- fully_shard's door, on a simulated world: nothing is made ----------------------------------
def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _fake_meshes(fake_world):
    fake_world(3, 8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
                            mesh_dim_roles=ROLES3)
    return {"mesh": mesh, "plain": init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b")),
            "outside": dist.DeviceMesh("cpu", [0, 1], mesh_dim_names=("x",))}


DOOR = [
    ("whole-mesh", "fully_shard(_model(), mesh=mesh)", ArgumentError,
     "mesh=AbstractMesh(names=('dp_replicate', 'dp_shard', 'tp')",
     "mesh['dp_replicate', 'dp_shard']"),
    ("no-roles-2d", "fully_shard(_model(), mesh=plain)", ArgumentError,
     "mesh=AbstractMesh(names=('a', 'b')", "mesh_dim_roles={'a': 'replicate', 'b': 'shard'}"),
    ("module-type", "fully_shard('model', mesh=mesh['dp_shard'])", ArgumentTypeError,
     "module='model': expected torch.nn.Module", "Fix"),
    ("module-empty-list", "fully_shard([], mesh=mesh['dp_shard'])", ArgumentTypeError,
     "module=[]", "Fix"),
    ("mesh-type", "fully_shard(_model(), mesh=[0, 1])", ArgumentTypeError,
     "mesh=[0, 1]: expected tensorplay DeviceMesh", "mesh['dp_shard']"),
    ("keyword", "fully_shard(_model(), mesh=mesh['dp_shard'], reshard_after_fwd=True)",
     ArgumentError, "reshard_after_fwd=True: is not an argument of torch's fully_shard",
     "reshard_after_forward"),
    ("roles-with-torch-mesh", "fully_shard(_model(), mesh=None, mesh_dim_roles={'a': 'shard'})",
     ArgumentError, "mesh_dim_roles={'a': 'shard'}: gives roles to tensorplay's mesh only",
     "drop mesh_dim_roles"),
    ("roles-and-dp-mesh-dims", "fully_shard(_model(), mesh=mesh, mesh_dim_roles={'tp': 'shard'}"
     ", dp_mesh_dims=object())", ArgumentError, "mesh_dim_roles={'tp': 'shard'}: and "
     "dp_mesh_dims both", "pass one of them"),
    ("outside", "fully_shard(_model(), mesh=outside)", NotAMemberError,
     "fully_shard(mesh=DeviceMesh('cpu', x=2; mesh=[0, 1])): rank 3 is not in this mesh",
     "call fully_shard only on the mesh's ranks"),
]


@pytest.mark.parametrize("call, error, start, fix", [c[1:] for c in DOOR],
                         ids=[c[0] for c in DOOR])
def test_fully_shard_checks_everything_before_it_makes_anything(fake_world, call, error, start,
                                                                fix):
    names = {**_fake_meshes(fake_world), "fully_shard": fully_shard, "_model": _model}
    world = world_module._WORLD
    before = (world.registry.created, len(world.registry.groups()), world.spmd.counts())
    with pytest.raises(error) as caught:
        eval(call, names)  # noqa: S307 - our own table of calls
    message = str(caught.value)
    assert message.startswith(start), message
    assert "Fix: " in message and fix in message, message
    assert (world.registry.created, len(world.registry.groups()), world.spmd.counts()) == before


def test_a_mesh_of_a_destroyed_world_is_refused(fake_world):
    mesh = _fake_meshes(fake_world)["mesh"]["dp_shard"]
    dist.destroy_process_group()
    with pytest.raises(dist.NotInitializedError, match="destroyed world. Fix: "):
        fully_shard(_model(), mesh=mesh)


def test_a_good_mesh_reaches_the_engine_only_after_the_checks(fake_world):
    meshes = _fake_meshes(fake_world)
    with pytest.raises(dist.BackendError, match="to_torch"):  # a simulated world has no torch
        fully_shard(_model(), mesh=meshes["mesh"]["dp_replicate", "dp_shard"])


# -- our mesh handed to torch --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["_flatten_rank_map", "_get_root_mesh", "_dim_group_names",
                                  "_layout", "_pg_registry"])
def test_a_torch_internal_read_from_our_mesh_says_pass_to_torch(fake_world, name):
    fake_world(3, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(dist.NotATorchMeshError) as caught:
        getattr(mesh, name)
    message = str(caught.value)
    assert message.startswith(f"mesh.{name}: this is tensorplay's DeviceMesh, not torch's")
    assert "Fix: pass mesh.to_torch() to torch functions" in message
    assert "tensorplay.distributed.fsdp.fully_shard" in message
    assert isinstance(caught.value, AttributeError) and caught.value.name == name
    assert not hasattr(mesh, name) and getattr(mesh, name, "default") == "default"


def test_other_missing_attributes_stay_plain_and_copies_still_work(fake_world):
    import copy as copying
    import pickle

    fake_world(3, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for name in ("nothing_here", "__array_interface__"):
        with pytest.raises(AttributeError) as caught:
            getattr(mesh, name)
        assert not isinstance(caught.value, dist.NotATorchMeshError)
        assert str(caught.value) == f"'DeviceMesh' object has no attribute {name!r}"
    assert copying.copy(mesh) == mesh and copying.deepcopy(mesh) == mesh
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert mesh.get_group("tp").ranks == [0, 1, 2, 3]  # our own private fields still answer


def test_a_torch_function_that_reads_torch_internals_names_the_fix(gloo1):
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with pytest.raises(dist.NotATorchMeshError, match="pass mesh.to_torch()"):
        TorchMesh._concatenate([mesh, mesh])  # FSDP2 + TP joins meshes so


def test_torch_s_own_fully_shard_handed_our_mesh_names_the_fix_before_it_wraps(gloo1):
    """torch's fully_shard reads only public members of the mesh; it asks for a group
    before it changes the module, and that is where it is told to pass mesh.to_torch()."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = _model()
    with pytest.raises(dist.NotATorchMeshError) as caught:
        torch_fully_shard(model, mesh=mesh)
    assert str(caught.value).startswith(
        "mesh.get_group(): this is tensorplay's DeviceMesh, not torch's; a torch function "
        "asked it for a group (torch.distributed.fsdp."), caught.value
    assert "Fix: pass mesh.to_torch() to torch functions" in str(caught.value)
    assert not isinstance(model, FSDPModule)  # nothing was wrapped
    assert mesh.get_group("dp").ranks == [0]  # asked by anyone else, it answers


# -- on a real 1-rank world ----------------------------------------------------------------------
def test_fully_shard_runs_on_the_mesh_to_torch_gives(gloo1):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"),
                            mesh_dim_roles={"dp_replicate": "replicate", "dp_shard": "shard"})
    fsdp = fully_shard(_model(), mesh=mesh["dp_shard"], reshard_after_forward=False)
    hsdp = fully_shard(_model(), mesh=mesh)
    assert isinstance(fsdp, FSDPModule) and isinstance(hsdp, FSDPModule)
    assert next(fsdp.parameters()).device_mesh is mesh["dp_shard"].to_torch()
    assert next(hsdp.parameters()).device_mesh is mesh.to_torch()
    torch_mesh = mesh.to_torch()["dp_shard"]
    passed = fully_shard(_model(), mesh=torch_mesh)  # torch's mesh: unchanged
    assert next(passed.parameters()).device_mesh == torch_mesh


# -- on 4 real gloo ranks ------------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(6, 8, dtype=torch.float64)
        self.down = torch.nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


STEPS, BATCH = 3, 8


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen, dtype=torch.float64),
             torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def _train(model: torch.nn.Module, part: slice) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for x, y in _batches():
        ((model(x[part]) - y[part]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def hsdp_job(rank: int):
    from torch.distributed import distributed_c10d as c10d

    reference = Tiny()
    _train(reference, slice(None))  # one process, the whole batch
    line = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    built = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"),
                             mesh_dim_roles={"dp_replicate": "replicate", "dp_shard": "shard"})
    meshes = {
        "fsdp": (built["dp_shard"], None),
        "hsdp": (built, None),
        "view": (line.reshape((2, 2), ("r", "s")), {"r": "replicate", "s": "shard"}),
    }
    # the groups' descriptions name the dims, as torch's own meshes name theirs
    out: dict = {"descs": [g.engine_group.group_desc for g in built.get_all_groups()]}
    for kind, (mesh, roles) in meshes.items():
        groups = len(c10d._world.pg_map)
        model = Tiny()
        fully_shard(model, mesh=mesh, mesh_dim_roles=roles)
        made = len(c10d._world.pg_map) - groups
        # each rank trains on its own part of every batch: its row-major position in the
        # mesh (FSDP over a pair [r, r + 1] splits the batch in two, HSDP over 4 in four)
        coord = mesh.get_coordinate()
        me = coord[0] * mesh.size(1) + coord[1] if mesh.ndim == 2 else coord[0]
        share = BATCH // mesh.size()
        _train(model, slice(me * share, (me + 1) * share))
        diff = max((p.full_tensor() - q).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        param = next(model.parameters())
        out[kind] = {"diff": diff, "made": made, "names": param.device_mesh.mesh_dim_names,
                     "groups": [g is ours.engine_group for g, ours in
                                zip(param.device_mesh.get_all_groups(),
                                    mesh.get_all_groups(), strict=True)]}
    return out


@pytest.mark.slow
def test_fsdp_and_hsdp_on_our_mesh_train_like_one_process():
    for rank, out in enumerate(spawn.run(hsdp_job, 4, timeout=timing.bound(0, 120))):
        assert out["descs"] == ["mesh_dp_replicate", "mesh_dp_shard"]
        for kind, names in (("fsdp", ("dp_shard",)), ("hsdp", ("dp_replicate", "dp_shard")),
                            ("view", ("r", "s"))):
            got = out[kind]
            assert got["diff"] <= 1e-6, (rank, kind, got)
            assert got["made"] == 0 and all(got["groups"]), (rank, kind, got)  # ours, no new
            assert got["names"] == names, (rank, kind, got)
