"""Where a benchmark's results go: bench/results/<script>.md and bench/results/<script>.json.

Every benchmark script records what it prints::

    parser = argparse.ArgumentParser(...)
    add_out(parser, __file__)              # --out, default bench/results/<script>.json
    opts = parser.parse_args()
    with recorded(__file__, opts.out):
        ...                                # print the tables and the goal block as before

On a run that ends normally, ``recorded`` writes two files (the folder is made if needed):

- ``<out>.md``: the machine facts, then everything the script printed on stdout (its tables
  and its goal block), as markdown; what bench/README.md's "latest" tables are copied from;
- ``<out>.json``: the same facts as fields (script, command, date, cores, load average at the
  start and the end, Python, torch and mpi4py versions, platform, commit, wall time), the
  markdown tables parsed into columns and rows (each with the heading above it), the goal
  block's lines, and the whole printed text.

A run that is interrupted or fails writes nothing, so the files keep the last complete run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from _common import tree_state

RESULTS = Path(__file__).resolve().parent / "results"


def _name(script_file: str) -> str:
    return Path(script_file).stem


def add_out(parser: argparse.ArgumentParser, script_file: str) -> None:
    """Give ``parser`` the --out option: the results file, bench/results/<script>.json by
    default (the .md goes next to it, same name)."""
    default = RESULTS / f"{_name(script_file)}.json"
    parser.add_argument("--out", type=Path, default=default,
                        help=f"where to write the results: this .json and a .md next to it "
                             f"(default {default.relative_to(RESULTS.parent.parent)})")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict:
    """What every figure needs next to it: the machine, its load, the software, the tree."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "platform": platform.platform(),
        "tree": tree_state(),
    }


def parse_tables(text: str) -> list[dict]:
    """The markdown tables in ``text``: each as its heading (the nearest line above it that
    starts with '#', or ''), its columns and its rows of cells (strings, as printed)."""
    tables: list[dict] = []
    heading, current = "", None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            heading, current = stripped.lstrip("#").strip(), None
            continue
        if not stripped.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if current is None:
            current = {"heading": heading, "columns": cells, "rows": []}
            tables.append(current)
        elif not all(set(c) <= set("-:") and c for c in cells):  # not the |---|---:| line
            current["rows"].append(cells)
    return tables


def goal_lines(text: str) -> list[str]:
    """The goal block: from the first line starting with 'Goal:' to 'Goal met: ...' (or to
    the first blank line, where the goal was not evaluated)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Goal:")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines))
                if lines[i].startswith("Goal met:") or not lines[i].strip()), len(lines))
    return lines[start:end + (end < len(lines) and lines[end].startswith("Goal met:"))]


class _Tee(io.TextIOBase):
    """Writes go to the real stdout and are kept."""

    def __init__(self, real) -> None:
        self.real, self.kept = real, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()


def write(script_file: str, out: Path, facts: dict, text: str, command: list[str]) -> None:
    """Write ``<out>.json`` and ``<out>.md`` from the printed ``text`` and the ``facts``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"script": f"bench/{_name(script_file)}.py", "command": " ".join(command),
              **facts, "tables": parse_tables(text), "goal": goal_lines(text), "report": text}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    load = ", ".join(f"{x:.1f}" for x in facts["load_average_start"])
    end = ", ".join(f"{x:.1f}" for x in facts["load_average_end"])
    header = (f"<!-- written by {record['script']} ({Path(__file__).name}); "
              f"rerun the command to replace it -->\n\n"
              f"`{record['command']}`, {facts['date']}, {facts['tree']}: {facts['cores']} cores, "
              f"load average {load} at the start and {end} at the end (1, 5, 15 min); "
              f"Python {facts['python']}, torch {facts['torch'] or '-'}, "
              f"mpi4py {facts['mpi4py'] or '-'}; wall time {facts['wall_s']:.0f} s.\n\n")
    out.with_suffix(".md").write_text(header + text.strip() + "\n")


@contextlib.contextmanager
def recorded(script_file: str, out: Path) -> Iterator[None]:
    """Keep what the block prints on stdout and, when it ends normally, write the results."""
    facts, began = machine_facts(), time.monotonic()
    command = ["python", f"bench/{_name(script_file)}.py", *sys.argv[1:]]
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    facts["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    facts["wall_s"] = round(time.monotonic() - began, 1)
    write(script_file, out, facts, tee.kept.getvalue(), command)
    print(f"results: {Path(out).with_suffix('.json')} and .md", file=sys.stderr)
