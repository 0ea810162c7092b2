"""Where the library's log lines go: stderr as plain lines (what printed before logging still
prints, unchanged), debug lines too with ``-v``, and everything, time-stamped, in
``--log-file``; ``--json``'s document on stdout is the same whichever is given."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tooling.cli import main

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


@pytest.fixture(scope="module")
def without_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real interpreter that has no vLLM: ``verify --python`` asks it, then fails (16)."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def run(*args: str):
    return CliRunner().invoke(main, ["--no-progress", *args])


def test_an_error_is_the_same_one_line_on_stderr_and_nothing_else(without_vllm):
    result = run("verify", "--python", str(without_vllm))
    assert result.exit_code == 16, result.output
    assert result.stderr == f"error: no vLLM distribution installed for {without_vllm}\n"
    assert result.stdout == ""


def test_verbose_adds_the_child_processes_run(without_vllm):
    result = run("-v", "verify", "--python", str(without_vllm))
    assert result.exit_code == 16, result.output
    lines = result.stderr.splitlines()
    # The interpreter asked, its script by its first line, and how it ended; then the error.
    assert lines[0].startswith(f"start {without_vllm} -c 'import json, os, importlib.metadata")
    assert lines[0].endswith(" ...'")
    assert lines[1] == "exit status 0 of python"
    assert lines[-1] == f"error: no vLLM distribution installed for {without_vllm}"


def test_a_log_file_gets_every_line_with_its_time(tmp_path, without_vllm):
    log = tmp_path / "run.log"
    log.write_text("an earlier run\n")
    result = run("--log-file", str(log), "verify", "--python", str(without_vllm))
    assert result.exit_code == 16, result.output
    # stderr as without the file: the debug lines go to the file only.
    assert result.stderr == f"error: no vLLM distribution installed for {without_vllm}\n"
    earlier, *lines = log.read_text().splitlines()
    assert earlier == "an earlier run"
    assert re.fullmatch(
        rf"{STAMP} DEBUG tooling\.procs: start {re.escape(str(without_vllm))} .*", lines[0]
    )
    assert re.fullmatch(rf"{STAMP} DEBUG tooling\.procs: exit status 0 of python", lines[1])
    assert re.fullmatch(
        rf"{STAMP} ERROR tooling: error: no vLLM distribution installed for .*", lines[-1]
    )


def test_json_on_stdout_is_the_same_with_verbose_and_a_log_file(tmp_path, without_vllm):
    plain = run("verify", "--python", str(without_vllm), "--json")
    logged = run(
        "-v", "--log-file", str(tmp_path / "log"), "verify", "--python", str(without_vllm), "--json"
    )
    assert plain.exit_code == logged.exit_code == 16
    assert logged.stdout == plain.stdout
    assert '"exit_code": 16' in plain.stdout
    assert "start " not in logged.stdout


def test_a_log_file_that_cannot_be_written_is_a_usage_error(tmp_path):
    result = run("--log-file", str(tmp_path / "missing" / "run.log"), "fetch")
    assert result.exit_code == 2
    assert "Invalid value for '--log-file': cannot write " in result.stderr
    assert "No such file or directory" in result.stderr


def test_a_run_leaves_no_handler_behind(tmp_path, without_vllm):
    package = logging.getLogger("tooling")
    before = list(package.handlers), package.level
    run("-v", "--log-file", str(tmp_path / "log"), "verify", "--python", str(without_vllm))
    assert (list(package.handlers), package.level) == before
