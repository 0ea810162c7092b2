"""How the program speaks, outside the command line's results: the package's log lines on
stderr for one run, and the answer of an internal entry point on stdout.

The command line (``tooling.cli``) and the internal entry points (``python -m tooling.X``,
run by the Makefile, the GPU host's scripts and the tests: ``docs/design/overview.md`` lists
them) log the same way, so a failure reads ``error: ...`` on stderr from either. An entry's
stdout is what its caller reads (a pid, a folder, a table), written by :func:`answer` alone.

Standard library only: the GPU host's python3 runs some entries without the toolchain's
dependencies.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

#: The logger every module's ``logging.getLogger(__name__)`` sits under.
PACKAGE_LOG = logging.getLogger("tooling")


class Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Lines on ``sys.stderr`` as it is at each line, not as it was when the handler was made
    (a test's capture swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


@contextlib.contextmanager
def package_logging(handler: logging.Handler) -> Iterator[None]:
    """The package's log lines, INFO and above, through ``handler`` (bare: the text as it was
    printed before there was logging), for one run; the handlers this run added are closed and
    removed when it ends, and the level is as it was."""
    before = PACKAGE_LOG.handlers[:], PACKAGE_LOG.level
    PACKAGE_LOG.addHandler(handler)
    PACKAGE_LOG.setLevel(logging.INFO)
    try:
        yield
    finally:
        for added in PACKAGE_LOG.handlers[:]:
            if added not in before[0]:
                PACKAGE_LOG.removeHandler(added)
                added.close()
        PACKAGE_LOG.setLevel(before[1])


@contextlib.contextmanager
def entry_logging() -> Iterator[None]:
    """An internal entry's run: its ``error: ...`` (and its own or any stage's INFO line) on
    stderr."""
    handler = Stderr()
    handler.setLevel(logging.INFO)
    # Run as ``python -m tooling.X``, the entry's module is ``__main__``: its own logger sits
    # outside the package's, and its INFO lines (a child's progress in its log) went nowhere.
    main = logging.getLogger("__main__")
    level = main.level
    main.addHandler(handler)
    main.setLevel(logging.INFO)
    try:
        with package_logging(handler):
            yield
    finally:
        main.removeHandler(handler)
        main.setLevel(level)


def answer(text: str) -> None:
    """An internal entry's answer, the one thing on its stdout: its caller reads it."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()
