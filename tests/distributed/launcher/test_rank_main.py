"""_rank_main runs a rank's script exactly as ``python`` would, reports how it ended, and dies
with its launcher. Each case runs one plain ``python`` child and one under the bootstrap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorplay.distributed.launcher import rank_main as _rank_main
from tests import timing

PROBE = '''\
"""a probe"""
import json, os, pickle, sys
class Thing:
    pass
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
    "spec": None if __spec__ is None else __spec__.name, "package": __package__,
    "doc": __doc__, "loader": type(__loader__).__name__, "loader_name": __loader__.name,
    "builtins": type(__builtins__).__name__, "cached": globals().get("__cached__"),
    "globals": sorted(globals()), "main": sys.modules["__main__"].__dict__ is globals(),
    "pickled": type(pickle.loads(pickle.dumps(Thing()))).__name__,
    "private_env": sorted(k for k in os.environ if k.startswith("TENSORPLAY_RUN_")),
}))
'''

ENDINGS = {
    "returns": "print('done')\n",
    "raises": """\
        def inner():
            raise ValueError("bad lr\\nsecond line")
        try:
            {}["lr"]
        except KeyError:
            inner()
    """,
    "exits 3": "import sys; sys.exit(3)\n",
    "exits with a message": "import sys; sys.exit('rank 1 broke')\n",
    "keyboard interrupt": "raise KeyboardInterrupt\n",
    "syntax error": "x = (\n",
    "custom excepthook": """\
        import sys
        def hook(t, v, tb):
            sys.stderr.write(f"[rank7]: {t.__name__}: {v}\\n")
        sys.excepthook = hook
        raise OSError("disk full")
    """,
    "unprintable exception": """\
        class Broken(Exception):
            def __str__(self):
                raise RuntimeError("no words")
        raise Broken()
    """,
    "exits with an unprintable message": """\
        class Code:
            def __str__(self):
                raise RuntimeError("no words")
        raise SystemExit(Code())
    """,
    "excepthook raises": """\
        import sys
        def hook(t, v, tb):
            raise RuntimeError("the hook broke")
        sys.excepthook = hook
        raise KeyError(1)
    """,
    "excepthook exits": """\
        import sys
        sys.excepthook = lambda *args: sys.exit(7)
        raise KeyError(1)
    """,
    "stdout to a file of its own": """\
        import atexit, os, sys
        sys.stdout = open(f"log{os.getpid()}.txt", "w")
        atexit.register(lambda: print("said at exit, into the log"))
        print("into the log")
        raise ValueError("bad lr")
    """,
    "peer lost, stdout's flush fails": """\
        import io, sys
        class Tee(io.TextIOBase):
            def write(self, text):
                return len(text)
            def flush(self):
                raise BrokenPipeError(32, "Broken pipe")
            def __repr__(self):
                return "<Tee>"
        class RankFailedError(Exception):  # as if ours: the rank leaves skipping teardown
            pass
        RankFailedError.__module__ = "tensorplay.distributed.errors"
        sys.stdout = Tee()
        raise RankFailedError("rank 1 is gone")
    """,
}


def run(argv: list[str], cwd: Path, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          timeout=timing.guard(30),
                          env={**os.environ, **(env or {})}, **kw)


def boot(kind: str, target: str, *args: str) -> list[str]:
    return [sys.executable, "-c", _rank_main.loader_command(), kind, target, *args]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp_path/sub/probe.py, a package tmp_path/pkg with probe and ending modules."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    for i, body in enumerate(ENDINGS.values()):
        (tmp_path / "sub" / f"end{i}.py").write_text(textwrap.dedent(body))
        (tmp_path / "pkg" / f"end{i}.py").write_text(textwrap.dedent(body))
    return tmp_path


def same(plain: subprocess.CompletedProcess, booted: subprocess.CompletedProcess) -> None:
    assert (booted.stdout, booted.stderr, booted.returncode) == (
        plain.stdout, plain.stderr, plain.returncode)


def test_a_file_sees_what_python_gives_it(tree):
    argv = ["sub/../sub/probe.py", "--lr", "0.1", "-m", "x y"]
    plain = run([sys.executable, *argv], tree)
    booted = run(boot("--file", *argv), tree, {_rank_main.PARENT_PID: str(os.getpid())})
    same(plain, booted)
    seen = json.loads(booted.stdout)
    assert seen["argv"] == argv and seen["path0"] == str(tree / "sub")
    assert seen["main"] and seen["pickled"] == "Thing" and seen["private_env"] == []


def test_a_module_sees_what_python_m_gives_it(tree):
    plain = run([sys.executable, "-m", "pkg.probe", "a", "--b"], tree)
    booted = run(boot("--module", "pkg.probe", "a", "--b"), tree)
    same(plain, booted)
    assert json.loads(booted.stdout)["argv"] == [str(tree / "pkg" / "probe.py"), "a", "--b"]


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_output_and_exit_code_are_pythons(tree, ending):
    i = list(ENDINGS).index(ending)
    script, module = f"sub/end{i}.py", f"pkg.end{i}"
    same(run([sys.executable, script], tree), run(boot("--file", script), tree))
    same(run([sys.executable, "-m", module], tree), run(boot("--module", module), tree))


def test_what_a_rank_goes_on_past_as_it_exits_is_said_as_python_says_it(tree):
    """A failing hook, a failing flush at exit: the same words and status as python's (a
    hook's sys.exit(7) is 7; a failed flush 120, even on the path that skips teardown), and a
    file the script put in sys.stdout keeps what it prints after the traceback."""
    got = {}
    for ending in ("excepthook raises", "excepthook exits", "stdout to a file of its own",
                   "peer lost, stdout's flush fails"):
        done = run(boot("--file", ending_file(ending)), tree)
        got[ending] = done.returncode, done.stderr
    assert got["excepthook exits"] == (7, "")
    code, err = got["excepthook raises"]
    assert code == 1 and err.startswith("Error in sys.excepthook:\nTraceback (most recent")
    assert "During handling" not in err and "rank_main.py" not in err
    assert "RuntimeError: the hook broke\n\nOriginal exception was:\n" in err
    assert got["stdout to a file of its own"][0] == 1
    (log,) = tree.glob("log*.txt")
    assert log.read_text() == "into the log\nsaid at exit, into the log\n"
    code, err = got["peer lost, stdout's flush fails"]
    flush = tree / ending_file("peer lost, stdout's flush fails")
    assert code == 120 and err.endswith(
        "tensorplay.distributed.errors.RankFailedError: rank 1 is gone\n"
        "Exception ignored in: <Tee>\nTraceback (most recent call last):\n"
        f'  File "{flush}", line 6, in flush\n'
        '    raise BrokenPipeError(32, "Broken pipe")\n'
        "BrokenPipeError: [Errno 32] Broken pipe\n"), err


def ending_file(ending: str) -> str:
    """The script of ``ending`` in ``tree``, from its working directory."""
    return f"sub/end{list(ENDINGS).index(ending)}.py"


def test_missing_module_and_file_are_reported_as_python_does(tree):
    same(run([sys.executable, "-m", "pkg.nope"], tree), run(boot("--module", "pkg.nope"), tree))
    same(run([sys.executable, "nope.py"], tree), run(boot("--file", "nope.py"), tree))


def reports(tree: Path, script: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Run a script under the bootstrap with a report pipe; the reports it wrote."""
    read_end, write_end = os.pipe()
    try:
        done = run(boot("--file", script), tree, {_rank_main.REPORT_FD: str(write_end)},
                   pass_fds=(write_end,))
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as pipe:
            read_end = -1
            return [json.loads(line) for line in pipe.read().splitlines()], done
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize(("ending", "expected"), [
    ("returns", {"event": "returned"}),
    ("exits 3", {"event": "exit", "code": 3, "what": None}),
    ("exits with a message", {"event": "exit", "code": 1, "what": "rank 1 broke"}),
    ("raises", {"event": "raised", "code": 1, "what": "ValueError: bad lr; second line",
                "first": "Traceback (most recent call last):"}),
    ("syntax error", {"event": "raised", "code": 1,
                      "what": "SyntaxError: '(' was never closed (end5.py, line 1)",
                      "first": '  File "{tree}/sub/end5.py", line 1'}),
    ("unprintable exception", {"event": "raised", "code": 1,
                               "what": "Broken: <str() failed: RuntimeError>",
                               "first": "Traceback (most recent call last):"}),
    ("exits with an unprintable message", {"event": "exit", "code": 1,
                                           "what": "<str() failed: RuntimeError>"}),
])
def test_the_report_says_how_the_script_ended(tree, ending, expected):
    got, done = reports(tree, f"sub/end{list(ENDINGS).index(ending)}.py")
    assert len(got) == 1, (got, done.stderr)
    assert isinstance(got[0].pop("t"), float)
    expected = {k: v.format(tree=tree) if isinstance(v, str) else v for k, v in expected.items()}
    if "first" in expected:
        assert done.stderr.startswith(expected["first"])
    assert got[0] == expected


def test_a_launcher_that_is_already_gone_stops_the_rank_before_its_script(tree):
    marker = tree / "ran"
    (tree / "job.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    gone = os.getpid() + 10**7  # not the child's parent: as if the launcher had died already
    done = run(boot("--file", "job.py"), tree, {_rank_main.PARENT_PID: str(gone)})
    assert done.returncode == -signal.SIGKILL
    assert not marker.exists()


SELF = """\
import json, os, pathlib, sys
stat = pathlib.Path("/proc/self/stat").read_bytes().rsplit(b")", 1)[1].split()
print(json.dumps({"cmdline": pathlib.Path("/proc/self/cmdline").read_bytes().decode(),
                  "comm": pathlib.Path("/proc/self/comm").read_text().strip(),
                  "area": int(stat[46]) - int(stat[45]), "argv": sys.argv,
                  "private_env": sorted(k for k in os.environ if k.startswith("TENSORPLAY_RUN_"))}))
"""
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def titled(tree: Path, title: str, comm: str = "rank 5", pre: str = "") -> tuple[
        dict, subprocess.CompletedProcess]:
    """Run SELF under the bootstrap (after ``pre``, Python run first in the same process)
    with the launcher's title and name for it; what it saw of itself."""
    (tree / "self.py").write_text(SELF)
    argv = boot("--file", "self.py", "--lr", "0.1")
    if pre:
        argv[2] = pre + "\nexec(" + repr(argv[2]) + ")"
    done = run(argv, tree, {_rank_main.TITLE: title, _rank_main.COMM: comm})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done


@linux_only
def test_a_rank_takes_the_title_and_name_the_launcher_gave_it(tree):
    title = "tensorplay-run rank 5/8: python self.py --lr 0.1"
    seen, done = titled(tree, title)
    assert seen["cmdline"] == title + "\0"  # one argument: ps -o args shows the title alone
    assert seen["comm"] == "rank 5" and done.stderr == ""
    assert seen["argv"] == ["self.py", "--lr", "0.1"] and seen["private_env"] == []


@linux_only
def test_a_title_longer_than_its_room_is_cut_whole_characters_and_dots(tree):
    title = "tensorplay-run rank 5/8: python " + "é" * 3000  # 6032 bytes
    seen, _ = titled(tree, title, comm="rank 5 and more than fifteen")
    raw = seen["cmdline"].encode()
    room = min(seen["area"], _rank_main.TITLE_PAGE) - 1  # the loader's ~330 bytes here
    assert room - 1 <= len(raw) - 1 <= room and raw.endswith(b"...\0")  # one é is 2 bytes
    assert title.startswith(seen["cmdline"][:-4]) and seen["comm"] == "rank 5 and more"


@linux_only
def test_a_title_that_cannot_be_set_is_said_and_the_script_runs(tree):
    deny = ("import builtins\nreal = builtins.open\n"
            "def refuse(path, *args, **kwargs):\n"
            "    if path == '/proc/self/mem':\n"
            "        raise PermissionError(13, 'Permission denied', path)\n"
            "    return real(path, *args, **kwargs)\n"
            "builtins.open = refuse")
    seen, done = titled(tree, "tensorplay-run rank 5/8: python self.py --lr 0.1", pre=deny)
    assert done.stderr == (
        "tensorplay-run: this rank's process title was not set (PermissionError: [Errno 13] "
        "Permission denied: '/proc/self/mem'); ps shows the command line it was started with.\n")
    assert seen["cmdline"].split("\0")[:2] == [sys.executable, "-c"]  # as it started
    assert seen["comm"] == "rank 5"  # set before the title
