"""An interpreter named relative to where the command runs (``--python py``, ``--probe-python
../py``): the commands' children start in folders of their own, so each option is made
absolute where it is read. A relative --python was "No such file or directory" for a file
that exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import EnvironmentProblem, VllmNotFoundError
from tooling.patching.registry import registry

from .helpers import HANG_GUARD_S, answering_interpreter

#: Each runs the command line (and its children) as processes of their own.
pytestmark = pytest.mark.slow


def _tooling(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        cwd=cwd,
        env={**os.environ, "VLLM_DFLASH_CACHE": str(cwd / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_verify_asks_a_relative_python_from_where_it_runs(tmp_path: Path) -> None:
    (tmp_path / "py").symlink_to(sys.executable)
    done = _tooling(tmp_path, "verify", "--python", "py")
    # This interpreter has no vLLM: the answer of an interpreter that was found.
    assert (done.returncode, done.stderr) == (
        VllmNotFoundError.exit_code,
        f"error: no vLLM distribution installed for {tmp_path / 'py'}\n",
    )


def test_every_interpreter_option_takes_a_relative_path(tmp_path: Path) -> None:
    answer = {
        "vllm_version": "0.20.1",
        "results": [{"probe": n, "status": "absent", "evidence": "e"} for n in registry().probes],
    }
    answering_interpreter(tmp_path, json.dumps(answer))
    (tmp_path / "tree" / "vllm").mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PAYLOAD": str(tmp_path / "answer.json"), "TOOLING_NO_PROBE_CACHE": "1"}
    probe = _tooling(work, "probe", "--root", "../tree", "--python", "../python", "--json", **env)
    assert probe.returncode == 0, probe.stderr
    assert {r["status"] for r in json.loads(probe.stdout)["results"]} == {"absent"}
    (work / "py").symlink_to(sys.executable)
    train = _tooling(work, "train", "--preset", "smoke", "--python", "py")
    assert train.returncode == EnvironmentProblem.exit_code, train.stderr
    assert train.stderr.startswith("error: missing Python packages: torch")
