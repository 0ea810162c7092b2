"""A process recorded by its pid and its start time, so that a pid the kernel later hands to
another process is not taken for it (the GPU host's ``hybrid-session.sh`` records its
background session so, and asks whether that session still runs).

    python -m tooling.pidfile record FILE PID   record PID's process in FILE
    python -m tooling.pidfile check FILE        exit 0 (and print the pid) while it runs,
                                                1 once it has ended, 2 with no record
Standard library only: the GPU host's python3 runs it without the toolchain's
dependencies.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .entry import answer, entry_logging

logger = logging.getLogger(__name__)


class NoRecord(Exception):
    """The file holds no record (missing, or not one this module wrote)."""


def start_time(pid: int) -> str | None:
    """When ``pid``'s process started, in clock ticks since boot (``/proc/PID/stat`` field
    22); None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def record(path: Path, pid: int) -> None:
    started = start_time(pid)
    if started is None:
        raise NoRecord(f"no process {pid} runs to record")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        tmp.write_text(f"{pid} {started}\n", encoding="ascii")
        os.replace(tmp, path)
    except BaseException:
        # Named before it was made: a signal at any instant leaves no half-written record.
        tmp.unlink(missing_ok=True)
        raise


def running(path: Path) -> int | None:
    """The recorded pid while that very process runs; None once it has ended (its pid gone,
    or now another process's)."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise NoRecord(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    words = text.split()
    if len(words) != 2 or not all(w.isdigit() and len(w) <= 20 for w in words):
        # A bare pid (an older record) cannot tell its process from a later one's.
        raise NoRecord(f"{path}: not a record of a process (pid and start time): {text[:40]!r}")
    pid = int(words[0])
    return pid if 0 < pid < 1 << 22 and start_time(pid) == words[1] else None


def main(argv: list[str]) -> int:
    with entry_logging():
        return _main(argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.pidfile")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("file", type=Path)
    rec.add_argument("pid", type=int)
    chk = sub.add_parser("check")
    chk.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "record":
            record(args.file, args.pid)
            logger.debug("recorded process %d in %s", args.pid, args.file)
            return 0
        pid = running(args.file)
    except NoRecord as e:
        logger.error("error: %s", e)
        return 2
    if pid is None:
        logger.debug("the process %s recorded has ended", args.file)
        return 1
    answer(str(pid))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
