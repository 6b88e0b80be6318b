"""Warm start: one process per node imports torch once, and every rank is a fork of it.

Eight ranks that each import torch on two cores take seconds; a fork takes milliseconds. The
launcher starts one *warm server* (``Warm.start``): a child of the launcher, in its own session
(a Ctrl-C to the terminal reaches the launcher, which stops the ranks as today), that imports
torch (when installed), this package and each ``--preload`` module, then answers requests over
a ``SOCK_SEQPACKET`` socket pair, one JSON message per packet::

    launcher -> server   {"env": {...}, "argv": ["--file", "train.py", "--lr", "0.1"],
                          "cwd": "/job"}  + fds [stdin, stdout, stderr, report] (send_fds)
    server -> launcher   {"ready": true} | {"ready": false, "why": "..."}   (once, at start)
                         {"started": PID} | {"failed": "OSError: ..."}      (per request)
                         {"exit": PID, "code": CODE}   (Popen's returncode: -N for signal N)

The server is the ranks' parent, so only it can wait for them: it reaps each on SIGCHLD and
sends its exit; ``WarmProc`` is the launcher's handle (``pid``, ``returncode``, ``wait``,
``stdout``, ``stderr``: what ``procs`` used of ``subprocess.Popen``). The forked child
(``_child``) does what a fresh interpreter under Popen had: its own session (the rank's process
group), stdin/stdout/stderr on the given fds, the environment, the signal handlers of a fresh
interpreter, fresh seeds for ``random`` and numpy (from the OS, as at interpreter start; torch's
generator goes back to its start seed, the constant a fresh interpreter has), the server's
socket closed; then ``rank_main.main()``, the same code a plain rank runs (parent-death signal,
report pipe, ``python script.py`` semantics), and the interpreter's exit (threads joined,
atexit, flush). The parent-death chain: launcher dies -> the server (PR_SET_PDEATHSIG) -> each
rank (its own PR_SET_PDEATHSIG on the server).

Forking is refused (``ready: false``; the launcher prints one line and starts ranks plainly)
when it is unsafe: the server has a second thread (Python's or the OS's: a BLAS pool started by
an import counts), an accelerator runtime is initialised, or the platform has no fork. What a
fork cannot give: the ranks share the server's ``PYTHONHASHSEED`` (str hashes), and a module
the server imported is already in ``sys.modules`` (imported once, before any rank existed: it
must not read ``RANK`` at import); a rank's ``/proc/PID/environ`` is the server's (what it was
exec'd with: no ``RANK``, ``LOCAL_RANK``), so tools that find ranks there do not see them.

Its command line is its own: the server is exec'd with its title padded with spaces to
``rank_main.TITLE_PAGE`` bytes of command line (``tensorplay-run warm: python train.py`` and
about 3,800 spaces), takes that title as its command line at once (``name_this_process``;
``ps`` then shows it without the padding), and each forked rank writes its own title over its
copy of those 4,096 bytes (``tensorplay-run rank 5/8: python train.py``).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import IO

from ..host import procfs
from . import rank_main
from .bugs import report_bug

CLOSE_S = 10.0  # how long the server may take to end once the launcher lets it go
KILLED_S = 5.0  # and to be reaped after a SIGKILL, before the launcher leaves it
READY_TIMEOUT_S = 300.0  # the server's imports (torch on a loaded machine, the user's modules)
PACKET = 1 << 20  # the largest message read (an environment fits many times over)
RANK_VARS = ("RANK", "LOCAL_RANK", "TENSORPLAY_RESTART_COUNT", "TENSORPLAY_NODE_INSTANCE",
             rank_main.REPORT_FD, rank_main.PARENT_PID, rank_main.TITLE,
             rank_main.COMM)  # not in the server's environment
WARM_COMM = "tensorplay-warm"  # the server's /proc/<pid>/comm (15 bytes: the kernel's most)


def unsupported() -> str | None:
    """Why this platform cannot warm-start (None: it can)."""
    if not hasattr(os, "fork") or not hasattr(os, "setsid"):
        return "this platform has no fork"
    if not hasattr(socket, "SOCK_SEQPACKET") or not hasattr(socket, "send_fds"):
        return "this platform has no UNIX packet sockets with fd passing"
    return None


class WarmProc:
    """A rank forked by the warm server, as the launcher holds it (like ``subprocess.Popen``)."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class Warm:
    """The launcher's side of the warm server (see the module)."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc = proc
        self.sock = sock
        self.procs: dict[int, WarmProc] = {}
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # one request at a time
        self.procs_lock = threading.Lock()  # procs, and exits heard before their pid was held
        self.early: dict[int, int] = {}
        self.gone = False
        self.reader: threading.Thread | None = None

    @classmethod
    def start(cls, env: Mapping[str, str], preload: Sequence[str],
              title: str = "") -> tuple[Warm | None, str]:
        """Start the server with ``env`` (the ranks' common environment) and wait until it has
        imported everything. Returns (the server, "") or (None, why forking is off).

        ``title`` (Linux): the server's command line for ``ps``. It is passed padded with
        spaces so that the server's whole command line is ``rank_main.TITLE_PAGE`` bytes, the
        room every rank's title is written into: a command line of 330 bytes besides the
        title gets 4096 - 330 - len(title) spaces (none when it is that long already)."""
        why = unsupported()
        if why:
            return None, why
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        server_env = {k: v for k, v in env.items() if k not in RANK_VARS}
        server_env["PYTHONUNBUFFERED"] = "1"  # the ranks' streams are set up as under -u
        program = ("(lambda sys: sys.path.append(sys.argv[1]) or __import__("
                   "'tensorplay.distributed.launcher.warm', fromlist=['serve']).serve())"
                   "(__import__('sys'))")
        cmd = [sys.executable, "-c", program, root, str(theirs.fileno()), str(os.getpid()),
               title, *preload]
        if title:
            used = sum(len(os.fsencode(word)) + 1 for word in cmd)  # each NUL-terminated
            cmd[6] = title + " " * max(0, rank_main.TITLE_PAGE - used)
        try:
            proc = subprocess.Popen(cmd, env=server_env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, start_new_session=True,
                                    pass_fds=(theirs.fileno(),))
        except OSError as err:
            ours.close()
            return None, f"the warm process did not start ({err})"
        finally:
            theirs.close()
        warm = cls(proc, ours)
        ours.settimeout(READY_TIMEOUT_S)
        try:
            first = json.loads(ours.recv(PACKET) or b"null")
        except (OSError, ValueError) as err:
            first = {"ready": False, "why": f"no answer from the warm process ({err})"}
        ours.settimeout(None)
        if not isinstance(first, dict) or not first.get("ready"):
            why = first.get("why") if isinstance(first, dict) else None
            warm.close()
            return None, why or f"the warm process ended at start ({describe(proc)})"
        warm.reader = threading.Thread(target=warm._read, daemon=True,
                                       name="tensorplay-run warm")
        warm.reader.start()
        return warm, ""

    def _read(self) -> None:
        """Reader thread: route the server's replies; its exit messages end WarmProcs."""
        while True:
            try:
                data = self.sock.recv(PACKET)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "exit" in msg:
                with self.procs_lock:
                    proc = self.procs.get(msg["exit"])
                    if proc is None:
                        self.early[msg["exit"]] = msg["code"]
                if proc is not None:
                    proc._ended(msg["code"])
            else:
                self.replies.put(msg)
        self.gone = True  # the server died: its ranks die with it (their parent-death signal)
        self.replies.put({"failed": "the warm process is gone"})
        with self.procs_lock:
            left = [p for p in self.procs.values() if p.returncode is None]
        for proc in left:
            proc._ended(-signal.SIGKILL)

    def spawn(self, env: Mapping[str, str], argv: Sequence[str], stdout_w: int, stderr_w: int,
              report_w: int, stdout_r: int, stderr_r: int) -> WarmProc:
        """Fork one rank: its environment, rank_main's arguments and the child's ends of its
        pipes (this process keeps its own copies; close them after). Raises OSError when the
        server cannot (it is gone, or fork failed)."""
        if self.gone:
            raise OSError("the warm process is gone")
        msg = json.dumps({"env": dict(env), "argv": list(argv), "cwd": os.getcwd()}).encode()
        with open(os.devnull, "rb") as devnull:
            self.lock.acquire()
            try:
                socket.send_fds(self.sock, [msg],
                                [devnull.fileno(), stdout_w, stderr_w, report_w])
                reply = self.replies.get()
                if "started" not in reply:
                    raise OSError(reply.get("failed", "the warm process did not fork"))
                pid = reply["started"]
                proc = WarmProc(pid, open(stdout_r, "rb"), open(stderr_r, "rb"))  # noqa: SIM115
                with self.procs_lock:
                    self.procs[pid] = proc
                    early = self.early.pop(pid, None)
                if early is not None:
                    proc._ended(early)
            finally:
                self.lock.release()
        return proc

    def close(self) -> str | None:
        """Let the server go (it SIGKILLs any rank still alive, reaps, exits) and wait for it:
        up to CLOSE_S, then SIGKILL and up to KILLED_S more. Returns None, or what to say
        when it is still there even then: the launcher does not wait for ever on its own
        clean-up (seen in loaded test runs: a server not reaped 100 s after its SIGKILL)."""
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        left = None
        try:
            self.proc.wait(CLOSE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(KILLED_S)
            except subprocess.TimeoutExpired:
                state = procfs.state(self.proc.pid) or "?"
                left = (f"the warm process (pid {self.proc.pid}) had not ended {CLOSE_S:g} s "
                        f"after the job, nor {KILLED_S:g} s after a SIGKILL (process state "
                        f"{state}); leaving it to the system")
        if self.reader is not None:
            self.reader.join(2.0)
        return left


def describe(proc: subprocess.Popen) -> str:
    code = proc.poll()
    return "still running" if code is None else f"exit code {code}"


# --- the server (its own process) -------------------------------------------------------------

def _threads() -> int:
    """This process's threads as the OS counts them (a BLAS or OpenMP pool counts)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _unsafe() -> str | None:
    """Why forking this process now is unsafe (None: it is safe)."""
    n = max(threading.active_count(), _threads())
    if n > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        return (f"the warm process has {n} threads after its imports (Python's: {names}; "
                f"a BLAS or OpenMP pool counts: OMP_NUM_THREADS=1 avoids one), and a fork "
                f"copies only the calling thread")
    from .. import backends

    return backends.fork_unsafe() or unsupported()


def serve() -> None:
    """The warm server's main: ``python -c PROGRAM ROOT SOCKET_FD LAUNCHER_PID TITLE
    [MODULE...]`` (TITLE padded with spaces; empty: keep the command line)."""
    fd, launcher, title, preload = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    if title:
        try:
            rank_main.name_this_process(title.rstrip(" "), WARM_COMM)
        except OSError as err:  # said; forking goes on (each rank says its own)
            print(f"tensorplay-run: the warm process's title was not set "
                  f"({rank_main.one_line(err)}); ps shows the command line it was started "
                  f"with.", file=sys.stderr)
    path = sys.path[:-1]  # without ROOT, appended by PROGRAM: the interpreter's, for the ranks
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                if signal.getsignal(s) is not None}  # a fresh interpreter's, to give each rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the ranks, not Ctrl-C
    sock = socket.socket(fileno=fd)
    rank_main.die_with_parent(launcher)
    why = None
    try:
        import importlib

        from .. import backends

        for name in backends.WARM_MODULES:
            with suppress(ImportError):
                importlib.import_module(name)
        import tensorplay.distributed  # noqa: F401 - the point: imported once, here

        for name in preload:
            try:
                importlib.import_module(name)
            except BaseException as err:  # noqa: BLE001 - the user's module: told to the launcher
                # its import may raise anything, SystemExit and KeyboardInterrupt included (SIGINT
                # is ignored here, so only one it raises itself): each means this --preload
                # failed, which the launcher says in one line before it starts ranks plainly
                why = f"--preload {name} failed ({rank_main.one_line(err)})"
                break
    except BaseException as err:  # noqa: BLE001 - torch's or numpy's import: told to the launcher
        # a library's import may raise anything besides the ImportError of one not installed
        # (torch: OSError for a broken shared library, RuntimeError): said the same way
        why = f"the warm process failed to import ({rank_main.one_line(err)})"
    sys.path[:] = path
    why = why or _unsafe()
    sock.send(json.dumps({"ready": why is None, "why": why}).encode())
    if why is None:
        _loop(sock, handlers)
    # no interpreter teardown: nothing of it is needed, and with torch loaded it can take
    # seconds on a busy machine while the launcher waits (Warm.close)
    os._exit(0)


def _loop(sock: socket.socket, handlers: dict) -> None:
    """Fork a rank per request; report each child's exit; on EOF kill what is left and go."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
        if wake_r in ready:
            with suppress(BlockingIOError):
                os.read(wake_r, 512)
        _reap(sock, children)
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, PACKET, 8)
        except OSError:
            data, fds = b"", []
        if not data:
            break
        try:
            pid = os.fork()
        except OSError as err:
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"failed": rank_main.one_line(err)}).encode())
            continue
        if pid == 0:
            _child(json.loads(data), fds, sock, (wake_r, wake_w), handlers)  # never returns
        for f in fds:
            os.close(f)
        children.add(pid)
        sock.send(json.dumps({"started": pid}).encode())
    for pid in children:  # the launcher left (or died): leave no rank behind
        with suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Wait for every child that ended and tell the launcher its exit code."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        with suppress(OSError):
            sock.send(json.dumps({"exit": pid, "code": code}).encode())


def _child(request: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int],
           handlers: dict) -> None:
    """In the forked rank: become what Popen started before, then run rank_main and exit."""
    code = 1
    try:
        os.setsid()  # the rank's own process group, as start_new_session
        signal.set_wakeup_fd(-1)
        for s, handler in handlers.items():
            with suppress(OSError, ValueError):
                signal.signal(s, handler)
        sock.close()
        for f in wake:
            os.close(f)
        stdin, stdout, stderr, report = fds
        for src, dst in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(src, dst)
            os.close(src)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[rank_main.REPORT_FD] = str(report)
        os.environ[rank_main.PARENT_PID] = str(os.getppid())
        _reseed()
        sys.argv = ["-c", *request["argv"]]
        code = _run(rank_main.main)
    except OSError as err:  # the rank's start failed (its working directory gone): said, exit 1
        rank_main.say(f"tensorplay-run: the warm process could not start this rank "
                      f"({rank_main.one_line(err)}).\n")
    except BaseException as err:  # noqa: BLE001 - a bug here (_run raises nothing): said, exit 1
        report_bug("the warm process's start of a rank", err)
    finally:
        os._exit(code)  # never the server's own teardown, nor its loop, in a fork


def _reseed() -> None:
    """RNGs as a fresh interpreter has them: random from the OS, the engines' libraries'
    as ``backends.reseed_forked`` says."""
    import random

    from .. import backends

    random.seed()
    backends.reseed_forked()


def _run(main: Callable[[], None]) -> int:
    """Run main() and leave as the interpreter does (CPython's ``Py_RunMain``): the status of
    SystemExit (``_exit_status``), a traceback and 1 for an exception (rank_main printed the
    script's own already), death by SIGINT for KeyboardInterrupt; then non-daemon threads
    joined, atexit run, streams flushed (one that fails: said, and 120). What fails on the
    way out is said as the interpreter says it, and the exit goes on."""
    code, interrupted = 0, False
    try:
        main()
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException as exc:  # noqa: BLE001 - the interpreter's way: printed, then 1 or SIGINT
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
        try:
            rank_main.print_uncaught(exc)  # the script's: rank_main's quiet hook prints nothing
        except SystemExit as hook_exit:  # sys.excepthook called sys.exit(): its status
            code, interrupted = _exit_status(hook_exit), False
        except BaseException as err:  # noqa: BLE001 - printing failed (the script's sys.stderr)
            rank_main.print_ignored("sys.excepthook", err)  # said; the exit goes on
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException as err:  # noqa: BLE001 - as the interpreter's wait_for_thread_shutdown: said
        # a Ctrl-C while the script's threads are joined, or their own error: the exit goes on
        rank_main.print_ignored(rank_main.text_of(threading, as_repr=True), err)
    import atexit

    atexit._run_exitfuncs()
    if not rank_main.flush_std_streams():
        code = 120  # the interpreter's status for a failed flush at exit, whatever the script's
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def _exit_status(exc: SystemExit) -> int:
    """The status the interpreter exits with for ``sys.exit(code)`` (pythonrun.c's
    ``_Py_HandleSystemExit``): 0 for None, an int as it is, anything else 1, printed on
    stderr first (fd 2 when sys.stderr is None). A code that cannot be printed (its __str__,
    or the script's sys.stderr, raises) is said in the interpreter's words for an error it
    goes on past, where the interpreter itself says nothing."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    if sys.stderr is None:
        rank_main.say(rank_main.text_of(exc.code) + "\n")
        return 1
    try:
        print(exc.code, file=sys.stderr)
    except BaseException as err:  # noqa: BLE001 - the code's __str__, sys.stderr: said; exit goes on
        rank_main.print_ignored(rank_main.text_of(exc.code, as_repr=True), err)
    return 1
