"""--log-file on a disk that cannot take it (``/dev/full``): the command's answer stands, and
the log it asked for and did not get is one line with its own exit code (27), never a
traceback per line and an exit 1 after a command that passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import LogFileError
from tooling.patching.registry import registry

from .helpers import HANG_GUARD_S, answering_interpreter


@pytest.mark.slow
def test_a_log_file_that_cannot_be_written_is_one_line_after_the_answer(tmp_path: Path) -> None:
    """It printed 532 "Logging error" tracebacks, then exited 1 after a passing verify."""
    answer = {
        "vllm_version": "0.20.1",
        "results": [
            {"probe": name, "status": "present", "evidence": "e"} for name in registry().probes
        ],
    }
    python, env = answering_interpreter(tmp_path, json.dumps(answer))
    (tmp_path / "tree" / "vllm").mkdir(parents=True)
    command = [sys.executable, "-m", "tooling", "--log-file", "/dev/full", "-v", "probe"]
    done = subprocess.run(
        [*command, "--root", str(tmp_path / "tree"), "--python", str(python), "--json"],
        env={**os.environ, **env, "VLLM_DFLASH_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == LogFileError.exit_code == 27, done.stderr
    assert json.loads(done.stdout)["ok"] is True  # the answer, whole
    assert "Logging error" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "error: --log-file /dev/full: cannot write (No space left on device); the log stops "
        "where it failed"
    )
