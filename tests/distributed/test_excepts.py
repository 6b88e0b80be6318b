"""No error is swallowed: every handler in the package that catches ``Exception`` or
``BaseException`` raises again, reports what it caught through one of the reporters below,
or hands the error on to where it is raised or said (``HANDED_ON``, each with where it goes);
and ``contextlib.suppress`` never takes them. Read from the code (``ast``), so a new broad
except that does neither fails here, naming its file, line and function.

Worked example: ``except Exception: return False`` in ``launcher/join.py`` fails with
"launcher/join.py:88 in _await_all(): catches Exception, and neither raises nor reports".
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tensorplay" / "distributed"
BROAD = {"Exception", "BaseException"}
# the calls that say what was caught, the same way every time
REPORTERS = {
    "report_thread_error",  # job/watch.py: a thread of a rank that must not die
    "report_bug",  # launcher/bugs.py: the launcher's own bugs
    "print_ignored",  # launcher/rank_main.py: CPython's "Exception ignored in" words
    "print_uncaught",  # launcher/rank_main.py: a script's uncaught error, as CPython prints it
    "__excepthook__",  # rank_main: an excepthook that failed, printed as CPython does
}
# (file, function): handlers that keep the error to raise or say it elsewhere
HANDED_ON = {
    ("job/watch.py", "run"): "unless_told's helper thread: raised again on the caller's thread",
    ("launcher/warm.py", "serve"): "the warm process's imports: the launcher prints `why`",
    ("launcher/rank_main.py", "text_of"): "a __str__ that raised: its type is in the text",
}


def _broad(handler: ast.ExceptHandler) -> str | None:
    """The broad class a handler catches ('Exception'), or None."""
    if handler.type is None:
        return "everything (bare except)"
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return next((t.id for t in types if isinstance(t, ast.Name) and t.id in BROAD), None)


def _called(node: ast.AST) -> set[str]:
    return {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def _enclosing(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the name of the innermost function that holds it ('<module>' outside)."""
    names: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
                else name
            names[id(child)] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return names


def swallowed(relative: str, source: str) -> list[str]:
    """'file:line in f(): ...' for each broad handler that neither raises nor reports, and
    each suppress() of a broad class."""
    found = []
    tree = ast.parse(source)
    where = _enclosing(tree)
    for node in ast.walk(tree):
        name = where.get(id(node), "<module>")
        if isinstance(node, ast.ExceptHandler) and (what := _broad(node)):
            handled = (any(isinstance(n, ast.Raise) for n in ast.walk(node))
                       or _called(node) & REPORTERS or (relative, name) in HANDED_ON)
            if not handled:
                found.append(f"{relative}:{node.lineno} in {name}(): catches {what}, and "
                             "neither raises nor reports")
        elif (isinstance(node, ast.Call) and _called(node) & {"suppress"}
              and any(isinstance(a, ast.Name) and a.id in BROAD for a in node.args)):
            found.append(f"{relative}:{node.lineno} in {name}(): suppress() of a broad class "
                         "swallows it")
    return sorted(found, key=lambda line: int(line.split(":")[1].split()[0]))


def test_no_broad_except_in_the_package_swallows_its_error():
    found = [line for path in sorted(PACKAGE.rglob("*.py"))
             for line in swallowed(str(path.relative_to(PACKAGE)), path.read_text())]
    assert found == []


def test_every_handed_on_entry_is_still_a_broad_handler_there():
    """A HANDED_ON entry whose handler went away must go too (else it would excuse the next
    broad except written in that function)."""
    for relative, function in HANDED_ON:
        tree = ast.parse((PACKAGE / relative).read_text())
        where = _enclosing(tree)
        assert any(isinstance(n, ast.ExceptHandler) and _broad(n)
                   and where.get(id(n)) == function for n in ast.walk(tree)), (relative, function)


def test_the_finder_finds_a_swallow_and_passes_a_report():
    source = '''
def _await_all():
    try:
        pass
    except Exception:
        return False

def beat():
    try:
        pass
    except Exception as err:
        report_bug("the heartbeat", err)

def close():
    with suppress(BaseException):
        pass
'''
    assert swallowed("launcher/join.py", source) == [
        "launcher/join.py:5 in _await_all(): catches Exception, and neither raises nor reports",
        "launcher/join.py:15 in close(): suppress() of a broad class swallows it"]
