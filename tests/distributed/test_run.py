"""Tests of the tensorplay-run launcher: environment, output routing, fail-fast, signals, usage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tensorplay.distributed.run import child_env, main, parse_rank_list

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


def run(*args: str | Path, timeout: float = 30, env: dict | None = None):
    """Run the launcher to completion and return the CompletedProcess (text output)."""
    return subprocess.run([*LAUNCHER, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, errors="replace")


def alive(pid: int) -> bool:
    """True while pid is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_all_gone(pids: list[int], within_s: float = 3.0) -> None:
    """Every pid must have exited (within a short settling time)."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


def read_pids(tmp_path: Path, count: int, tag: str = "pid", within_s: float = 15.0) -> list[int]:
    """Wait until count pid files named tag_* exist, then return their pids."""
    deadline = time.monotonic() + within_s
    while len(files := sorted(tmp_path.glob(f"{tag}_?"))) < count:
        assert time.monotonic() < deadline, f"only {len(files)} of {count} {tag} files appeared"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


# ----------------------------------------------------------------------------- pure functions


def test_child_env_sets_torchrun_variables_and_keeps_base():
    env = child_env({"PATH": "/bin", "RANK": "99"}, rank=5, local_rank=1, world_size=8,
                    local_world_size=4, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert (env["GROUP_RANK"], env["NODE_RANK"]) == ("1", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert env["PYTHONUNBUFFERED"] == "1" and env["TENSORPLAY_LAUNCHER"] == "tensorplay-run"
    assert all(isinstance(v, str) for v in env.values())


def test_parse_rank_list_accepts_lists_and_ranges():
    assert parse_rank_list("0,3", 4) == {0, 3}
    assert parse_rank_list("0-2, 5", 8) == {0, 1, 2, 5}


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


def test_second_node_gets_global_ranks(tmp_path):
    job = script(tmp_path, """
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
        (HERE / f"env_{RANK}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
    """)
    res = run("--nnodes", "2", "--node_rank", "1", "--master-addr", "10.1.2.3",
              "--master_port", "29511", "--nproc-per-node", "2", job)
    assert res.returncode == 0, res.stderr
    got = sorted(tuple(json.loads(p.read_text()).values()) for p in tmp_path.glob("env_*.json"))
    assert got == [("2", "0", "4", "1", "10.1.2.3", "29511"),
                   ("3", "1", "4", "1", "10.1.2.3", "29511")]


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
        if RANK == 1:
            while len(list(HERE.glob("pid_?"))) < 4:
                time.sleep(0.02)
            sys.exit(3)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write_pid(child.pid, tag="grandchild")
        time.sleep(60)
    """)
    start = time.monotonic()
    res = run("--nproc-per-node", "4", job)
    assert res.returncode == 3
    assert time.monotonic() - start < 20
    assert res.stderr.splitlines()[-1] == (
        "tensorplay-run: rank 1 failed first (exit code 3); stopped ranks 0, 2-3.")
    assert_all_gone(read_pids(tmp_path, 4) + read_pids(tmp_path, 3, tag="grandchild"))


def test_rank_killed_by_signal_is_named(tmp_path):
    job = script(tmp_path, """
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    res = run("--nproc-per-node", "2", job)
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
    res = run("--nproc-per-node", "2", "--stop-grace-s", "0.5", job)
    assert res.returncode == 4
    assert time.monotonic() - start < 10
    assert_all_gone(read_pids(tmp_path, 2))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_every_child(tmp_path, sig, code):
    job = script(tmp_path, """
        write_pid()
        time.sleep(60)
    """)
    launcher = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "3", str(job)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = read_pids(tmp_path, 3)
        assert all(alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == code
    assert f"got {signal.Signals(sig).name}; stopped ranks 0-2." in err
    assert_all_gone(pids)


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
])
def test_usage_errors_name_the_flag(tmp_path, capsys, argv, flag):
    job = script(tmp_path, "raise SystemExit('must not run')\n")
    assert main([*argv, str(job)]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert "Fix:" in err or "invalid int value" in err


def test_unknown_script_exits_2_from_the_command_line(tmp_path):
    res = run("--nproc-per-node", "2", tmp_path / "missing.py", "--x")
    assert res.returncode == 2
    assert "script=" in res.stderr and "missing.py" in res.stderr and "no such file" in res.stderr
    assert res.stdout == ""
