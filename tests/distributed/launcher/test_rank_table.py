"""A rank says who it is (launcher/rank_table.py, rank_main.name_this_process): the launcher's
rank -> pid table lists each rank's process, whose command line is its title
(``tensorplay-run rank 1/4: python job.py --lr 0.1``) and name ``rank 1``, and the table is
gone when the job ends, however it ends. Plain ranks here (standard-library scripts); the
warm ranks' titles are tested in test_warm.py."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tensorplay.distributed.host import procfs
from tensorplay.distributed.launcher import rank_table
from tests import timing

from .test_main import LAUNCHER, assert_all_gone, read_pids, script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process titles and the table's checks read /proc")

WAIT_FOR_GO = """
    write_pid()
    while not (HERE / "go").exists():
        time.sleep(0.05)
"""


def title(rank: int, world: int, job: Path, *args: str, restart: int = 0) -> str:
    """The command line a rank of ``job`` shows (spec.rank_title)."""
    again = f" (restart {restart})" if restart else ""
    line = shlex.join([os.path.basename(sys.executable), str(job), *args])
    return f"tensorplay-run rank {rank}/{world}{again}: {line}"


def rows(path: Path) -> dict[int, int]:
    """The table's rank -> pid lines (none while it is missing); checks each line's form."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    lines = text.splitlines()
    assert lines[0].startswith("# rank pid host: tensorplay-run "), text
    table = {}
    for line in lines[1:]:
        rank, pid, host = line.split()
        assert host, line
        table[int(rank)] = int(pid)
    return table


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """A launcher whose temporary directory (and so whose table) is the test's own; it and
    the path of its table."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    launcher = subprocess.Popen([*LAUNCHER, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                env={**os.environ, "TMPDIR": str(tmp)})
    return launcher, tmp / f"tensorplay-run-{os.getuid()}" / f"{launcher.pid}.ranks"


def await_table(path: Path, launcher: subprocess.Popen, want: dict[int, int] | int
                ) -> dict[int, int]:
    """Wait until the table lists ``want`` ranks (a count) or exactly these rank -> pids."""
    def holds() -> bool:
        got = rows(path)
        return len(got) == want if isinstance(want, int) else got == want

    assert timing.wait_until(holds, 15, launcher), (rows(path), timing.describe())
    return rows(path)


def test_each_plain_rank_shows_its_title_and_the_table_goes_on_sigterm(tmp_path):
    job = script(tmp_path, WAIT_FOR_GO)
    launcher, path = start(tmp_path, "--nproc-per-node", "4", str(job), "--lr", "0.1")
    pids: list[int] = []
    try:
        pids = read_pids(tmp_path, 4, launcher=launcher)
        table = await_table(path, launcher, 4)
        assert sorted(table.values()) == sorted(pids)
        for rank, pid in table.items():
            # the kernel hands out one string: the title (what ps -o args prints)
            assert procfs.cmdline(pid) == [title(rank, 4, job, "--lr", "0.1")]
            assert Path(f"/proc/{pid}/cmdline").read_bytes().count(b"\0") == 1
            assert procfs.comm(pid) == f"rank {rank}"
            assert procfs.environ(pid)["RANK"] == str(rank)  # exec'd with it: plain
        ps = subprocess.run([*LAUNCHER, "--ps", str(launcher.pid)], capture_output=True,
                            text=True, timeout=timing.guard(30),
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
        assert (ps.returncode, ps.stdout) == (0, path.read_text()), ps.stderr
        launcher.send_signal(signal.SIGTERM)
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert not path.exists()
    assert_all_gone(pids)


def test_a_restarted_rank_gets_a_new_line_and_says_so_in_its_title(tmp_path):
    job = script(tmp_path, """
        if RANK == 1 and "TENSORPLAY_RESTART_COUNT" not in os.environ:
            os.kill(os.getpid(), signal.SIGKILL)  # lost: elastic mode restarts it
        write_pid()
        while not (HERE / "go").exists():
            time.sleep(0.05)
    """)
    launcher, path = start(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", str(job))
    try:
        pids = read_pids(tmp_path, 2, launcher=launcher)
        table = await_table(path, launcher, dict(enumerate(pids)))
        assert procfs.cmdline(table[1]) == [title(1, 2, job, restart=1)]
        assert procfs.cmdline(table[0]) == [title(0, 2, job)]
        (tmp_path / "go").touch()
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0, err
    assert "rank 1 lost (killed by signal SIGKILL); elastic mode: restarting it" in err
    assert not path.exists()


def test_the_table_goes_when_a_rank_fails(tmp_path):
    job = script(tmp_path, """
        write_pid()
        while not (HERE / "go").exists():
            time.sleep(0.05)
        if RANK == 1:
            raise ValueError("bad lr")
        time.sleep(60)
    """)
    launcher, path = start(tmp_path, "--nproc-per-node", "2", str(job))
    try:
        pids = read_pids(tmp_path, 2, launcher=launcher)
        await_table(path, launcher, dict(enumerate(pids)))
        (tmp_path / "go").touch()
        _, err = timing.communicate(launcher, 20)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 1, err
    assert "rank 1 failed first (exit code 1): ValueError: bad lr; stopped rank 0." in err
    assert not path.exists()


def test_a_table_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = rank_table.table_dir()
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(OSError, match=r"is not a directory that only this user .* can use "
                                      r"\(mode drwxr-xr-x"):
        rank_table.RankTable.create("header", "hostA")


def test_stale_tables_are_removed_and_ps_shows_running_launchers_only(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    folder = rank_table.table_dir()
    folder.mkdir(mode=0o700)
    (folder / f"{gone}.ranks").write_text("# rank pid host: a launcher killed by SIGKILL\n")
    (folder / "notes.ranks").write_text("not a table: left alone\n")
    table = rank_table.RankTable.create("tensorplay-run 4242, node 0 of 1: python t.py", "hA")
    assert not (folder / f"{gone}.ranks").exists() and (folder / "notes.ranks").exists()
    table.write({1: 11, 0: 10})
    assert table.path.read_text() == ("# rank pid host: tensorplay-run 4242, node 0 of 1: "
                                      "python t.py\n0 10 hA\n1 11 hA\n")
    assert rank_table.show(None) == (f"{table.path}:\n{table.path.read_text()}", 0)
    assert rank_table.show(os.getpid()) == (table.path.read_text(), 0)
    table.remove()
    table.remove()  # gone already: nothing to do
    text, code = rank_table.show(None)
    assert code == 1 and "no running job of this user" in text
