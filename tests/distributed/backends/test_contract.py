"""The engine contract: every registered engine meets the core Protocol (``Engine``, and its
worlds' engine ``Joined``: the module's ``JOINED`` class) and each optional capability it
claims, member for member, with the Protocol's parameter names; the registry's engine keeps
no state of its own (a world's is its ``Joined``); no engine stubs what it lacks
("unreachable", AssertionError); and a capability an engine lacks is our typed error where the
package needs it, naming the engine.

The MPI engine is looked at in a child process: loading it starts MPI, and a running MPI
world would be adopted by a later init_process_group() of this process.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tensorplay.distributed import backends
from tensorplay.distributed.backends import protocol as _engine
from tensorplay.distributed.geometry.spec import Ranks

BACKENDS_DIR = Path(backends.__file__).resolve().parent
CAPABILITIES = (_engine.NativeMeshes, _engine.Severable, _engine.GathersText, _engine.Shrinks)
MODULES = sorted({module for _, module in backends._REGISTRY.values()})
LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_")
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TENSORPLAY_LAUNCHER", "GROUP_RANK"}
# engines whose module starts a world as it loads (mpi4py initialises MPI at import), looked
# at in a child process: init_process_group() of this one would adopt that world
LOADING_STARTS_A_WORLD = {"mpi"}


def _methods(protocol: type, inherited: bool = True) -> dict[str, list[list[str]]]:
    """A Protocol's methods (with its bases' of the seam, unless not ``inherited``): name ->
    [parameter name, kind] of each parameter but self."""
    layers = [k for k in reversed(protocol.__mro__) if k.__module__ == _engine.__name__]
    return {name: [[p.name, p.kind.name] for p in
                   list(inspect.signature(value).parameters.values())[1:]]
            for klass in (layers if inherited else [protocol])
            for name, value in vars(klass).items()
            if callable(value) and not name.startswith("_")}


def _parameters(value: Any, bound: bool) -> Any:
    """[name, kind] of each parameter of a member (the first, self, left out of a function
    read off its class), None when absent, "not callable" when not a method."""
    if value is None or not callable(value):
        return None if value is None else "not callable"
    params = [[p.name, p.kind.name] for p in inspect.signature(value).parameters.values()]
    return params if bound else params[1:]


def _describe(module: str) -> dict[str, Any]:
    """What one engine has (run in the child): its name, capabilities, its own state (none
    may be kept), the capabilities it claims, and for every member of the core and the
    capabilities its parameters; the same of its worlds' engine class (``JOINED``), whose
    own members are ``Joined``'s and the capabilities'."""
    engine = backends._load(module)
    joined = sys.modules[f"{backends.__name__}.{module}"].JOINED
    wanted = set(_methods(_engine.Engine)).union(*(_methods(c) for c in CAPABILITIES))
    world = set(_methods(_engine.Joined, inherited=False)).union(
        *(_methods(c) for c in CAPABILITIES))
    return {"name": engine.name, "capabilities": type(engine.capabilities).__name__,
            "data": {n: hasattr(engine, n) for n in _engine.Engine.__annotations__},
            "state": sorted(vars(engine)),
            "claims": [c.__name__ for c in CAPABILITIES if isinstance(engine, c)],
            "members": {n: _parameters(getattr(engine, n, None), True) for n in sorted(wanted)},
            "world": {"is_engine": isinstance(engine, joined) or issubclass(joined, type(engine)),
                      "claims": [c.__name__ for c in CAPABILITIES if issubclass(joined, c)],
                      "members": {n: _parameters(getattr(joined, n, None), False)
                                  for n in sorted(world)}}}


def _child_env() -> dict[str, str]:
    """This environment without launcher variables (MPI starts as a 1-process world)."""
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}


@pytest.fixture(scope="module")
def described() -> dict[str, Any]:
    """module -> what ``_describe`` found, for every installed engine (in a child process
    for an engine whose loading starts its world)."""
    installed = [module for module in MODULES if backends._installed(module)]
    children = {module: subprocess.Popen([sys.executable, __file__, module], env=_child_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
                for module in installed if module in LOADING_STARTS_A_WORLD}
    found = {module: _describe(module) for module in installed
             if module not in LOADING_STARTS_A_WORLD}
    for module, child in children.items():
        try:
            out, err = child.communicate(timeout=180)
        finally:
            child.kill()
        assert child.returncode == 0, err[-3000:]
        found[module] = json.loads(out.strip().splitlines()[-1])
    return found


def _engine_of(described: dict[str, Any], module: str) -> dict[str, Any]:
    if module not in described:
        dist, extra, _ = backends._NEEDS[module]
        pytest.skip(f"the {module} engine needs {dist}, which is not installed here "
                    f"(pip install 'tensorplay-distributed[{extra}]')")
    return described[module]


@pytest.mark.parametrize("module", MODULES)
def test_every_engine_meets_the_core_and_keeps_no_world(described, module):
    """The registry's engine meets ``Engine`` and holds no state (each world's is its
    ``Joined``); its worlds' engine class is an engine of its kind meeting ``Joined``."""
    engine = _engine_of(described, module)
    assert engine["capabilities"] == "Capabilities"
    assert all(engine["data"].values()), engine["data"]  # name and capabilities
    assert engine["state"] == [], f"{engine['name']} keeps {engine['state']}"
    for name, params in _methods(_engine.Engine).items():
        assert engine["members"][name] == params, (
            f"{engine['name']}.{name}: {engine['members'][name]}, the Protocol's: {params}")
    world = engine["world"]
    assert world["is_engine"], engine["name"]
    for name, params in _methods(_engine.Joined, inherited=False).items():
        assert world["members"][name] == params, (
            f"{engine['name']}'s world: {name} {world['members'][name]}, the Protocol's: "
            f"{params}")


@pytest.mark.parametrize("module", MODULES)
def test_every_capability_is_met_whole_or_not_at_all(described, module):
    """What isinstance (issubclass for a world's class) finds is all there, with the
    Protocol's parameters; a capability not claimed has none of its members (no half-met
    capability, no leftover stub)."""
    engine = _engine_of(described, module)
    for who, found in ((engine["name"], engine), (f"{engine['name']}'s world", engine["world"])):
        for capability in CAPABILITIES:
            methods = _methods(capability)
            if capability.__name__ in found["claims"]:
                for name, params in methods.items():
                    assert found["members"][name] == params, (
                        f"{who}.{name}: {found['members'][name]}, the "
                        f"{capability.__name__} Protocol's: {params}")
            else:
                present = [n for n in methods if found["members"][n] is not None]
                assert not present, f"{who} has {present} of {capability.__name__}"


def test_the_torch_engine_has_every_capability_and_the_others_none(described):
    """Per process (the registry's) and per world (``Started.engine``): the torch engine
    converts meshes in both, and severs groups in a world; MPI gathers texts and shrinks
    (ULFM) in a world."""
    claims = {module: (set(d["claims"]), set(d["world"]["claims"]))
              for module, d in described.items()}
    assert claims.get("torch_c10d", ({"NativeMeshes"}, {"NativeMeshes", "Severable"})) == (
        {"NativeMeshes"}, {"NativeMeshes", "Severable"})
    assert claims["fake"] == (set(), set())
    assert claims.get("mpi", (set(), {"GathersText", "Shrinks"})) == (
        set(), {"GathersText", "Shrinks"})


def _stubs(path: Path) -> list[str]:
    """Where ``path`` stubs a method: raises (or asserts into) AssertionError, or says
    "unreachable"."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant)
                and not node.test.value):  # ``assert False``; a narrowing assert is no stub
            found.append(f"{path.name}:{node.lineno}: assert")
        elif isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id == "AssertionError":
                found.append(f"{path.name}:{node.lineno}: raise AssertionError")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "unreachable" in node.value.lower()):
            found.append(f"{path.name}:{node.lineno}: 'unreachable'")
    comments = [f"{path.name}:{i}: 'unreachable'" for i, line in
                enumerate(path.read_text().splitlines(), 1)
                if "#" in line and "unreachable" in line.split("#", 1)[1].lower()]
    return found + comments


def test_no_engine_stubs_what_it_lacks():
    stubs = [s for path in sorted(BACKENDS_DIR.glob("*.py")) for s in _stubs(path)]
    assert not stubs, stubs


def test_the_stub_finder_finds_stubs(tmp_path):
    path = tmp_path / "stubbed.py"
    path.write_text('def sever(g):\n    raise AssertionError("unreachable: no")\n'
                    "def close(g):\n    assert False\n"
                    "def narrow(g):\n    assert g is not None\n")
    assert _stubs(path) == ["stubbed.py:2: raise AssertionError",
                            "stubbed.py:4: assert", "stubbed.py:2: 'unreachable'"]


# -- a capability an engine lacks is our error where the package needs it ------------------


def test_a_simulated_world_names_itself_where_torch_meshes_are_needed(fake_world):
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh

    fake_world(3, 8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for call in (mesh.to_torch, mesh["tp"].to_torch):
        with pytest.raises(dist.BackendError, match=r"^to_torch\(\): a simulated \('fake'\) "
                           "world has no torch process groups.*Fix: run on gloo or nccl"):
            call()
    with pytest.raises(dist.BackendError, match=r"^DeviceMesh.from_torch\(\): a simulated "
                       r"\('fake'\) world cannot adopt torch_mesh.*Fix"):
        DeviceMesh.from_torch(object())
    with pytest.raises(dist.ArgumentError, match="the fake engine has none"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"), elastic="dp")


class _StandIn:
    """A minimal real (not simulated) engine of a 1-rank world without a store, meeting the
    core only (as the engine of its world, ``Joined``): the fake engine's answers, its own
    name."""

    name = "ucx"
    capabilities = _engine.Capabilities(simulated=False, has_store=False)

    def __init__(self) -> None:
        from tensorplay.distributed.backends import fake

        self._fake = fake.ENGINE
        self.new_groups: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in _methods(_engine.Joined):
            return getattr(self._fake, name)
        raise AttributeError(name)

    def new_group(self, name: str, ranks: Any, backend: str, timeout: timedelta,
                  desc: str, *, apart: bool = False) -> Any:
        self.new_groups.append(name)
        return object()  # an engine group, that nothing may sever or close


@pytest.fixture
def stand_in_world():
    """A 1-rank world on ``_StandIn``, made as init_process_group makes one."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.job import lifecycle as world_module

    if dist.is_initialized():
        dist.destroy_process_group()
    engine = _StandIn()
    world_module._join(world_module.World(0, 1, "fake", timedelta(seconds=10), engine, None),
                       0.0)
    yield world_module._WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_stand_in_meets_the_core_and_claims_nothing():
    engine = _StandIn()
    for name, params in _methods(_engine.Joined).items():
        got = [[p.name, p.kind.name] for p in inspect.signature(getattr(engine, name))
               .parameters.values()]
        assert got == params, name
    assert not any(isinstance(engine, c) for c in CAPABILITIES)


def test_an_engine_without_native_meshes_is_named_in_the_backend_error(stand_in_world):
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("w",))
    made = list(stand_in_world.engine.new_groups)
    with pytest.raises(dist.BackendError, match=r"^to_torch\(\): a ucx world has no torch "
                       "process groups to build torch's DeviceMesh on. Fix: run on gloo"):
        mesh["w"].to_torch()
    assert stand_in_world.engine.new_groups == made  # refused before any group is made
    with pytest.raises(dist.BackendError, match=r"^DeviceMesh.from_torch\(\): a ucx world "
                       "cannot adopt torch_mesh: its groups belong to torch.distributed"):
        DeviceMesh.from_torch(object())


def test_an_engine_that_cannot_sever_gets_no_elastic_mesh_and_its_epochs_only_retire(
        stand_in_world):
    import torch.distributed as tdist

    import tensorplay.distributed as dist
    from tensorplay.distributed.control.store import StoreControl
    from tensorplay.distributed.device_mesh import init_device_mesh

    solo = stand_in_world.control  # give the world a Board, as a store would: only the engine
    stand_in_world.control = StoreControl(stand_in_world, tdist.HashStore())  # is lacking now
    with pytest.raises(dist.ArgumentError, match="elastic='w': needs an engine that can break "
                       "its groups in a recovery; the ucx engine cannot.*Fix"):
        init_device_mesh("cpu", (1,), mesh_dim_names=("w",), elastic="w")
    stand_in_world.control = solo
    group = stand_in_world.group(Ranks.of([0]), "gloo")  # another backend: not the world's
    engine_group = group.engine_group
    assert engine_group is not None
    stand_in_world.sever_epoch(0)  # nothing to break, and no error
    closed = stand_in_world.close_epoch("was closed", sever=True)
    assert closed == [engine_group]  # retired, handed back for let_go, never closed
    with pytest.raises(dist.StaleEpochError):
        dist.barrier(group)


_MPI_CHILD = """
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
dist.init_process_group("mpi", rank=0, world_size=1, timeout=30)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("w",))
for call in (mesh.to_torch, lambda: DeviceMesh.from_torch(object())):
    try:
        call()
    except dist.BackendError as err:
        print(err)
"""


@pytest.mark.skipif(not backends._installed("mpi"),
                    reason="the mpi engine needs mpi4py (pip install "
                    "'tensorplay-distributed[mpi]')")
def test_an_mpi_world_says_it_has_no_torch_meshes():
    done = subprocess.run([sys.executable, "-c", _MPI_CHILD], env=_child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    to_torch, from_torch = done.stdout.strip().splitlines()[-2:]
    assert to_torch == (
        "to_torch(): an mpi world has no torch process groups to build torch's DeviceMesh "
        "on. Fix: run on gloo or nccl (tensorplay-run or torchrun, "
        "init_process_group('gloo')) to use DTensor, tensor parallelism or FSDP2.")
    assert from_torch == (
        "DeviceMesh.from_torch(): an mpi world cannot adopt torch_mesh: its groups belong "
        "to torch.distributed. Fix: adopt torch meshes in a gloo or nccl world.")


if __name__ == "__main__":  # the child: python test_contract.py <engine module>
    print(json.dumps(_describe(sys.argv[1])))
