"""Warm start (launcher/warm.py): ranks forked from one process that imported torch once run the
script as ``python`` would, report as plain ranks do, and the start falls back (one line) when a
fork is unsafe. Scripts use the standard library only; every run is bounded by ``run``'s timeout
and the pids a script writes are checked gone."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap

import pytest

from tensorplay.distributed.host import procfs
from tensorplay.distributed.launcher.spec import parse_args
from tests import timing

from .test_main import assert_all_gone, read_pids, run, script
from .test_rank_table import await_table, start, title

pytestmark = pytest.mark.warm_ranks  # warm start is what these tests are about

# what a rank prints about itself: forked warm, the package is already in sys.modules
REPORT = """
    import random
    warm = "tensorplay.distributed" in sys.modules
    print(json.dumps({"rank": RANK, "name": __name__, "argv": sys.argv, "path0": sys.path[0],
                      "warm": warm, "random": random.random(), "pid": os.getpid(),
                      "np": (sys.modules["numpy"].random.random() if "numpy" in sys.modules
                             else None),
                      "own_group": os.getpgid(0) == os.getpid(),
                      "int": repr(signal.getsignal(signal.SIGINT)),
                      "term": repr(signal.getsignal(signal.SIGTERM)),
                      "chld": repr(signal.getsignal(signal.SIGCHLD)),
                      "pipe": repr(signal.getsignal(signal.SIGPIPE)),
                      "report_fd_env": "TENSORPLAY_RUN_REPORT_FD" in os.environ}))
"""
HANDLERS = ("import json, signal; print(json.dumps({k: repr(signal.getsignal(s)) for k, s in ("
            "('int', signal.SIGINT), ('term', signal.SIGTERM), ('chld', signal.SIGCHLD), "
            "('pipe', signal.SIGPIPE))}))")


def fresh_handlers() -> dict[str, str]:
    """The handlers a fresh interpreter has here: SIGINT's is default_int_handler, unless this
    process tree was started with SIGINT ignored (a shell's background job), which Python keeps."""
    done = subprocess.run([sys.executable, "-c", HANDLERS], capture_output=True, text=True,
                          check=True, timeout=timing.guard(30))
    return json.loads(done.stdout)


def reports(stdout: str) -> list[dict]:
    """The REPORT lines, one per rank, by rank (the launcher's label taken off)."""
    out = [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines()
           if line.startswith("[rank ") and "{" in line]
    return sorted(out, key=lambda r: r["rank"])


@pytest.fixture(autouse=True)
def _warm_unless_a_test_says_otherwise(monkeypatch):
    """These tests are about warm start: a TENSORPLAY_NO_WARM=1 run of the whole suite (the
    other tests, cold) leaves them warm."""
    monkeypatch.delenv("TENSORPLAY_NO_WARM", raising=False)


def plain_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_a_warm_rank_runs_the_script_as_python_does(tmp_path):
    job = script(tmp_path, REPORT)
    res = run("--nproc-per-node", "3", job, "--lr", "0.1")
    assert res.returncode == 0, res.stderr
    got = reports(res.stdout)
    assert [r["rank"] for r in got] == [0, 1, 2]
    fresh = fresh_handlers()
    for r in got:
        assert r["warm"], "the rank was not forked from the warm process"
        assert r["name"] == "__main__"
        assert r["argv"] == [str(job), "--lr", "0.1"]
        assert r["path0"] == str(tmp_path.resolve())
        assert r["own_group"]
        assert not r["report_fd_env"]  # rank_main took it, as in a plain rank
        assert {k: r[k] for k in fresh} == fresh  # a fresh interpreter's handlers
    assert len({r["random"] for r in got}) == 3, "forked ranks share random's state"
    if got[0]["np"] is not None:  # numpy installed: the warm process imported it
        assert len({r["np"] for r in got}) == 3, "forked ranks share numpy's state"
    assert "warm start off" not in res.stderr
    assert_all_gone([r["pid"] for r in got])


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_a_warm_rank_runs_a_module_as_python_m_does(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(textwrap.dedent("""\
        import json, os, sys
        print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                          "warm": "tensorplay.distributed" in sys.modules}))
    """))
    env = plain_env(PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    res = subprocess_run_in(tmp_path, "--nproc-per-node", "2", "-m", "mypkg.job", "x", env=env)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()]
    assert len(lines) == 2
    for got in lines:
        assert got == {"name": "__main__", "argv": [str(pkg / "job.py"), "x"],
                       "path0": str(tmp_path), "warm": True}


def subprocess_run_in(cwd, *args, env=None, timeout=60):
    """``run`` from another working directory."""
    return run(*args, timeout=timeout, env=env, cwd=cwd)


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_warm_output_is_labelled_per_stream(tmp_path):
    job = script(tmp_path, """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
    """)
    res = run("--nproc-per-node", "2", job)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank 0] out 0", "[rank 1] out 1"]
    assert {"[rank 0] err 0", "[rank 1] err 1"} <= set(res.stderr.splitlines())


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_a_raising_warm_rank_is_reported_as_today(tmp_path):
    job = script(tmp_path, """
        write_pid()
        if RANK == 1:
            while not (HERE / "pid_0").exists():  # both pids known before the job ends
                time.sleep(0.01)
            raise ValueError("bad lr")
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", "--settle-s", "0.2", job)
    assert res.returncode == 1, res.stderr
    assert "[rank 1] ValueError: bad lr" in res.stderr
    # on a busy machine rank 1 may still be exiting when the 0.2 s settle ends: stopped too
    assert re.fullmatch(r"tensorplay-run: rank 1 failed first \((exit code 1|stopped while "
                        r"exiting)\): ValueError: bad lr; stopped rank 0\.",
                        res.stderr.splitlines()[-1]), res.stderr
    assert_all_gone(read_pids(tmp_path, 2))


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_a_killed_warm_rank_is_reported_as_today(tmp_path):
    job = script(tmp_path, """
        write_pid()
        if RANK == 0:
            while not (HERE / "pid_1").exists():  # both pids known before the job ends
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", "--settle-s", "0.2", job)
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "rank 0 failed first (killed by signal SIGKILL)" in res.stderr
    assert_all_gone(read_pids(tmp_path, 2))


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_sys_exit_and_atexit_as_in_a_fresh_interpreter(tmp_path):
    job = script(tmp_path, """
        import atexit, threading
        atexit.register(lambda: print(f"atexit {RANK}", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print(f"thread {RANK}"))).start()
        sys.exit(3 if RANK == 1 else 0)
    """)
    res = run("--nproc-per-node", "2", job)
    assert res.returncode == 3, res.stderr
    out = res.stdout.splitlines()
    assert "[rank 1] thread 1" in out and "[rank 1] atexit 1" in out
    assert out.index("[rank 1] thread 1") < out.index("[rank 1] atexit 1")  # threads joined first


def test_no_warm_flag_and_environment_give_a_plain_start(tmp_path):
    job = script(tmp_path, REPORT)
    for args, env in ((["--no-warm"], None), ([], plain_env(TENSORPLAY_NO_WARM="1"))):
        res = run(*args, "--nproc-per-node", "2", job, env=env)
        assert res.returncode == 0, res.stderr
        got = reports(res.stdout)
        assert [r["warm"] for r in got] == [False, False], args
        assert [r["argv"] for r in got] == [[str(job)], [str(job)]]
        assert "warm start off" not in res.stderr
    assert not parse_args(["--no-warm", str(job)]).warm
    assert parse_args(["--preload", "a", "--preload", "b", str(job)]).preload == ("a", "b")


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_preload_is_imported_before_the_fork(tmp_path):
    (tmp_path / "heavy.py").write_text("import os\nLOADED_IN = os.getpid()\n")
    job = script(tmp_path, """
        heavy = sys.modules.get("heavy")
        print(json.dumps({"preloaded": heavy is not None and heavy.LOADED_IN != os.getpid()}))
    """)
    res = subprocess_run_in(tmp_path, "--nproc-per-node", "2", "--preload", "heavy", job)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ['[rank 0] {"preloaded": true}',
                                               '[rank 1] {"preloaded": true}']


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
def test_a_second_thread_in_the_warm_process_falls_back_with_one_line(tmp_path):
    (tmp_path / "spinner.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True, name='spinner').start()\n")
    job = script(tmp_path, REPORT)
    res = subprocess_run_in(tmp_path, "--nproc-per-node", "2", "--preload", "spinner", job)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "warm start off" in line]
    assert len(said) == 1, res.stderr
    assert said[0].startswith("tensorplay-run: warm start off: the warm process has 2 threads")
    assert "spinner" in said[0] and said[0].endswith("starting ranks as fresh interpreters.")
    assert [r["warm"] for r in reports(res.stdout)] == [False, False]


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
@pytest.mark.parametrize(("body", "failed"), [
    (None, "--preload no_such_mod failed (ModuleNotFoundError: No module named 'no_such_mod')"),
    ("raise SystemExit(3)", "--preload no_such_mod failed (SystemExit: 3)"),
    ("raise KeyboardInterrupt", "--preload no_such_mod failed (KeyboardInterrupt)"),
])
def test_a_failing_preload_falls_back_with_one_line(tmp_path, body, failed):
    """Whatever the module's import raises, SystemExit and KeyboardInterrupt too, the launcher
    says it in one line and starts the ranks plainly."""
    if body is not None:
        (tmp_path / "no_such_mod.py").write_text(body + "\n")
    job = script(tmp_path, REPORT)
    res = subprocess_run_in(tmp_path, "--nproc-per-node", "2", "--preload", "no_such_mod", job)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "warm start off" in line]
    assert said == [f"tensorplay-run: warm start off: {failed}; starting ranks as fresh "
                    f"interpreters."], res.stderr
    assert [r["warm"] for r in reports(res.stdout)] == [False, False]


def test_one_rank_never_restarted_starts_plainly(tmp_path):
    job = script(tmp_path, REPORT)
    res = run(job)
    assert res.returncode == 0, res.stderr
    assert [r["warm"] for r in reports(res.stdout)] == [False]
    assert parse_args(["--max-restarts", "1", str(job)]).wants_warm()


@pytest.mark.slow  # its warm process imports torch (about 1.5 s)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process titles read /proc")
def test_each_warm_rank_shows_its_own_title_and_the_table_goes_at_the_end(tmp_path):
    job = script(tmp_path, """
        write_pid()
        while not (HERE / "go").exists():
            time.sleep(0.05)
    """)
    launcher, path = start(tmp_path, "--nproc-per-node", "4", str(job), "--lr", "0.1")
    try:
        pids = read_pids(tmp_path, 4, launcher=launcher)
        table = await_table(path, launcher, 4)
        assert sorted(table.values()) == sorted(pids)
        servers = {procfs.stat_fields(pid)[1] for pid in pids}  # each rank's parent
        assert len(servers) == 1, servers
        server = int(servers.pop())
        line = shlex.join([os.path.basename(sys.executable), str(job), "--lr", "0.1"])
        assert procfs.cmdline(server) == [f"tensorplay-run warm: {line}"]  # padding gone
        assert procfs.comm(server) == "tensorplay-warm"
        for rank, pid in table.items():
            assert procfs.cmdline(pid) == [title(rank, 4, job, "--lr", "0.1")]
            assert procfs.comm(pid) == f"rank {rank}"
            env = procfs.environ(pid)  # the warm process's, as docs/launcher.md says
            assert "RANK" not in env and env["WORLD_SIZE"] == "4"
        (tmp_path / "go").touch()
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0, err
    assert "title was not set" not in err
    assert not path.exists()
    assert_all_gone(pids)


# --- a forked rank's start and exit, without the server: _child and _run in a plain python ---

# rank_main.main under warm._run, then os._exit: what a forked rank runs after its start, in
# a process of its own (binding no name in __main__, as the rank's loader does)
FORKED = ("__import__('os')._exit(__import__('tensorplay.distributed.launcher.warm', "
          "fromlist=['_run'])._run(__import__('tensorplay.distributed.launcher.rank_main', "
          "fromlist=['main']).main))")
TEE = textwrap.dedent("""
    import io, sys
    class Tee(io.TextIOBase):
        def write(self, text):
            return len(text)
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
        def __repr__(self):
            return "<Tee>"
""")
EXITS = {
    "closes its stdout": "import sys\nprint('x')\nsys.stdout.close()\n",
    "exits 3, its stdout's flush fails": TEE + "sys.stdout = Tee()\nsys.exit(3)\n",
    "raises, its stderr's flush fails": TEE + "sys.stderr = Tee()\nraise ValueError('bad')\n",
    "is interrupted joining its threads": """
        import os, signal, sys, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores it
        main = threading.main_thread().ident
        def interrupt():
            while sys._current_frames()[main].f_code.co_name != "_shutdown":
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        threading.Thread(target=interrupt).start()
    """,
    "has an excepthook that exits": """
        import sys
        sys.excepthook = lambda *args: sys.exit(7)
        raise KeyError(1)
    """,
    "has an excepthook that raises": """
        import sys
        def hook(t, v, tb):
            raise RuntimeError("the hook broke")
        sys.excepthook = hook
        raise KeyError(1)
    """,
    "raises KeyboardInterrupt": "raise KeyboardInterrupt\n",
    "exits with an unprintable message": """
        class Code:
            def __str__(self):
                raise RuntimeError("no words")
            def __repr__(self):
                return "<Code>"
        raise SystemExit(Code())
    """,
}


def ended(tmp_path, ending: str, *argv: str) -> subprocess.CompletedProcess:
    """Run the EXITS script ``ending`` as ``argv`` (python, or FORKED) runs it."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(EXITS[ending]))
    return subprocess.run([*argv, str(job)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timing.guard(30))


@pytest.mark.parametrize(("ending", "status"), [
    ("closes its stdout", 0), ("exits 3, its stdout's flush fails", 120),
    ("is interrupted joining its threads", 0), ("has an excepthook that exits", 7),
    ("has an excepthook that raises", 1), ("raises KeyboardInterrupt", -signal.SIGINT)])
def test_a_forked_rank_leaves_as_python_does(tmp_path, ending, status):
    """Its status (120 for a failed flush, whatever the script's; a hook's sys.exit; SIGINT)
    and what is said on the way out are python's, a closed stream left alone."""
    plain = ended(tmp_path, ending, sys.executable)
    assert plain.returncode == status, plain.stderr
    forked = ended(tmp_path, ending, sys.executable, "-c", FORKED, "--file")
    assert (forked.stdout, forked.stderr, forked.returncode) == (
        plain.stdout, plain.stderr, plain.returncode)


def test_what_python_leaves_unsaid_at_exit_a_forked_rank_says(tmp_path):
    """Where python says nothing (sys.stderr's own flush failed; a sys.exit argument it could
    not print), a forked rank says what failed in python's words for an error it goes on past,
    on fd 2, with python's status."""
    plain = ended(tmp_path, "raises, its stderr's flush fails", sys.executable)
    assert (plain.returncode, plain.stderr) == (120, "")
    forked = ended(tmp_path, "raises, its stderr's flush fails", sys.executable, "-c", FORKED,
                   "--file")
    assert forked.returncode == 120
    assert forked.stderr == (
        "Exception ignored in: <Tee>\nTraceback (most recent call last):\n"
        f'  File "{tmp_path / "job.py"}", line 7, in flush\n'
        '    raise BrokenPipeError(32, "Broken pipe")\n'
        "BrokenPipeError: [Errno 32] Broken pipe\n")
    forked = ended(tmp_path, "exits with an unprintable message", sys.executable, "-c", FORKED,
                   "--file")
    assert forked.returncode == 1
    assert forked.stderr == (
        "Exception ignored in: <Code>\nTraceback (most recent call last):\n"
        f'  File "{tmp_path / "job.py"}", line 4, in __str__\n'
        '    raise RuntimeError("no words")\n'
        "RuntimeError: no words\n")


def test_a_forked_rank_that_cannot_start_says_why(tmp_path):
    """_child's own start failing (the job's working directory gone) is said in one line on
    the rank's stderr, and the rank exits 1: never a silent exit."""
    child = textwrap.dedent(f"""
        import os, socket
        from tensorplay.distributed.launcher import warm
        sock, _ = socket.socketpair()
        fds = [os.open(os.devnull, os.O_RDONLY), os.dup(1), os.dup(2), os.dup(2)]
        request = {{"cwd": {str(tmp_path / "gone")!r}, "env": {{}}, "argv": ["--file", "x.py"]}}
        warm._child(request, fds, sock, os.pipe(), {{}})
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=timing.guard(30))
    assert done.returncode == 1
    assert done.stderr == (
        "tensorplay-run: the warm process could not start this rank (FileNotFoundError: "
        f"[Errno 2] No such file or directory: {str(tmp_path / 'gone')!r}).\n")
