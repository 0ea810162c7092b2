"""What several reliability modules share: the real `tooling` CLI as a child process, run
as at a terminal (so signals reach it as a person's would), and the session's cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.paths import default_cache_dir

#: The session's cache (conftest points $VLLM_DFLASH_CACHE at it before tests are collected).
CACHE = default_cache_dir(os.environ)
EPOCH = "1795910400"
#: Tests that run on the real pinned 0.20.1 artifacts (fetched and linked into CACHE by
#: the fixture; ``make check`` skips them).
needs_artifacts = pytest.mark.usefixtures("upstream_0201")


def tooling(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real `tooling` process (as `python -m tooling`), stdout and stderr captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        cwd=cwd,
        env={**os.environ, "SOURCE_DATE_EPOCH": EPOCH, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_at_a_terminal,
    )


def as_at_a_terminal() -> None:
    """Ctrl-C reaches the child as it would at a terminal, even when these tests run in the
    background, whose shell starts them with SIGINT ignored (and an interpreter started so
    rightly leaves it ignored, as nohup means)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err
