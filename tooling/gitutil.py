"""Helpers for git that more than one stage uses: what a failed git command said.

No stage owns these: fetching reads git remotes, patching makes work trees, building reads
their commits, and each says what git complained about in the same words.
"""

from __future__ import annotations

import re
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for types only: the helpers read errors GitPython already raised
    import git


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
