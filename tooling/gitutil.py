"""Helpers for git that more than one stage uses: what a failed git command said, and each
git command in the log.

No stage owns these: fetching reads git remotes, patching makes work trees, building reads
their commits, and each says what git complained about in the same words. Git runs through
GitPython, not ``tooling.procs``; :func:`git_commands_logged` puts each command it starts in
the same log, in the words ``tooling.procs`` uses for a child.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .procs import shown

if TYPE_CHECKING:  # for types only: the helpers read errors GitPython already raised
    import git

logger = logging.getLogger(__name__)

#: GitPython's logger: a DEBUG line ``Popen(COMMAND, cwd=CWD, ...)`` for each git it starts.
GITPYTHON_LOG = "git.cmd"


class GitCommands(logging.Handler):
    """GitPython's line for each git it starts, said again under ``tooling.gitutil`` as
    ``start git ARGS (in CWD)``: one format for every child, whichever started it. Its other
    lines (errors it ignored while stopping a git) are GitPython's own and stay out, as they
    did before."""

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if not (str(record.msg).startswith("Popen(") and isinstance(args, tuple) and args):
            return
        if not logger.isEnabledFor(logging.DEBUG):  # without -v or --log-file: nothing to say
            return
        command, cwd = args[0], args[1] if len(args) > 1 else None
        if isinstance(command, (list, tuple)):
            logger.debug("start %s (in %s)", shown([str(a) for a in command]), cwd)


@contextlib.contextmanager
def git_commands_logged() -> Iterator[None]:
    """For one run: each git command GitPython starts, in this package's log at DEBUG (so
    ``-v`` and ``--log-file`` show it); GitPython's logger is as it was afterwards."""
    source = logging.getLogger(GITPYTHON_LOG)
    handler, level = GitCommands(logging.DEBUG), source.level
    source.addHandler(handler)
    # GitPython's logger below DEBUG: its Popen line is made only when asked for.
    source.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(level)


def git_error_lines(error: git.GitCommandError) -> list[str]:
    """git's own complaint, without GitPython's quoting around it."""
    text = str(error.stderr or error).strip()
    text = re.sub(r"^stderr: '", "", text).rstrip("'")
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def git_error_summary(error: git.GitCommandError) -> str:
    """The line of git's complaint that names the problem (not its hints)."""
    lines = git_error_lines(error)
    for prefix in ("CONFLICT", "fatal:", "error:"):
        hits = [ln for ln in lines if ln.startswith(prefix)]
        if hits:
            return hits[0]
    if isinstance(error.status, int) and error.status < 0 and not error.stderr:
        # Killed before it could complain: a write past the file size limit is SIGXFSZ.
        sig = signal.Signals(-error.status)
        return f"git {error.command[1]} was killed by {sig.name} ({signal.strsignal(sig)})"
    return lines[-1] if lines else "git failed"
