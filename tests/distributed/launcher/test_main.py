"""Tests of the tensorplay-run launcher: environment, output routing, fail-fast, signals, usage."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tensorplay.distributed.host.procfs import alive
from tensorplay.distributed.launcher.main import main
from tensorplay.distributed.launcher.spec import parse_args
from tests import timing

LAUNCHER = [sys.executable, "-m", "tensorplay.distributed.run"]
PRELUDE = """\
import json, os, pathlib, signal, subprocess, sys, time
RANK = int(os.environ["RANK"])
HERE = pathlib.Path(__file__).resolve().parent
def write_pid(pid=None, tag="pid"):
    (HERE / f"{tag}_{RANK}_{os.getpid()}.tmp").write_text(str(pid or os.getpid()))
    os.replace(HERE / f"{tag}_{RANK}_{os.getpid()}.tmp", HERE / f"{tag}_{RANK}")
"""


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    """Write a child script (PRELUDE + body) into tmp_path and return its path."""
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def run(*args: str | Path, timeout: float = 30, env: dict | None = None,
        cwd: str | Path | None = None):
    """Run the launcher to completion and return the CompletedProcess (text output). A
    launcher still running after ``timeout`` (scaled to the machine's speed) while it and its
    ranks use no CPU (``timing.communicate``: a hang, not a slow import) fails the test with
    its output and the Python stacks of its threads (faulthandler, on SIGABRT)."""
    argv = [*LAUNCHER, *map(str, args)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace",
                            env={**(os.environ if env is None else env),
                                 "PYTHONFAULTHANDLER": "1"}, cwd=cwd)
    start = time.monotonic()
    try:
        out, err = timing.communicate(proc, timeout)
    except subprocess.TimeoutExpired:
        waited = time.monotonic() - start
        proc.send_signal(signal.SIGABRT)  # its stacks go to stderr; its ranks follow it
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the launcher was still running after {waited:.0f} s "
                    f"({timing.describe()}); its output and stacks:\n{out[-4000:]}\n--- "
                    f"stderr ---\n{err[-12000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def socket_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_all_gone(pids: list[int], within_s: float = 3.0) -> None:
    """Every pid must have exited (within a short settling time, longer on a busy machine)."""
    deadline = time.monotonic() + timing.bound(0, within_s)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


def read_pids(tmp_path: Path, count: int, tag: str = "pid", within_s: float = 15.0,
              launcher: subprocess.Popen | None = None) -> list[int]:
    """Wait until count pid files named tag_* exist, then return their pids. With the
    ``launcher`` that starts them, the wait goes on while it and its ranks work
    (``timing.wait_until``)."""
    def files() -> list[Path]:
        return sorted(tmp_path.glob(f"{tag}_?"))

    appeared = timing.wait_until(lambda: len(files()) >= count, within_s, launcher)
    assert appeared, f"only {len(files())} of {count} {tag} files appeared ({timing.describe()})"
    return [int(f.read_text()) for f in files()]


# ----------------------------------------------------------------------------- environment


def test_each_rank_sees_its_env_and_a_free_port(tmp_path):
    job = script(tmp_path, """
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "TENSORPLAY_LAUNCHER", "PYTHONUNBUFFERED"]
        (HERE / f"env_{RANK}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
    """)
    res = run("--nproc-per-node", "3", job)
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"env_{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs} == {
        ("3", "3", "0")}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert {(e["TENSORPLAY_LAUNCHER"], e["PYTHONUNBUFFERED"]) for e in envs} == {
        ("tensorplay-run", "1")}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1
    port = int(ports.pop())
    assert 1 <= port <= 65535
    with socket.socket() as sock:  # it was picked free, and nobody holds it now
        sock.bind(("127.0.0.1", port))


@pytest.mark.slow  # two launchers meet in a store: each loads torch
def test_second_node_gets_global_ranks(tmp_path):
    job = script(tmp_path, """
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
        (HERE / f"env_{RANK}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
    """)
    port = str(socket_free_port())
    nodes = [subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--node_rank", str(i), "--master-addr",
                               "127.0.0.1", "--master_port", port, "--nproc-per-node", "2",
                               str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in (0, 1)]
    try:
        outs = [n.communicate(timeout=60)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outs
    got = sorted(tuple(json.loads(p.read_text()).values()) for p in tmp_path.glob("env_*.json"))
    assert got == [(str(r), str(r % 2), "4", str(r // 2), "127.0.0.1", port) for r in range(4)]


def test_module_form_passes_args_through_untouched(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    args = ["--nproc-per-node", "5", "-m", "x y", "--log-dir", "--", "--lr=0.1"]
    res = run("--nproc-per-node", "2", "-m", "mypkg.job", *args, env=env)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"[rank {r}] {json.dumps(args)}" for r in (0, 1)]


# ----------------------------------------------------------------------------- output


def test_output_is_prefixed_per_stream_with_partial_and_binary_lines(tmp_path):
    job = script(tmp_path, """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
        sys.stdout.buffer.write(b"raw \\xff tail")
    """)
    res = run("--nproc-per-node", "2", job)
    assert res.returncode == 0, res.stderr
    out, err = res.stdout.splitlines(), res.stderr.splitlines()
    for r in (0, 1):
        assert f"[rank {r}] out {r}" in out
        assert f"[rank {r}] raw \ufffd tail" in out  # partial last line, non-UTF-8 byte
        assert f"[rank {r}] err {r}" in err
        assert f"[rank {r}] err {r}" not in out


def test_log_ranks_hides_other_ranks(tmp_path):
    job = script(tmp_path, 'print(f"hello from {RANK}")\n')
    res = run("--nproc-per-node", "3", "--log-ranks", "0,2", job)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank 0] hello from 0", "[rank 2] hello from 2"]
    assert "rank 1" not in res.stdout + res.stderr


def test_log_ranks_still_shows_tail_of_failed_hidden_rank(tmp_path):
    job = script(tmp_path, """
        for i in range(60):
            print(f"line {i} of {RANK}")
        if RANK == 1:
            sys.exit("rank 1 broke")
    """)
    res = run("--nproc-per-node", "2", "--log-ranks", "0", job)
    assert res.returncode == 1
    assert "[rank 1]" not in res.stdout
    assert "[rank 1] rank 1 broke" in res.stderr
    assert "[rank 1] line 59 of 1" in res.stderr
    assert "[rank 1] line 0 of 1" not in res.stderr  # only the tail (~50 lines)
    assert "rank 1 failed first (exit code 1)" in res.stderr


def test_log_dir_gets_one_unprefixed_file_per_rank(tmp_path):
    job = script(tmp_path, """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
    """)
    logs = tmp_path / "logs" / "nested"
    res = run("--nproc-per-node", "2", "--log-ranks", "0", "--log-dir", logs, job)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0.log", "rank_1.log"]
    for r in (0, 1):
        assert sorted((logs / f"rank_{r}.log").read_text().splitlines()) == [
            f"err {r}", f"out {r}"]


# ----------------------------------------------------------------------------- failures


def test_failed_rank_stops_the_others_and_its_code_is_returned(tmp_path):
    job = script(tmp_path, """
        write_pid()
        if RANK == 1:  # once every pid is known, grandchildren's too
            while len(list(HERE.glob("pid_?"))) < 4 or len(list(HERE.glob("grandchild_?"))) < 3:
                time.sleep(0.02)
            sys.exit(3)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write_pid(child.pid, tag="grandchild")
        time.sleep(60)
    """)
    start = time.monotonic()
    res = run("--nproc-per-node", "4", "--settle-s", "0.2", job)  # the others stop soon
    assert res.returncode == 3
    assert time.monotonic() - start < timing.bound(0, 20)
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: rank 1 failed first (exit code 3); stopped ranks 0, 2-3.")
    assert_all_gone(read_pids(tmp_path, 4) + read_pids(tmp_path, 3, tag="grandchild"))


def test_rank_killed_by_signal_is_named(tmp_path):
    job = script(tmp_path, """
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", "--settle-s", "0.2", job)
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 0 failed first (killed by signal SIGKILL)" in res.stderr


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path):
    job = script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write_pid()
        if RANK == 0:
            while not (HERE / "pid_1").exists():
                time.sleep(0.02)
            sys.exit(4)
        time.sleep(60)
    """)
    start = time.monotonic()
    res = run("--nproc-per-node", "2", "--stop-grace-s", "0.5", "--settle-s", "0.2", job)
    assert res.returncode == 4
    assert time.monotonic() - start < timing.bound(0.7, 9.3)  # settle 0.2, stop grace 0.5
    assert_all_gone(read_pids(tmp_path, 2))


@pytest.mark.parametrize(("teardown_s", "grace_s", "fate"), [
    (1.0, 30.0, "exit code 1"),  # ends within the grace: by itself, with its script's code
    (60.0, 0.5, "stopped while exiting"),  # still tearing down when the grace ran out
])
def test_a_failed_rank_slow_to_exit_gets_the_grace_without_a_sigterm(tmp_path, teardown_s,
                                                                      grace_s, fate):
    job = script(tmp_path, f"""
        import atexit
        if RANK == 1:
            atexit.register(time.sleep, {teardown_s})  # a slow teardown, as torch's under load
            raise ValueError("bad lr")
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", "--settle-s", "0.1", "--stop-grace-s", str(grace_s), job)
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines()[-1] == (
        f"tensorplay-run: rank 1 failed first ({fate}): ValueError: bad lr; stopped rank 0.")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_every_child(tmp_path, sig, code):
    job = script(tmp_path, """
        write_pid()
        time.sleep(60)
    """)
    launcher = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "3", str(job)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = read_pids(tmp_path, 3, launcher=launcher)
        assert all(alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
    assert launcher.returncode == code
    assert f"got {signal.Signals(sig).name}; stopped ranks 0-2." in err
    assert_all_gone(pids)


def test_sigusr1_to_the_launcher_reaches_every_rank_and_the_job_goes_on(tmp_path):
    job = script(tmp_path, """
        warned = []
        signal.signal(signal.SIGUSR1, lambda *_: warned.append(time.monotonic()))
        write_pid()
        deadline = time.monotonic() + 60
        while not warned and time.monotonic() < deadline:
            time.sleep(0.05)
        (HERE / f"warned_{RANK}").write_text(str(bool(warned)))
    """)
    launcher = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "2", str(job)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        read_pids(tmp_path, 2, launcher=launcher)
        launcher.send_signal(signal.SIGUSR1)
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    assert "got SIGUSR1; passed it to ranks 0-1; the job goes on." in err
    assert [(tmp_path / f"warned_{r}").read_text() for r in (0, 1)] == ["True", "True"]


# ----------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(("argv", "flag"), [
    (["--nproc-per-node", "0"], "--nproc-per-node=0"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"],
     "--node-rank=2"),
    (["--nnodes", "2", "--master-port", "29500"], "--master-addr=None"),
    (["--nnodes", "2", "--master-addr", "h"], "--master-port=None"),
    (["--master-port", "70000"], "--master-port=70000"),
    (["--nproc-per-node", "2", "--log-ranks", "0,2"], "--log-ranks='0,2'"),
    (["--nproc_per_node", "two"], "--nproc_per_node"),
    (["--node-grace-s", "0"], "--node-grace-s=0.0"),
    (["--hang-timeout-s", "-1"], "--hang-timeout-s=-1.0"),
    (["--join-timeout-s", "0"], "--join-timeout-s=0.0"),
    (["--max-restarts", "-1"], "--max-restarts=-1"),
])
def test_usage_errors_name_the_flag(tmp_path, capsys, argv, flag):
    job = script(tmp_path, "raise SystemExit('must not run')\n")
    assert main([*argv, str(job)]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert "Fix:" in err or "invalid int value" in err


def test_a_bad_grace_in_the_environment_is_a_usage_error_naming_it(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("TENSORPLAY_NODE_GRACE_S", "ten")
    job = script(tmp_path, "raise SystemExit('must not run')\n")
    assert main([str(job)]) == 2
    err = capsys.readouterr().err
    assert "TENSORPLAY_NODE_GRACE_S='ten': is not a number of seconds" in err, err


def test_unknown_script_exits_2_from_the_command_line(tmp_path):
    res = run("--nproc-per-node", "2", tmp_path / "missing.py", "--x")
    assert res.returncode == 2
    assert "script=" in res.stderr and "missing.py" in res.stderr and "no such file" in res.stderr
    assert res.stdout == ""


def test_a_master_port_in_use_is_a_usage_error_before_any_rank_starts(tmp_path):
    job = script(tmp_path, "write_pid()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run("--nproc-per-node", "2", "--master-port", port, job)
        # node 1 does not hold rank 0, which serves the store: no check there
        on_node_1 = parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                "--master-port", str(port), str(job)])
    assert res.returncode == 2
    assert res.stderr == (
        f"tensorplay-run: error: --master-port={port}: is already in use on 127.0.0.1 (another "
        f"program or job listens there), where rank 0 must serve the rendezvous store. Fix: "
        f"pick another --master-port, or omit it on one node to get a free one.\n")
    assert list(tmp_path.glob("pid_*")) == []  # no rank started
    assert on_node_1.master_port == port


# ----------------------------------------------------------------------------- the summary


@pytest.mark.slow
@pytest.mark.warm_ranks  # its ranks must all fail within the 1 s settle
def test_the_rank_that_raised_first_is_named_even_when_another_exits_first(tmp_path):
    job = script(tmp_path, """
        import atexit
        if RANK == 1:  # raises first, then lingers at exit (reported, printed, not exited)
            atexit.register(lambda: ((HERE / "raised").write_text("x"), time.sleep(60)))
            raise ValueError("bad lr")
        if RANK == 0:  # exits first, after rank 1 raised
            while not (HERE / "raised").exists():
                time.sleep(0.02)
            sys.exit(3)
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "3", "--stop-grace-s", "2", job)
    assert res.returncode == 1
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: rank 1 failed first (stopped while exiting): ValueError: bad lr; then "
        "rank 0 failed too; stopped rank 2.")
    assert "[rank 1] ValueError: bad lr" in res.stderr


TORCH_LIKE_HOOK = """
import atexit, io
def hook(t, v, tb, old=sys.excepthook):  # what torch's init_process_group installs
    buf, sys.stderr = sys.stderr, io.StringIO()
    try:
        old(t, v, tb)
    finally:
        buf, sys.stderr = sys.stderr, buf
    lines = buf.getvalue().split("\\n")
    sys.stderr.write("\\n".join(f"[rank{RANK}]: {s}" if s else "" for s in lines))
sys.excepthook = hook
"""


@pytest.mark.slow
@pytest.mark.warm_ranks  # its ranks must all fail within the 1 s settle
def test_identical_tracebacks_print_once_labelled_with_their_ranks(tmp_path):
    job = script(tmp_path, TORCH_LIKE_HOOK + textwrap.dedent("""
        def check(step):
            if RANK == 3:
                atexit.register(lambda: (HERE / "three").write_text("x"))
                raise KeyError("lr")
            while not (HERE / "three").exists():
                time.sleep(0.02)
            raise RuntimeError(f"step {step}: rank 3 (pid {os.getpid()}) is gone")
        check(7)
    """))
    res = run("--nproc-per-node", "4", "--log-dir", tmp_path / "logs", job)
    assert res.returncode == 1
    err = res.stderr
    assert err.count("Traceback (most recent call last):") == 2, err
    assert re.search(r"\[rank\d\]", err) is None, err  # torch's tag is not doubled
    three, others = err.index("[rank 3] KeyError: 'lr'"), err.index("[ranks 0-2] RuntimeError")
    assert three < others  # the first failure's block first
    assert re.search(r"^\[ranks 0-2\] RuntimeError: step 7: rank 3 \(pid \d+\) is gone$", err,
                     re.MULTILINE)
    assert err.splitlines()[-1] == (
        "tensorplay-run: rank 3 failed first (exit code 1): KeyError: 'lr'; then ranks 0-2 "
        "failed too.")
    for r in range(4):  # the log files keep every rank's own lines, torch's tag included
        log = (tmp_path / "logs" / f"rank_{r}.log").read_text()
        assert f"[rank{r}]: Traceback (most recent call last):" in log


@pytest.mark.slow
@pytest.mark.warm_ranks  # its ranks must all fail within the 1 s settle
def test_a_hidden_rank_that_raised_shows_its_tail_and_traceback(tmp_path):
    job = script(tmp_path, """
        if RANK == 1:
            print("loading shard 1", flush=True)
            raise ValueError("bad shard")
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", "--log-ranks", "0", job)
    assert res.returncode == 1
    assert "[rank 1]" not in res.stdout
    assert "[rank 1] loading shard 1" in res.stderr
    assert res.stderr.count("[rank 1] Traceback (most recent call last):") == 1
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: rank 1 failed first (exit code 1): ValueError: bad shard; stopped rank 0.")


@pytest.mark.slow
def test_ranks_that_die_after_finishing_are_not_the_cause(tmp_path):
    job = script(tmp_path, """
        import atexit
        write_pid()
        while len(list(HERE.glob("pid_?"))) < 4:
            time.sleep(0.02)
        if RANK == 0:
            time.sleep(600)  # still in its script (a collective the others never joined) when
            # the launcher stops it, however long the scaled --settle-s on a loaded machine
        atexit.register(os.abort)  # dies at exit, as a C++ destructor's terminate() would
    """)
    res = run("--nproc-per-node", "4", "--settle-s", f"{timing.guard(3):.0f}", job)  # the
    # three aborts land within it, on a loaded machine too
    assert res.returncode == 128 + signal.SIGABRT
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: ranks 1-3 finished their script, then died at exit (killed by signal "
        "SIGABRT); rank 0 had not finished its script (stopped).")
    assert_all_gone(read_pids(tmp_path, 4))


@pytest.mark.slow
def test_the_rank_whose_script_raised_is_named_before_those_that_died_at_exit(tmp_path):
    job = script(tmp_path, """
        import atexit
        write_pid()
        while len(list(HERE.glob("pid_?"))) < 4:
            time.sleep(0.02)
        if RANK == 0:
            atexit.register(lambda: (HERE / "zero").write_text("x"))  # runs once it reported
            raise RuntimeError("all_reduce(): a peer rank died")
        def die_after_rank_0():  # at exit, once rank 0 has raised: terminate(), as in C++
            while not (HERE / "zero").exists():
                time.sleep(0.02)
            os.abort()
        atexit.register(die_after_rank_0)
    """)
    # the others die at exit within --settle-s and rank 0 ends within --stop-grace-s, both
    # scaled: on a loaded machine a teardown with torch loaded can outlast 5 + 5 s
    res = run("--nproc-per-node", "4", "--settle-s", f"{timing.guard(5):.0f}",
              "--stop-grace-s", f"{timing.guard(5):.0f}", job)
    assert res.returncode == 1
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: rank 0 failed first (exit code 1): RuntimeError: all_reduce(): a peer "
        "rank died; ranks 1-3 finished their script, then died at exit (killed by signal "
        "SIGABRT).")


# ----------------------------------------------------------------------------- no orphans


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    job = script(tmp_path, """
        write_pid()
        while True:
            time.sleep(0.1)
    """)
    launcher = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "4", str(job)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        pids = read_pids(tmp_path, 4, launcher=launcher)
        assert all(alive(p) for p in pids)
        launcher.kill()  # SIGKILL: no handler of the launcher runs
        launcher.wait(timeout=10)
        assert_all_gone(pids, within_s=5)
    finally:
        launcher.kill()
        launcher.wait()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------------------- threads


@pytest.mark.slow
def test_omp_num_threads_is_one_per_rank_unless_set_and_said_once(tmp_path):
    job = script(tmp_path, """
        (HERE / f"omp_{RANK}").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
    """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def threads() -> list[str]:
        return [(tmp_path / f"omp_{r}").read_text() for r in range(2)]

    res = run("--nproc-per-node", "2", job, env=env)
    assert res.returncode == 0, res.stderr
    assert threads() == ["1", "1"]
    assert res.stderr.count("OMP_NUM_THREADS") == 1
    assert res.stderr.startswith("tensorplay-run: setting OMP_NUM_THREADS=1 for every rank, as "
                                 "torchrun does")
    res = run("--nproc-per-node", "2", job, env={**env, "OMP_NUM_THREADS": "3"})
    assert res.returncode == 0, res.stderr
    assert threads() == ["3", "3"]
    assert "setting OMP_NUM_THREADS" not in res.stderr  # (warm start's fallback line may
    # name it: with 3 threads, the warm process's BLAS pool makes a fork unsafe)


# ----------------------------------------------------------------------------- a real job

MISMATCH = """\
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=60)
init_device_mesh("cpu", (4, 1) if dist.get_rank() == 3 else (2, 2))
"""


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.warm_ranks
def test_a_real_mesh_mismatch_prints_one_traceback_and_all_ranks_failing_alike(tmp_path):
    job = tmp_path / "mismatch.py"
    job.write_text(MISMATCH)
    res = run("--nproc-per-node", "4", "--settle-s", "10", job, timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]
    err = res.stderr
    assert err.count("Traceback (most recent call last):") == 1, err
    assert re.search(r"\[rank\d\]", err) is None, err  # torch's excepthook tag is taken off
    assert ("[ranks 0-3] tensorplay.distributed.errors.MeshMismatchError: ranks disagree on "
            "mesh_shape in init_device_mesh()") in err
    assert err.splitlines()[-1] == (
        "tensorplay-run: all 4 ranks failed alike (exit code 1): MeshMismatchError: ranks "
        "disagree on mesh_shape in init_device_mesh(); every rank must pass the same value: "
        "(2, 2): passed by ranks 0-2; (4, 1): passed by rank 3.")


def test_a_rank_failed_error_exits_1_after_atexit_handlers_without_module_teardown(tmp_path):
    job = script(tmp_path, """
        import atexit
        from tensorplay.distributed.errors import RankFailedError
        atexit.register(lambda: print("atexit ran", flush=True))
        if RANK == 1:
            raise RankFailedError("all_reduce() failed: rank 0 died", ranks=[0])
    """)
    # rank 0 may still be starting when rank 1 fails (a loaded machine): --settle-s lets it
    # end on its own, so its atexit line is printed (the launcher waits no longer than that)
    res = run("--nproc-per-node", "2", "--settle-s", f"{timing.guard(30):.0f}", job)
    assert res.returncode == 1, res.stderr
    assert "[rank 0] atexit ran" in res.stdout
    assert "[rank 1] atexit ran" in res.stderr  # after its traceback: held with it
    assert ("tensorplay-run: rank 1 failed first (exit code 1): RankFailedError: all_reduce() "
            "failed: rank 0 died; no other rank was still running.") in res.stderr, res.stderr
