"""Where the ranks' output goes: the terminal (labelled, filtered), log files, tail buffers.

Each rank has two reader threads (``pump_stdout``, ``pump_stderr``) that hand its lines to the
one ``Output``; the stderr reader also reads the rank's report pipe, in the order the rank
wrote them, and hands on what it said as events (``events.from_report_line``). Worked
example: rank 3 prints "step 1" and torch's excepthook prints "[rank3]: Traceback ...";
the terminal shows::

    [rank 3] step 1
    [rank 3] Traceback (most recent call last):      <- held back, printed once at the end,
                                                        labelled "[ranks 0-7] " if all alike
"""

from __future__ import annotations

import os
import selectors
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from contextlib import suppress
from pathlib import Path
from typing import IO

from ..errors import bad_argument, rank_words
from .events import Beat, Recovered, Report, from_report_line
from .options import PROG
from .rank_ends import blank_varying

TAIL_LINES = 50


def _write(stream: IO[str], data: bytes) -> None:
    """Write raw bytes to a text stream (through its buffer when it has one) and flush."""
    buf = getattr(stream, "buffer", None)
    if buf is None:
        stream.write(data.decode("utf-8", errors="replace"))
    else:
        stream.flush()
        buf.write(data)
        buf.flush()
    stream.flush()


def untag(rank: int, data: bytes) -> bytes:
    """data without torch's own rank tag ('[rank3]: ', which init_process_group's excepthook and
    c10d's C++ log put on a rank's lines), so that '[rank 3] ' is not said twice."""
    tag = b"[rank%d]:" % rank
    if not data.startswith(tag):
        return data
    data = data[len(tag):]
    return data[1:] if data.startswith(b" ") else data


def label(ranks: list[int]) -> bytes:
    """The prefix of lines that came from these ranks: b'[rank 3] ' or b'[ranks 0-7] '."""
    return b"[%s] " % rank_words(ranks).encode()


class Output:
    """Route children's lines to the terminal (prefixed, filtered), log files and tail buffers.

    A rank's final traceback (its first line is announced by the rank's report, see
    ``expect``) is held back from the terminal from that line on; ``show_held`` prints each
    distinct one once, labelled with every rank that printed it. Log files get every line.
    """

    def __init__(self, shown: AbstractSet[int] | None, log_dir: str | None, ranks: Iterable[int]):
        self.shown = shown
        self.lock = threading.Lock()
        # rank -> (stdout tail, stderr tail): one per stream, as the two readers do not run in
        # step (60 stdout lines then one stderr line may be read stderr first; a shared 50-line
        # buffer would then drop the stderr line, the one that says what went wrong)
        self.tails: dict[int, tuple[deque[bytes], deque[bytes]]] = {
            r: (deque(maxlen=TAIL_LINES), deque(maxlen=TAIL_LINES)) for r in ranks}
        self.files: dict[int, IO[bytes]] = {}
        self.first: dict[int, bytes] = {}  # rank -> first line of the traceback it will print
        self.held: dict[int, list[bytes]] = {}  # rank -> that traceback's lines so far
        if log_dir is not None:
            self._open_logs(Path(log_dir))

    def _open_logs(self, log_dir: Path) -> None:
        """Create log_dir and one rank_<r>.log per rank; an unusable directory is a usage error."""
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            for r in self.tails:
                self.files[r] = open(log_dir / f"rank_{r}.log", "wb")  # noqa: SIM115 (kept open)
        except OSError as exc:
            self.close()
            raise bad_argument("--log-dir", str(log_dir), f"cannot write there ({exc.strerror})",
                               "pass a directory you can create and write to") from None

    def expect(self, rank: int, first_line: str) -> None:
        """The rank's script raised; its traceback, about to be printed, starts with this line."""
        with self.lock:
            self.first[rank] = first_line.encode("utf-8", errors="replace")

    def line(self, rank: int, to_stderr: bool, data: bytes) -> None:
        """Record one child line; a partial last line gets its newline here."""
        data = data if data.endswith(b"\n") else data + b"\n"
        text = untag(rank, data)
        with self.lock:
            if rank in self.files:
                self.files[rank].write(data)
                self.files[rank].flush()
            if rank in self.held:
                self.held[rank].append(text)
                return
            if to_stderr and rank in self.first and text.rstrip(b"\r\n") == self.first[rank]:
                self.held[rank] = [text]
                return
            self.tails[rank][to_stderr].append(text)
            if self.shown is None or rank in self.shown:
                _write(sys.stderr if to_stderr else sys.stdout, label([rank]) + text)

    def say(self, text: str) -> None:
        """Print one launcher message on stderr."""
        with self.lock:
            _write(sys.stderr, f"{PROG}: {text}\n".encode())

    def show_tail(self, rank: int) -> None:
        """Show a failed rank's last lines if the filter hid them (its traceback comes apart):
        up to TAIL_LINES of its stdout, then up to TAIL_LINES of its stderr."""
        out, err = self.tails[rank]
        if self.shown is None or rank in self.shown or not (out or err):
            return
        self.say(f"last lines of rank {rank} (hidden by --log-ranks): {len(out)} of its stdout, "
                 f"then {len(err)} of its stderr:")
        with self.lock:
            _write(sys.stderr, b"".join(label([rank]) + d for d in [*out, *err]))

    def show_held(self, order: list[int], also: Iterable[int] = ()) -> None:
        """Print the held tracebacks, each distinct one once (pids and addresses may differ),
        in the order of their first rank in ``order``; a block is shown when one of its ranks
        is shown (or is in ``also``)."""
        with self.lock:
            held = {r: b"".join(lines) for r, lines in self.held.items()}
        blocks: dict[str, list[int]] = {}
        for r in [*order, *sorted(set(held) - set(order))]:
            if r in held:
                blocks.setdefault(blank_varying(held[r].decode("utf-8", "replace")), []).append(r)
        visible = None if self.shown is None else self.shown | set(also)
        for ranks in blocks.values():
            if visible is None or visible & set(ranks):
                prefix = label(ranks)
                with self.lock:
                    _write(sys.stderr, b"".join(prefix + line for line in
                                                held[ranks[0]].splitlines(keepends=True)))

    def close(self) -> None:
        """Close the log files (readers still running just stop writing to them)."""
        with self.lock:
            for f in self.files.values():
                f.close()
            self.files = {}



def pump_stdout(pipe: IO[bytes], rank: int, out: Output) -> None:
    """Reader thread: forward a child's stdout line by line until it closes."""
    with pipe:
        for data in iter(pipe.readline, b""):
            out.line(rank, False, data)


def pump_stderr(pipe: IO[bytes], report_fd: int, rank: int, out: Output,
                on_event: Callable[[Report | Beat | Recovered], None]) -> None:
    """Reader thread: a child's stderr and its report pipe, in the order they were written.

    The rank writes its report before it prints its traceback. So after each read of stderr the
    report pipe is drained before those stderr lines are handled: a report written before them
    is always seen first, and the traceback is held from its first line.
    """
    sel = selectors.DefaultSelector()
    err_fd = pipe.fileno()
    os.set_blocking(report_fd, False)
    sel.register(err_fd, selectors.EVENT_READ)
    sel.register(report_fd, selectors.EVENT_READ)
    partial, pending = b"", b""

    def drain_reports() -> None:
        nonlocal pending
        while report_fd in sel.get_map():
            try:
                chunk = os.read(report_fd, 4096)
            except BlockingIOError:
                return
            if not chunk:
                sel.unregister(report_fd)
                return
            *done, pending = (pending + chunk).split(b"\n")
            for raw in done:
                with suppress(ValueError):
                    on_event(from_report_line(rank, raw))

    try:
        while sel.get_map():
            for key, _ in sel.select():
                if key.fd != err_fd:
                    drain_reports()
                    continue
                chunk = os.read(err_fd, 65536)
                drain_reports()
                if not chunk:
                    sel.unregister(err_fd)
                    if partial:
                        out.line(rank, True, partial)
                    continue
                *lines, partial = (partial + chunk).split(b"\n")
                for data in lines:
                    out.line(rank, True, data + b"\n")
    finally:
        sel.close()
        pipe.close()
        os.close(report_fd)
