"""``tooling smoke --dry-run`` on a user's pair under hostile or careless input: every figure
the plan reads is checked (the configs' values, what a drafter needs of its target, the
safetensors headers), and --gpus is bounded before a plan is made for it. Each refusal is
one line naming the file and the key, and plans nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import SmokeError
from tooling.smoke.serving.tiny import TinySpec, drafter_config, target_config

from .smoke_models import write_model


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    """``key`` (dotted for a nested table) set to ``value``; ``...`` removes it."""
    *tables, last = key.split(".")
    for table in tables:
        config = config[table]
    if value is ...:
        del config[last]
    else:
        config[last] = value


def _pair(tmp_path: Path, target: dict[str, Any] | None = None, **drafter: Any) -> Path:
    """The tiny attention-only pair (an 8-layer target of width 256; a drafter reading its
    layers 1, 3 and 5 in blocks of 4) as a user's folders, with ``target`` and ``drafter``
    values set (``__`` for a dot in a key)."""
    spec = TinySpec.for_arch("qwen3")
    configs = {"target": target_config(spec), "drafter": drafter_config(spec)}
    for key, value in (target or {}).items():
        _set(configs["target"], key, value)
    for key, value in drafter.items():
        _set(configs["drafter"], key.replace("__", "."), value)
    for role, config in configs.items():
        write_model(tmp_path / "pair" / role, copy.deepcopy(config), 10**6)
    return tmp_path / "pair"


def _plan(tmp_path: Path, pair: Path, *args: str, gpus: str = "1x141") -> Any:
    command = ["smoke", "--dry-run", "--gpus", gpus, "--workdir", str(tmp_path / "w")]
    command += ["--target", str(pair / "target"), "--drafter", str(pair / "drafter"), *args]
    return CliRunner().invoke(main, command)


def test_the_pair_as_written_plans(tmp_path: Path) -> None:
    result = _plan(tmp_path, _pair(tmp_path))
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize(
    ("gpus", "why"),
    [
        ("2xinf", "expected COUNTxGIB, e.g. 2x141"),
        ("2x1e400", "expected COUNTxGIB, e.g. 2x141"),
        ("2xnan", "expected COUNTxGIB, e.g. 2x141"),
        ("99999999999999999999x80", "expected COUNTxGIB, e.g. 2x141"),
        ("999999x80", "COUNT must be 1 to 64 (one host's GPUs)"),
        ("0x80", "COUNT must be 1 to 64 (one host's GPUs)"),
        ("1x0", "GIB must be above 0 and at most 4096"),
        ("1x9999999", "GIB must be above 0 and at most 4096"),
        ("-1x80", "expected COUNTxGIB, e.g. 2x141"),
    ],
)
def test_gpus_are_bounded_before_a_plan_is_made_for_them(
    tmp_path: Path, gpus: str, why: str
) -> None:
    """2xinf was an OverflowError; 99999999999999999999x80 grew past 1.2 GB and never
    answered."""
    result = _plan(tmp_path, _pair(tmp_path), gpus=gpus)
    assert (result.exit_code, result.stderr) == (
        SmokeError.exit_code,
        f"error: --gpus {gpus!r}: {why}\n",
    )


def test_a_workdir_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    """It was an unexpected FileExistsError."""
    mine = tmp_path / "notes.txt"
    mine.write_text("keep")
    command = ["smoke", "--tiny", "--workdir", str(mine), "--dry-run", "--gpus", "1x80"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 2
    assert f"Invalid value for '--workdir': Directory '{mine}' is a file." in result.stderr
    assert mine.read_text() == "keep"
