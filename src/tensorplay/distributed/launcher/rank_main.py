"""What tensorplay-run starts in each rank: the user's script, plus two promises to the launcher.

``python -c LOADER --file train.py --lr 0.1`` (or ``--module mypkg.train ...``), where LOADER
loads this file by path (no package import, so a rank starts as fast as before) and calls
``main()``. The script then runs as ``python train.py --lr 0.1`` would run it: the same
``sys.argv``, ``sys.path[0]``, ``__main__`` module (the interpreter's own, with ``__file__``,
``__loader__``, ``__spec__``), the same traceback on stderr and the same exit code. ``-m``
goes through ``runpy._run_module_as_main``, the function ``python -m`` itself calls.

Before the script, on Linux, the rank takes the command line and name the launcher gave it
(``TENSORPLAY_RUN_TITLE``, ``TENSORPLAY_RUN_COMM``), so ``ps -o pid,comm,args`` shows::

    4250 rank 5   tensorplay-run rank 5/8: python train.py --lr 0.1

whether it was started by Popen (its command line was the loader's) or forked from the warm
process (it was the warm process's); see ``name_this_process``.

The two promises, both standard library only:

1. **Die with the launcher.** On Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills
   this rank when the launcher dies, even by SIGKILL. A launcher that died before the call is
   caught by comparing ``getppid()`` with the launcher's pid. Elsewhere a daemon thread polls
   ``getppid()`` once a second.
2. **Say how the script ended**, over a pipe the launcher passed (``TENSORPLAY_RUN_REPORT_FD``):
   one JSON line, written before the interpreter prints or exits, so the launcher tells "raised
   ValueError at 12.3 s" from "returned, then died at exit" without guessing from text::

       {"event": "returned", "t": 12.3}
       {"event": "exit", "t": 12.3, "code": 3, "what": null}        # sys.exit(3)
       {"event": "raised", "t": 12.3, "code": 1, "what": "ValueError: bad lr",
        "first": "Traceback (most recent call last):"}

   ``t`` is ``time.monotonic()``, the clock the launcher reads too (one machine); ``first`` is
   the first line of the traceback about to be printed, where the launcher starts holding the
   block back to print identical ones once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REPORT_FD = "TENSORPLAY_RUN_REPORT_FD"
BEAT_S = "TENSORPLAY_RUN_BEAT_S"  # set: send a beat this often (--hang-timeout-s)
PARENT_PID = "TENSORPLAY_RUN_PARENT_PID"
TITLE = "TENSORPLAY_RUN_TITLE"  # set (Linux): the rank's command line for ps (name_this_process)
COMM = "TENSORPLAY_RUN_COMM"  # and its name ("rank 5"), set with TITLE
RUN_NOTES = "TENSORPLAY_RUN_NOTES"  # "<pid>:<fd>": the report pipe (host/wire.py: tell_launcher)
WHAT_CHARS = 1000  # a report's one-line "Type: message" is cut here (one pipe write)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_SET_NAME = 15


def loader_command() -> str:
    """The ``python -c`` program that loads this file and runs ``main()``; it binds no name in
    __main__ and imports only importlib.util (no package, no runpy), so a rank starts fast."""
    return ("(lambda util: (lambda spec: (lambda mod: spec.loader.exec_module(mod) or mod.main())"
            "(util.module_from_spec(spec)))(util.spec_from_file_location("
            f"'tensorplay_rank_main', {__file__!r})))(__import__('importlib.util').util)")


COMM_PREFIX = "rank "  # /proc/<pid>/comm of a rank tensorplay-run starts: "rank 5"
TITLE_PAGE = 4096  # the kernel shows a changed command line up to its first NUL, in one page


def name_this_process(title: str, comm: str) -> None:
    """Show ``title`` as this process's command line and ``comm`` as its name (Linux): what
    ``ps -o args`` and ``/proc/<pid>/cmdline`` show, and ``ps -o comm``, ``top``.

    A process's command line is the memory range [arg_start, arg_end) of its own address
    space (``/proc/self/stat`` fields 48-49; a forked one has its parent's copy): the argument
    strings it was exec'd with, which the interpreter has copied and never reads again (C's
    ``program_invocation_name`` points there and reads the title). The title is written over
    them through ``/proc/self/mem``, NUL-terminated, and the rest of the range is filled with
    spaces, so that its last byte is not a NUL: the kernel then reads the command line as one
    string up to the first NUL (the title alone, as one argument), where with NULs to the end
    it would hand out the whole range, and with no NUL in it at all it would read on into the
    environment. The title must fit the range: a rank started by Popen has its ``-c`` loader
    there (some 300 bytes more than its title needs), the warm process pads its command line
    to TITLE_PAGE bytes (``warm.Warm.start``). A longer title is cut at the range's length
    less one, at most TITLE_PAGE - 1 = 4095 bytes, its last three bytes "..." (a range of
    4096 bytes and a 5000-byte title: 4092 bytes of it, then "..."). ``comm`` is set first,
    with ``prctl(PR_SET_NAME)``: 15 bytes at most ("rank 12345" is 10), the rest cut.

    Raises OSError when it cannot be done (no /proc, the range not shown, a short write).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NAME, os.fsencode(comm)[:15], 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")
    with open("/proc/self/stat", "rb") as f:  # not _procfs: this file imports no package
        fields = f.read().rsplit(b")", 1)[1].split()  # fields from the 3rd (the state) on
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48, 49
    if not 0 < start < end:
        raise OSError(f"/proc/self/stat shows no command-line range ({start}, {end})")
    area = end - start
    text = os.fsencode(title)
    room = min(area, TITLE_PAGE) - 1
    if len(text) > room:
        cut = room - 3
        while cut > 0 and text[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
            cut -= 1
        text = text[:cut] + b"..."
    data = text + b"\0" + b" " * (area - len(text) - 1)
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        wrote = mem.write(data)
    if wrote != len(data):
        raise OSError(f"wrote {wrote} of the title's {len(data)} bytes to /proc/self/mem")


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the launcher dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        import threading

        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="tensorplay-run parent watch").start()
    if os.getppid() != parent_pid:  # it died before the call above: nobody will signal us
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent_pid: int) -> None:
    """Where there is no parent-death signal: poll, and die once the launcher is gone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def text_of(obj: object, as_repr: bool = False) -> str:
    """``str(obj)`` (``repr`` with ``as_repr``), or what it raised instead: '<str() failed:
    RuntimeError>'. Such an object is the script's (an exception's message, sys.exit's
    argument, a stream it put in sys.stdout), so its method may raise anything; the text
    names what, as the interpreter's traceback shows '<exception str() failed>' there, and
    the failure being described is still said."""
    try:
        return repr(obj) if as_repr else str(obj)
    except Exception as err:  # noqa: BLE001 - the script's code: what it raised is in the text
        return f"<{'repr' if as_repr else 'str'}() failed: {type(err).__qualname__}>"


def one_line(exc: BaseException) -> str:
    """'Type: message' on one line: the message's lines joined, cut to WHAT_CHARS (a message
    that cannot be made: ``text_of``'s '<str() failed: RuntimeError>')."""
    message = text_of(exc)
    text = type(exc).__qualname__
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if lines:
        joined = lines[0]
        for line in lines[1:]:
            joined += (" " if joined.endswith((":", ";")) else "; ") + line
        text += f": {joined}"
    return text if len(text) <= WHAT_CHARS else text[:WHAT_CHARS - 3] + "..."


def _beat(report: Reporter, every_s: float, main_ident: int | None) -> None:
    """Daemon thread: every ``every_s``, tell the launcher for how long the main thread has
    been at the same place (same frame object, same bytecode offset) and where that is."""
    here, since = None, time.monotonic()
    while report.fd is not None:
        time.sleep(every_s)
        frame = sys._current_frames().get(main_ident) if main_ident is not None else None
        now = time.monotonic()
        # a frame object's id can be reused by the next call at the same place, so the count
        # of collectives made also says the thread moved (a loop of steps always calls one)
        place = (None if frame is None else (id(frame), frame.f_code, frame.f_lasti),
                 _collectives_made())
        if place != here:
            here, since = place, now
        where = "" if frame is None else _where(frame)
        del frame
        report.send("beat", still=round(now - since, 3), where=where)


def _collectives_made() -> int:
    """How many collectives this process made in its current world (0 without one): read
    from the package if the script loaded it, never importing it.

    Read on the beat thread while the main thread makes, swaps or tears down the world, and
    nothing of it can fail there: ``world.registry`` is a field set at the world's making
    (``open_epoch`` swaps it whole), ``groups()`` copies the registry's dict in one C call
    that no other thread's bytecode interleaves (under the GIL, and under the dict's lock
    in a free-threaded build), so ``release``'s ``clear()`` leaves it the groups or none,
    and each group's ``calls`` is an int set in its ``__init__``. A world torn down counts
    0 (its registry released), a change like any other."""
    world = getattr(sys.modules.get("tensorplay.distributed.job.lifecycle"), "_WORLD", None)
    return sum(g.calls for g in world.registry.groups()) if world is not None else 0


def _where(frame) -> str:
    """'threading.py:327 in wait(), from /job/train.py:40 in step()': the innermost frame,
    and the innermost one of the script's own file when that is another."""
    def at(f) -> str:
        return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}()"

    script = getattr(sys.modules.get("__main__"), "__file__", None)
    text, f = at(frame), frame
    while f is not None and f.f_code.co_filename != script:
        f = f.f_back
    if f is not None and f is not frame:
        text += f", from {at(f)}"
    return text


class Reporter:
    """Writes the report lines to the launcher's pipe; silent without one (or once it is gone)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, event: str, **fields: object) -> None:
        if self.fd is None:
            return
        import json

        line = json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n"
        try:
            os.write(self.fd, line.encode())  # < PIPE_BUF (4 KiB): one atomic write
        except OSError:  # the launcher is gone; the parent-death signal ends us
            self.fd = None

    def exited(self, exc: SystemExit) -> None:
        """sys.exit(code): a code of None or 0 is success, an int its own code, anything else 1
        (printed), as the interpreter does."""
        code = exc.code
        if code is None or code == 0:
            self.send("returned")
        elif isinstance(code, int):
            self.send("exit", code=code, what=None)
        else:
            self.send("exit", code=1, what=text_of(code)[:WHAT_CHARS])

    def raised(self, exc: BaseException, first: str | None) -> None:
        self.send("raised", code=1, what=one_line(exc), first=first)


def _trim(tb, ours: set[str]):
    """The traceback without the frames of this file and of the ``python -c`` loader."""
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def print_uncaught(exc: BaseException) -> None:
    """Print exc as the interpreter prints an uncaught exception: through sys.excepthook, and
    where the hook itself fails, as CPython's ``_PyErr_PrintEx`` does: a SystemExit it raises
    ends the process with its code (raised here), anything else is printed after "Error in
    sys.excepthook:", then the original after "Original exception was:"."""
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except SystemExit:  # the hook's sys.exit(): the interpreter exits with its code
        raise
    except BaseException as hook_error:  # noqa: BLE001 - the script's hook: both printed, as CPython
        # as the interpreter shows it: from the hook's own frame, and not as raised while
        # handling exc (the interpreter calls the hook with no exception being handled)
        hook_error.__traceback__ = _trim(hook_error.__traceback__, {__file__})
        if hook_error.__context__ is exc:
            hook_error.__context__ = None
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, exc.__traceback__)


def say(text: str) -> None:
    """Write ``text`` on fd 2, whole: how this file and the warm process report an error they
    go on past as a rank starts or exits, where ``sys.stderr`` may be what failed (closed,
    replaced by the script, its buffer stuck). Nothing is said when fd 2 itself is gone: there
    is nowhere left to say it, and the exit status says the rest."""
    data = text.encode(errors="backslashreplace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:  # fd 2 closed, or its reader gone: nowhere left to say anything
        pass


def print_ignored(where: str, err: BaseException) -> None:
    """Report an error the process goes on past as it exits, in the words the interpreter
    uses for one (``sys.unraisablehook``'s default, which CPython writes in C): "Exception
    ignored in: <where>", the traceback from the call that failed (the frame that made the
    call left out: the interpreter makes it from C), then "module.Type: message", with the
    ": " even for an empty message and no chained exceptions. On fd 2 (``say``)."""
    import traceback

    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    shown = "".join(["Traceback (most recent call last):\n", *traceback.format_tb(tb)]
                    ) if tb is not None else ""
    name, module = type(err).__qualname__, type(err).__module__
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    say(f"Exception ignored in: {where}\n{shown}{name}: {text_of(err)}\n")


def flush_std_streams() -> bool:
    """Flush sys.stdout, then sys.stderr, as the interpreter does as it exits (CPython's
    ``flush_std_files``): a stream that is None or closed is left alone, and one whose flush
    fails is reported (``print_ignored``: the interpreter's words for stdout, and for stderr,
    which the interpreter leaves unsaid, the same words on fd 2). Returns False when one
    failed: the interpreter's exit status is then 120, whatever the script's was."""
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            # a stream of the script's own may have no ``closed``: flushed, as the interpreter does
            if not getattr(stream, "closed", False):
                stream.flush()
        except BaseException as err:  # noqa: BLE001 - the exit must go on (os._exit): said, 120
            # a stream the script put there may raise anything, as the interpreter allows
            print_ignored(text_of(stream, as_repr=True), err)
            flushed = False
    return flushed


def _peer_lost(exc: BaseException) -> bool:
    """Whether the script died of one of our errors that follow a lost peer (RankFailedError,
    DistributedTimeoutError; an elastic mesh's ShrinkError, StaleEpochError): the process's
    groups hold connections to a peer that is gone or silent."""
    return (type(exc).__module__ == "tensorplay.distributed.errors"
            and type(exc).__name__ in ("RankFailedError", "DistributedTimeoutError",
                                       "ShrinkError", "StaleEpochError"))


def _exit_skipping_teardown(code: int) -> None:
    """Run the atexit handlers and flush, as the interpreter does at exit (a failed flush: said,
    and status 120, as the interpreter's), then leave without tearing down the modules:
    destroying a gloo group whose peer is frozen or gone can end in C++'s "terminate called
    without an active exception" (SIGABRT), after the error was said."""
    import atexit

    atexit._run_exitfuncs()
    os._exit(code if flush_std_streams() else 120)


def _stdout_to_stderr() -> None:
    """After the traceback, send what the rank still prints (an atexit handler's words) to
    stderr: the launcher holds a traceback from its first line on, but reads stdout and stderr
    on two threads, so a stdout line written after the traceback could reach the terminal
    before it (seen once in a full test run on 2 busy cores). One pipe keeps the order.

    It is fd 1 that is pointed at fd 2's pipe, whatever the script put in sys.stdout (a log
    file of its own stays its own). What a closed stream or a failed write raises (io: ValueError
    for an operation on a closed stream, OSError for the system call's) is left to the flush
    at exit, which skips a closed stream and tries the text held back again, now into fd 2's
    pipe, saying its error if it fails again (status 120); any other error is the script's
    own stream's, raised."""
    import contextlib

    if sys.stdout is not None:
        with contextlib.suppress(OSError, ValueError):  # said at exit, by the flush there
            sys.stdout.flush()
    with contextlib.suppress(OSError):  # fd 1 or 2 closed by the script: no order to keep
        os.dup2(2, 1)


def _quiet_excepthook(*_args: object) -> None:
    """Installed after the script's exception was printed once: the interpreter's own report
    of the same exception, as it leaves, prints nothing more."""


def _run_file(path: str) -> None:
    """Run a script file in the interpreter's __main__ module, as ``python path`` does."""
    from importlib.machinery import SourceFileLoader

    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # not normalised
    try:
        with open(filename, "rb") as f:
            source = f.read()
    except OSError as err:  # the interpreter's own words and status
        print(f"{sys.executable}: can't open file {filename!r}: [Errno {err.errno}] "
              f"{err.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    main = sys.modules["__main__"]  # the loader bound no name in it
    main.__file__ = filename
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = SourceFileLoader("__main__", filename)
    exec(compile(source, filename, "exec", dont_inherit=True), vars(main))


def _set_path0(entry: str) -> None:
    """Put sys.path[0] where the interpreter would (the loader's '' is there now)."""
    if sys.version_info >= (3, 11) and sys.flags.safe_path:
        return  # -P / PYTHONSAFEPATH: the interpreter adds no entry
    if sys.path and sys.path[0] == "":
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def main() -> None:
    """Entry point in the rank: ``--file PATH ARGS...`` or ``--module NAME ARGS...``."""
    fd = os.environ.pop(REPORT_FD, None)
    parent = os.environ.pop(PARENT_PID, None)
    title, comm = os.environ.pop(TITLE, None), os.environ.pop(COMM, None)
    if title is not None and comm is not None:
        try:
            name_this_process(title, comm)
        except OSError as err:  # said, and the script runs: only ps shows less
            print(f"tensorplay-run: this rank's process title was not set ({one_line(err)}); "
                  f"ps shows the command line it was started with.", file=sys.stderr)
    if parent is not None:
        die_with_parent(int(parent))
    if fd is not None:
        os.set_inheritable(int(fd), False)  # the script's own subprocesses never hold it
        os.environ[RUN_NOTES] = f"{os.getpid()}:{fd}"  # how host/wire.py's tell_launcher finds it
    report = Reporter(None if fd is None else int(fd))
    beat_s = os.environ.pop(BEAT_S, None)
    if beat_s is not None and fd is not None:
        import threading

        threading.Thread(target=_beat, args=(report, float(beat_s), threading.get_ident()),
                         daemon=True, name="tensorplay-run beat").start()
    kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    ours = {__file__, "<string>"}
    try:
        if kind == "--module":
            import runpy

            sys.argv = ["-m", *args]  # _run_module_as_main sets argv[0] to the module's file
            _set_path0(os.getcwd())
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = [target, *args]
            _set_path0(os.path.dirname(os.path.realpath(target)))
            _run_file(target)
    except SystemExit as exc:
        report.exited(exc)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, printed, then re-raised
        import traceback

        exc.__traceback__ = _trim(exc.__traceback__, ours)
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        first = "".join(lines).splitlines()[0] if lines else None
        report.raised(exc, first)
        print_uncaught(exc)  # a hook's sys.exit() leaves here, with its code
        _stdout_to_stderr()
        if _peer_lost(exc):
            _exit_skipping_teardown(1)
        sys.excepthook = _quiet_excepthook
        raise  # the interpreter exits as for any uncaught exception (1, or SIGINT)
    report.send("returned")
