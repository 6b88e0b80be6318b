"""What the docs name exists: every file path, every ``tensorplay.distributed.x.y`` and every
``module.name`` or ``Class.member`` in backticks of README.md, docs/*.md and bench/README.md
resolves in this checkout, every relative link points at a file, and README.md stays a page a
newcomer reads to the end (at most 250 lines).

What counts as a claim, in inline code (and, for dotted names, in fenced blocks too):

- a path rooted at a folder of the repository (``src/``, ``tests/``, ``docs/``, ``bench/``,
  ``examples/``) or of the package (``backends/protocol.py``, ``host/``): it must exist, from
  the repository root or from the package; a bare ``name.py`` span (the whole span) must be a
  file of the package, of the tests, of the doc's own folder or of the root. A file name in a
  command (``python train.py``) is the user's, and one with a placeholder (``<name>``) a
  pattern: neither is checked. Paths of other projects (``torch/...``) name no folder here;
- ``tensorplay.distributed.a.b``: ``a`` imported, ``b`` an attribute of it;
- ``head.name``, where head is a module of the package by its last name (``keys`` is
  ``control/keys.py`` or ``launcher/keys.py``: either will do), a class of the package
  (``World.close_epoch``) or a variable the docs use for one (``mesh`` a ``DeviceMesh``,
  ``world`` a ``World``, ``group`` a ``ProcessGroup``, ...): ``name`` must be a member. A head
  like ``_keys`` (a private module of the package's that is not there) is a stale name;
- a bare private name (``_make_groups``) must be defined somewhere in the package.

Names of other projects the docs cite are ``OTHER_PROJECTS``.

Worked example: "``_consensus.agree()``" is refused (no module ``_consensus``), and
"``control/consensus.py``", "``consensus.agree``" and
"``tensorplay.distributed.control.consensus.agree``" pass.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "tensorplay" / "distributed"
PACKAGE = "tensorplay.distributed"
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 250
REPO_FOLDERS = ("src", "tests", "docs", "bench", "examples", ".ci")
PACKAGE_FOLDERS = tuple(p.name for p in PACKAGE_DIR.iterdir()
                        if p.is_dir() and (p / "__init__.py").exists())
# the names the docs give to instances of the package's classes: `mesh.recover` is a claim
# about DeviceMesh (or its elastic subclass)
INSTANCES = {
    "mesh": ("mesh.value.DeviceMesh", "elastic.mesh.ElasticMesh"),
    "world": ("job.world.World",),
    "group": ("process_group.ProcessGroup",),
    "g": ("process_group.ProcessGroup",),
    "pg": ("process_group.ProcessGroup",),
    "spec": ("geometry.spec.MeshSpec",),
    "engine": ("backends.protocol.Engine", "backends.protocol.Severable",
               "backends.protocol.NativeMeshes", "backends.protocol.GathersText",
               "backends.fake.FakeEngine", "backends.torch_c10d.TorchEngine",
               "backends.mpi.MpiEngine"),
    "control": ("control.plane.Control", "control.plane.Board"),
    "dist": ("",),  # `import tensorplay.distributed as dist`
}
# other projects' names the docs cite beside ours: torch's DeviceMesh internals (that our mesh
# lacks, and says so), Python's start-up hook
OTHER_PROJECTS = {"_layout", "_get_root_mesh", "_rank_map", "_root_mesh", "_unflatten",
                  "sitecustomize.py"}
FILE_ENDINGS = ("py", "md", "png", "svg", "toml", "json", "txt", "cfg", "csv", "sh", "yaml")

_SPAN = re.compile(r"(?<!`)`([^`]+?)`(?!`)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(rf"[\w./<>*{{}}-]+\.(?:{'|'.join(FILE_ENDINGS)})|[\w.-]+(?:/[\w.-]+)*/")
_DOTTED = re.compile(r"(?<![\w.])(_?[A-Za-z]\w*(?:\.\w+)+)")


def _modules() -> dict[str, list[str]]:
    """Each module's last name -> its dotted names below the package: 'keys' ->
    ['control.keys', 'launcher.keys']; a package by its folder name ('mesh' -> ['mesh'])."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found.setdefault(parts[-1], []).append(".".join(parts))
    return found


MODULES = _modules()


def _load(short: str) -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.{short}" if short else PACKAGE)


# modules whose import starts a world (mpi4py initialises MPI as it loads): imported here, a
# later init_process_group() or "no world yet" test in this process would find that world
# and adopt it, so their names are not checked
STARTS_A_WORLD = {"backends.mpi", "backends.mpi_watch", "backends.mpi_collectives"}


def _loadable(short: str) -> ModuleType | None:
    """The module, or None where it needs an engine this environment lacks (torch, mpi4py)
    or would start one (``STARTS_A_WORLD``): its names are then not checked."""
    if short in STARTS_A_WORLD:
        return None
    try:
        return _load(short)
    except ImportError:
        return None


def _resolve(short: str) -> object | None:
    """'mesh.value.DeviceMesh' -> the class (modules imported on the way); None unloadable."""
    module, _, attr = short.rpartition(".")
    found = _loadable(module)
    return None if found is None else getattr(found, attr)


@functools.cache
def _classes() -> dict[str, list[type]]:
    """Every class defined in the package, by name."""
    found: dict[str, list[type]] = {}
    for names in MODULES.values():
        for short in names:
            if (module := _loadable(short)) is None:
                continue
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and obj.__module__ == module.__name__:
                    found.setdefault(name, []).append(obj)
    return found


def _has(obj: object, name: str) -> bool:
    """Whether name is a member of obj: an attribute (a module's lazy one, a submodule), or for
    a class also what only instances carry (a field without default, a ``self.<name> =``)."""
    try:
        getattr(obj, name)
        return True
    except AttributeError:
        pass
    if isinstance(obj, ModuleType):
        try:
            importlib.import_module(f"{obj.__name__}.{name}")
            return True
        except ModuleNotFoundError:
            return False
    return inspect.isclass(obj) and any(
        name in inspect.get_annotations(klass) or name in _assigned(klass) for klass in obj.__mro__)


def _assigned(klass: type) -> set[str]:
    """The ``self.<name> = ...`` targets in a class's own source."""
    try:
        tree = ast.parse(inspect.getsource(klass).lstrip())
    except (OSError, TypeError, SyntaxError):
        return set()
    return {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def _member(obj: object, name: str) -> object | None:
    """obj.name when it is a module or class to look further into, else None."""
    try:
        found = getattr(obj, name)
    except AttributeError:
        return None
    return found if isinstance(found, ModuleType) or inspect.isclass(found) else None


def _chain_holds(start: object, names: list[str]) -> bool:
    """Whether start.a.b... resolves, looking no further than a value that is no module or
    class (what a function returns is not checked)."""
    obj: object | None = start
    for name in names:
        if obj is None:
            return True
        if not _has(obj, name):
            return False
        obj = _member(obj, name)
    return True


def _paths(span: str) -> list[str]:
    """The path-like tokens of a span: 'python bench/launch.py --x' -> ['bench/launch.py'];
    a folder ends with '/' ('host/'); a line number is dropped ('world.py:154')."""
    tokens = (re.sub(r":\d[\d,-]*$", "", t.rstrip(".,;:")) for t in re.split(r"[\s,()\"'=]+", span))
    return [t for t in tokens if re.fullmatch(_PATH, t)]


def _path_problem(token: str, doc: Path, whole_span: bool) -> str | None:
    """Why a path-like token names no file here; None when it does or is not a claim.
    Below a package folder, a path names the module or its test (``backends/test_mpi.py``
    is ``tests/distributed/backends/test_mpi.py``: the tests mirror the folders)."""
    if any(c in token for c in "<>*{}") or token.startswith(".") or token in OTHER_PROJECTS:
        return None
    first = token.split("/", 1)[0]
    if "/" in token:
        if first in REPO_FOLDERS:
            found = (ROOT / token).exists()
        elif first in PACKAGE_FOLDERS:
            found = (PACKAGE_DIR / token).exists() or (ROOT / "tests/distributed" / token).exists()
        else:
            return None  # another project's path, or a path on the user's machine
    elif whole_span:
        found = (any(PACKAGE_DIR.rglob(token)) or any((ROOT / "tests").rglob(token))
                 or (doc.parent / token).exists() or (ROOT / token).exists())
    else:
        return None  # a file name in a command: the user's
    return None if found else f"no file {token}"


def _dotted_problem(name: str, classes: dict[str, list[type]]) -> str | None:
    """Why a dotted name names nothing of the package; None when it does or is not ours."""
    parts = name.split(".")
    if parts[:2] == ["tensorplay", "distributed"]:
        return None if _chain_holds(_load(""), parts[2:]) else f"{name} does not resolve"
    head, rest = parts[0], parts[1:]
    if rest[-1] in OTHER_PROJECTS:
        return None
    if re.fullmatch(r"_[a-z]\w*", head) and head not in MODULES:
        return f"{name}: the package has no module {head}"
    starts = ([_loadable(short) for short in MODULES.get(head, [])] + classes.get(head, [])
              + [_resolve(short) if short else _load("") for short in INSTANCES.get(head, ())])
    starts = [start for start in starts if start is not None]
    if not starts or any(_chain_holds(start, rest) for start in starts):
        return None
    return f"{name}: no such member"


def _private_problem(span: str, defined: frozenset[str]) -> str | None:
    """A bare private name (`_make_groups`) must be defined somewhere in the package, or be
    someone else's; `_STRICT` stands for a constant ending so (TENSORPLAY_STRICT); `_keys`,
    a module's old private name, is stale even where a module imports keys as _keys."""
    if not re.fullmatch(r"_\w+", span) or span.startswith("__") or span in OTHER_PROJECTS:
        return None
    if span[1:] in MODULES and span not in MODULES:
        return f"{span}: the package's module is {span[1:]}, not {span}"
    if span in defined:
        return None
    if span.isupper() and any(name.endswith(span) for name in defined):
        return None
    return f"{span} is defined nowhere in the package"


@functools.cache
def _defined_names() -> frozenset[str]:
    """Every name bound in the package (module or class level, a function's, an attribute
    set), and every string constant that reads as a variable name ('TENSORPLAY_HANG_TIMEOUT_S')."""
    names: set[str] = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"[A-Z][A-Z0-9_]+", node.value):
                names.add(node.value)
    return frozenset(names)


def problems(doc: Path, text: str) -> Iterator[tuple[int, str]]:
    """Every claim of one doc that does not hold: (line, why)."""
    classes, defined = _classes(), _defined_names()

    prose = _FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)  # the same line numbers

    def line_of(offset: int) -> int:
        return prose.count("\n", 0, offset) + 1

    for m in _SPAN.finditer(prose):
        span = " ".join(m[1].split())  # a span may wrap over lines
        for why in _span_problems(span, doc, classes, defined, fenced=False):
            yield line_of(m.start()), f"{why} (in `{span}`)"
    for m in _LINK.finditer(prose):
        path = m[1].split("#", 1)[0]
        if path and "://" not in path and not (doc.parent / path).exists():
            yield line_of(m.start()), f"the link {m[1]} points at no file"
    for block in _FENCE.finditer(text):
        for m in re.finditer(r"tensorplay\.distributed[\w.]*|from [\w.]+ import [\w, ]+",
                             block[0]):
            for why in _span_problems(m[0], doc, classes, defined, fenced=True):
                yield text.count("\n", 0, block.start() + m.start()) + 1, f"{why} (in `{m[0]}`)"


def _span_problems(span: str, doc: Path, classes: dict[str, list[type]],
                   defined: frozenset[str],
                   fenced: bool) -> Iterator[str]:
    if fenced:
        if span.startswith("from "):
            module, _, names = span[5:].partition(" import ")
            span_names = [f"{module}.{n.strip()}" for n in names.split(",") if n.strip()]
        else:
            span_names = [span.rstrip(".")]
        for name in span_names:
            if name.startswith(PACKAGE) and (why := _dotted_problem(name, classes)):
                yield why
        return
    if (why := _private_problem(span.strip(), defined)) is not None:
        yield why
    paths = _paths(span)
    for token in paths:
        if (why := _path_problem(token, doc, whole_span=token == span.strip())) is not None:
            yield why
    code = re.sub(r"\([^()]*\)", "()", span)  # arguments are not claims
    for token in paths:
        code = code.replace(token, " ")
    for name in _DOTTED.findall(code):
        if (why := _dotted_problem(name.rstrip("."), classes)) is not None:
            yield why


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_what_the_docs_name_exists(doc):
    where = str(doc.relative_to(ROOT))
    found = sorted(problems(doc, doc.read_text()))
    false = [f"{where}:{line}: {why}" for line, why in found]
    assert not false, "\n".join(false)


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize(("text", "expected"), [
    ("Keys come from `_keys` only.", ["the package's module is keys, not _keys"]),
    ("`_no_such_helper` does it", ["_no_such_helper is defined nowhere"]),
    ("`_consensus.agree()` tallies", ["the package has no module _consensus"]),
    ("see `tests/distributed/test_elastic.py`", ["no file tests/distributed/test_elastic.py"]),
    ("`World.close_epoch` and `World.no_such_hook`", ["World.no_such_hook: no such member"]),
    ("`tensorplay.distributed.host.nothing`", ["tensorplay.distributed.host.nothing does not"]),
    ("[map](architecture_old.md)", ["the link architecture_old.md points at no file"]),
    ("```python\nfrom tensorplay.distributed.tensor import Shard, Nope\n```\n",
     ["tensorplay.distributed.tensor.Nope does not resolve"]),
    ("`control/consensus.py`, `consensus.agree`, `mesh.recover(err)`, `python train.py`,"
     " `torch/distributed/device_mesh.py`, `backends/<name>.py`, `world.py`", []),
])
def test_the_checker_finds_a_false_claim(text, expected):
    found = [why for _, why in problems(ROOT / "docs" / "example.md", text)]
    assert len(found) == len(expected), found
    for why, needle in zip(found, expected, strict=True):
        assert needle in why, why
