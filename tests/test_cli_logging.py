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
from tooling.paths import REPO_DIR

from .helpers import git

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
    loggers = [logging.getLogger("tooling"), logging.getLogger("git.cmd")]
    before = [(list(logger.handlers), logger.level) for logger in loggers]
    run("-v", "--log-file", str(tmp_path / "log"), "verify", "--python", str(without_vllm))
    assert [(list(logger.handlers), logger.level) for logger in loggers] == before


@pytest.fixture
def git_remote(tmp_path: Path) -> tuple[str, Path]:
    """A real remote whose tag v0.20.1 the patches folder's bases.toml pins: ``tooling fetch
    --source git`` from it runs git (init, fetch, rev-parse, archive) and nothing else."""
    remote = tmp_path / "remote"
    (remote / "vllm").mkdir(parents=True)
    (remote / "vllm" / "__init__.py").write_text("__version__ = '0.20.1'\n")
    git(remote, "init", "-q", "-b", "main")
    git(remote, "add", ".")
    git(remote, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "r")
    git(remote, "tag", "v0.20.1")
    pinned = 'commit = "f98b2747f"'
    text = (REPO_DIR / "patches" / "bases.toml").read_text()
    assert pinned in text
    patches = tmp_path / "patches"
    patches.mkdir()
    commit = git(remote, "rev-parse", "HEAD")
    (patches / "bases.toml").write_text(text.replace(pinned, f'commit = "{commit}"', 1))
    return f"file://{remote}", patches


def fetch_git(tmp_path: Path, url: str, patches: Path, *group: str):
    return run(
        *group,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--patches-dir",
        str(patches),
        "fetch",
        "--source",
        "git",
        "--no-wheel",
        "--git-url",
        url,
    )


def test_verbose_adds_each_git_command_as_a_child_process(tmp_path, git_remote):
    """Git runs through GitPython, not the child-process runner; -v shows its commands in
    the runner's words, with the folder each ran in."""
    url, patches = git_remote
    plain = fetch_git(tmp_path, url, patches)
    assert plain.exit_code == 0, plain.output
    assert plain.stderr == ""
    logged = fetch_git(tmp_path / "again", url, patches, "-v")
    assert logged.exit_code == 0, logged.output
    # stdout as without -v: the same answer, of the second run's cache.
    cache = str(tmp_path / "cache")
    assert logged.stdout == plain.stdout.replace(cache, str(tmp_path / "again" / "cache"))
    clone = re.escape(str(tmp_path / "again" / "cache" / "git"))
    lines = logged.stderr.splitlines()
    fetched = (
        rf"start git fetch -- {re.escape(url)} '\+refs/heads/\*:refs/heads/\*' "
        rf"'\+refs/tags/\*:refs/tags/\*' \(in {clone}/\S+\)"
    )
    assert any(re.fullmatch(fetched, line) for line in lines), lines
    assert any(line.startswith("start git rev-parse --verify --quiet ") for line in lines), lines
    assert any(line.startswith("start git archive --format=tar ") for line in lines), lines
    # The stages' own steps among them, each under its module's logger.
    assert f"fetch vLLM 0.20.1 from {url}" in lines, lines
    assert any(re.fullmatch(r"tag v0\.20\.1 is commit [0-9a-f]{40}", line) for line in lines)


def test_a_log_file_names_the_git_commands_under_the_git_helpers(tmp_path, git_remote):
    url, patches = git_remote
    log = tmp_path / "run.log"
    result = fetch_git(tmp_path, url, patches, "--log-file", str(log))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    text = log.read_text()
    assert re.search(
        rf"^{STAMP} DEBUG tooling\.gitutil: start git archive --format=tar \S+ \(in .*\)$",
        text,
        re.MULTILINE,
    ), text
    assert re.search(rf"^{STAMP} DEBUG tooling\.fetching\.gitsource: tag v0\.20\.1 ", text, re.M)


def test_verbose_adds_the_smokes_steps_and_its_plan_stays_the_same(tmp_path):
    """The smoke logs its steps under its own modules: ``-v`` shows them (the dry run's
    plan, as ``tooling.smoke.plan.describe`` made it), and without it stderr stays empty;
    the plan on stdout is the same either way."""
    command = ["smoke", "--tiny", "--dry-run", "--gpus", "1x80", "--workdir", str(tmp_path / "w")]
    plain = run(*command)
    logged = run("-v", *command)
    assert plain.exit_code == logged.exit_code == 0, logged.output
    assert plain.stderr == ""
    assert logged.stdout == plain.stdout
    lines = logged.stderr.splitlines()
    assert "dry run: the plan alone" in lines, lines
    assert any(line.startswith("plan: side by side: all 5 engines fit at once") for line in lines)
    log = tmp_path / "run.log"
    run("--log-file", str(log), *command)
    assert re.search(
        rf"^{STAMP} DEBUG tooling\.smoke\.plan\.describe: plan: ", log.read_text(), re.M
    )
