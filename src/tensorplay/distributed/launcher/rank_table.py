"""The rank -> pid table of a running job: one file per launcher, for a person and ``--ps``.

Each launcher writes the pids of its node's ranks to ``<tempdir>/tensorplay-run-<uid>/<launcher
pid>.ranks`` (``<tempdir>`` is Python's ``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``)
when they start, again whenever elastic mode restarts one, and removes it when the job ends
(normally, failed, or stopped by Ctrl-C or SIGTERM). For launcher 4242 of user 1000 on hostA,
running 4 ranks::

    $ cat /tmp/tensorplay-run-1000/4242.ranks
    # rank pid host: tensorplay-run 4242, node 0 of 1: python train.py --lr 0.1
    0 4250 hostA
    1 4254 hostA
    2 4258 hostA
    3 4262 hostA
    $ kill -9 $(awk '$1 == 2 {print $2}' /tmp/tensorplay-run-1000/4242.ranks)   # rank 2

A rank's line holds its latest process (a restarted rank: the new pid); a rank that ended
keeps its line until the job ends. The file is replaced whole (``os.replace``), so a reader
never sees half of it. The directory is the user's own (mode 0700, checked at each start, as
tmux checks ``/tmp/tmux-<uid>``): no other user can put a file or a link in it. A launcher
killed by SIGKILL (or SIGHUP, which it does not catch) leaves its file behind; the next
launcher of that user removes every file whose launcher is no longer running, and
``tensorplay-run --ps`` shows only running launchers' tables.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path

from ..host import procfs
from .options import PROG

SUFFIX = ".ranks"


def table_dir() -> Path:
    """``<tempdir>/tensorplay-run-<uid>``: where this user's launchers write their tables."""
    return Path(tempfile.gettempdir()) / f"{PROG}-{os.getuid()}"


def table_path(launcher_pid: int) -> Path:
    """The table of the launcher ``launcher_pid``: ``/tmp/tensorplay-run-1000/4242.ranks``."""
    return table_dir() / f"{launcher_pid}{SUFFIX}"


def _pid_of(path: Path) -> int | None:
    """The launcher pid a table's name holds (``4242.ranks`` -> 4242); None: not a table."""
    name = path.name[:-len(SUFFIX)]
    return int(name) if name.isdigit() else None


def _tables(folder: Path, alive: bool) -> list[Path]:
    """The tables in ``folder`` whose launcher runs (``alive``) or does not, by pid."""
    found = [(pid, p) for p in folder.glob(f"*{SUFFIX}") if (pid := _pid_of(p)) is not None]
    return [p for pid, p in sorted(found) if procfs.alive(pid) == alive]


def private_dir() -> Path:
    """Make the table directory (0700) if it is missing, and check it is this user's alone
    (``etcd_members`` keeps its members' data there too). Raises OSError naming what is
    wrong (a link, another owner, a mode open to others)."""
    path = table_dir()
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a directory that only this user (uid {os.getuid()}) "
                      f"can use (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid})")
    return path


class RankTable:
    """One launcher's table file (see the module): ``write`` after each (re)start, ``remove``
    at the end. Worked example, node 0 of 1, launcher 4242::

        table = RankTable.create("tensorplay-run 4242, node 0 of 1: python train.py", "hostA")
        table.write({0: 4250, 1: 4254})   # "0 4250 hostA", "1 4254 hostA"
        table.remove()
    """

    def __init__(self, path: Path, header: str, host: str):
        self.path = path
        self.header = header
        self.host = host

    @classmethod
    def create(cls, header: str, host: str) -> RankTable:
        """The table of this launcher, in a checked private directory, whose stale files
        (launchers no longer running) are removed first. Raises OSError."""
        folder = private_dir()
        for old in _tables(folder, alive=False):
            with suppress(FileNotFoundError):  # another launcher removed it meanwhile
                old.unlink()
        return cls(folder / f"{os.getpid()}{SUFFIX}", header, host)

    def text(self, pids: Mapping[int, int]) -> str:
        """The file's text: the header, then ``rank pid host`` for each rank, by rank."""
        rows = "".join(f"{rank} {pid} {self.host}\n" for rank, pid in sorted(pids.items()))
        return f"# rank pid host: {self.header}\n{rows}"

    def write(self, pids: Mapping[int, int]) -> None:
        """Replace the file with these ranks' pids (rank -> pid). Raises OSError."""
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(self.text(pids))
        os.replace(part, self.path)

    def remove(self) -> None:
        """Remove the file (already gone: nothing to do). Raises OSError otherwise."""
        with suppress(FileNotFoundError):
            self.path.unlink()


def show(launcher_pid: int | None) -> tuple[str, int]:
    """What ``tensorplay-run --ps [LAUNCHER_PID]`` prints, and its exit status: the table of
    that launcher, or of every running launcher of this user (each after its path), 0; or
    what was looked for, 1, when there is none."""
    if launcher_pid is not None:
        path = table_path(launcher_pid)
        try:
            return path.read_text(), 0
        except FileNotFoundError:
            return f"{PROG}: no rank table of launcher {launcher_pid} ({path} is missing).\n", 1
    texts = []
    for path in _tables(table_dir(), alive=True):
        with suppress(FileNotFoundError):  # its launcher ended meanwhile
            texts.append(f"{path}:\n{path.read_text()}")
    if not texts:
        return f"{PROG}: no running job of this user ({table_dir()} holds no table).\n", 1
    return "".join(texts), 0
