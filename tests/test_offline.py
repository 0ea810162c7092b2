"""``--offline`` means no network in every command: each runs here with an empty cache, its
index and every proxy setting pointed at a port that takes connections, counts them and
closes them (``tests/index_server.refusing_index``). None may be made: a command reaches
its answer, or its one-line error, from the cache alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import (
    CacheMissError,
    FuzzNoEvidenceError,
    FuzzPairError,
    HostRefusal,
    HostStepError,
    NetworkError,
    ProbeError,
)
from tooling.paths import REPO_DIR

from .index_server import refusing_index
from .wheels import build_wheel


def _wheel(tmp_path: Path) -> str:
    (tmp_path / "dist").mkdir(exist_ok=True)
    return str(build_wheel(tmp_path / "dist", "vllm", "0.20.1+dflash.12.abc"))


#: A GPU finding saved before findings kept their evidence.
OLD_FINDING = (
    REPO_DIR / "docs" / "notebook" / "2026-12-05-first-chunk-state" / "finding-lossless-1-1.json"
)
#: Every command and sub-command, with what it is asked (``{tmp}``: the test's folder,
#: ``{wheel}``: a wheel made there), and the exit it must give: its answer from the cache,
#: or its cache miss.
COMMANDS: dict[str, tuple[list[str], int | None]] = {
    "fetch": (["fetch"], CacheMissError.exit_code),
    "patch": (["patch", "--work-dir", "{tmp}/w"], CacheMissError.exit_code),
    # Each release's miss is in its row, and the canary fails with the first.
    "patch status": (
        ["patch", "status", "--no-probes", "--bases", "0.20.1"],
        CacheMissError.exit_code,
    ),
    "patch export": (["patch", "export", "--check"], CacheMissError.exit_code),
    "build": (["build", "--no-probes", "--work-dir", "{tmp}/w"], CacheMissError.exit_code),
    # pip installs the wheel into a new virtualenv, from the file alone (--no-index).
    "verify": (["verify", "--wheel", "{wheel}", "--probe-python", sys.executable], None),
    "probe": (["probe", "--root", "{tmp}", "--python", sys.executable], None),
    "probe-env": (["probe-env"], CacheMissError.exit_code),
    "smoke": (["smoke", "--dry-run", "--tiny", "--gpus", "1x80"], 0),
    "train": (["train", "--preset", "smoke", "--python", sys.executable], None),
    "bundle": (["bundle", "--wheel", "{wheel}", "--out", "{tmp}/out"], CacheMissError.exit_code),
    "release": (["release", "--dist", "{tmp}/dist"], None),
    # A group alone is Click's usage answer.
    "fuzz": (["fuzz"], 2),
    # The GPU host's steps: refused before they start what needs the host (a GPU, the
    # bundle's parts), or, for the parts made here, the cache's miss of the official wheel.
    "host": (["host"], 2),
    "host setup": (["host", "setup", "{tmp}/parts"], HostRefusal.exit_code),
    "host smoke": (["host", "smoke", "default"], HostRefusal.exit_code),
    "host smoke-all": (["host", "smoke-all"], HostRefusal.exit_code),
    "host smoke-pair": (["host", "smoke-pair", "more"], HostRefusal.exit_code),
    "host acceptance": (["host", "acceptance", "more"], HostRefusal.exit_code),
    "host train-background": (["host", "train-background", "more"], HostRefusal.exit_code),
    "host proof": (["host", "proof", "1"], HostRefusal.exit_code),
    "host trained": (["host", "trained", "collect"], HostRefusal.exit_code),
    "host session": (["host", "session", "wait", "5"], HostRefusal.exit_code),
    "host make-parts": (["host", "make-parts", "{tmp}/parts"], HostStepError.exit_code),
    "host pair-parts": (["host", "pair-parts", "{tmp}/o", "--", "{tmp}"], HostRefusal.exit_code),
    "host speed": (["host", "speed", "wait", "5"], HostRefusal.exit_code),
    "host fuzz": (["host", "fuzz", "patched", "trained"], HostRefusal.exit_code),
    # A pair it cannot serve is refused before any interpreter starts.
    "fuzz gpu": (
        ["fuzz", "gpu", "--pair", "{tmp}/no-pair", "--python", sys.executable, "--out", "{tmp}/gf"],
        FuzzPairError.exit_code,
    ),
    # A finding saved before findings kept their evidence: refused before any model loads.
    "fuzz referee": (
        ["fuzz", "referee", str(OLD_FINDING), "--target", "{tmp}", "--python", sys.executable],
        FuzzNoEvidenceError.exit_code,
    ),
    # The fuzzer reads no index: with an interpreter that has no vLLM, it says so.
    "fuzz scheduler": (
        [
            "fuzz",
            "scheduler",
            "--python",
            sys.executable,
            "--cases",
            "1",
            "--jobs",
            "1",
            "--out",
            "{tmp}/fuzz",
        ],
        ProbeError.exit_code,
    ),
}
#: Those that start interpreters of their own (a virtualenv, the probes, the recipe, uv):
#: the slow tier.
SLOW = {"verify", "probe", "train", "bundle", "fuzz scheduler"}


def _names(group: click.Group, prefix: str = "") -> set[str]:
    names = set()
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        names.add(f"{prefix}{name}")
        if isinstance(command, click.Group):
            names |= _names(command, f"{prefix}{name} ")
    return names


def test_every_command_is_tried_offline() -> None:
    assert set(COMMANDS) == _names(main)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in COMMANDS]
)
def test_offline_makes_no_connection(tmp_path: Path, name: str) -> None:
    args, code = COMMANDS[name]
    given = [a.format(tmp=tmp_path, wheel=_wheel(tmp_path)) for a in args]
    with refusing_index() as refusing:
        env = {
            **refusing.environ(),
            "VLLM_DFLASH_CACHE": str(tmp_path / "cache"),
            "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
            "TOOLING_PROBE_PYTHON": "",
        }
        result: Any = CliRunner(env=env).invoke(
            main, ["--no-progress", "--offline", "--index-url", refusing.url, *given]
        )
    assert refusing.connections == 0, result.stderr
    assert result.exit_code != NetworkError.exit_code, result.stderr
    assert "onnection refused" not in result.stderr and "Traceback" not in result.stderr
    if code is not None:
        assert result.exit_code == code, result.stderr
    if result.exit_code not in (0, 2):
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr
