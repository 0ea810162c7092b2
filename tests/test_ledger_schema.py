"""The ledger (``patches/series.toml``) read with every value checked against its type: a
wrong one is one line naming the file, the patch and the key (exit 10), never read as
something it does not say (``"no"`` as true, ``"id"`` as the patches ``i`` and ``d``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import SeriesError
from tooling.patching import registry as registry_module
from tooling.patching.registry import registry
from tooling.patching.series import load_series

from .helpers import PATCHES


def _patches_with(tmp_path: Path, key: str, value: str, patch: int = 1) -> Path:
    """A copy of ``patches/`` whose ledger gives patch ``patch``'s ``key`` the TOML
    ``value`` (``patch`` 0: the ledger's own keys); ``value`` "" removes the key."""
    copy = shutil.copytree(PATCHES, tmp_path / "patches")
    blocks = (PATCHES / "series.toml").read_text().split("[[patch]]\n")
    if key == "patch":  # the ledger's patches given as one value: no [[patch]] tables then
        blocks = blocks[:1]
    lines = [line for line in blocks[patch].split("\n") if not line.startswith(f"{key} = ")]
    blocks[patch] = "\n".join(([f"{key} = {value}"] if value else []) + lines)
    (copy / "series.toml").write_text("[[patch]]\n".join(blocks))
    return copy


#: (key, TOML value, patch, what the one line says after the patch's name).
MALFORMED = [
    ("touches_compiled_code", '"no"', 1, "touches_compiled_code 'no' is not true or false"),
    ("touches_compiled_code", "0", 1, "touches_compiled_code 0 is not true or false"),
    ("requires", '"dflash-layer-id-offset"', 2, "requires 'dflash-layer-id-offset' is not a "),
    ("requires", "[1]", 2, "requires [1] is not a list of strings"),
    ("files", '"x"', 1, "files 'x' is not a list of strings"),
    ("files", "[]", 1, "files is empty: a patch touches at least one file"),
    ("files", "", 1, "missing key 'files'"),
    ("id", "7", 1, "id 7 is not a string"),
    ("id", '"Layer_Offset"', 1, "id 'Layer_Offset' is not lower-case-with-dashes"),
    ("file", '"../../elsewhere.patch"', 1, "file '../../elsewhere.patch' is not a file name"),
    ("file", "{ name = 1 }", 1, "file {'name': 1} is not a string"),
    ("sha256", '"abc"', 1, "sha256 'abc' is not 64 hex digits"),
    ("title", '["a", "b"]', 1, "title ['a', 'b'] is not a string"),
    ("probe", "false", 1, "probe False is not a string"),
    ("upstream", '"https://example.com/pr"', 1, "upstream 'https://example.com/pr' is not a "),
    ("upstream_fixed_in", "0.22", 1, "upstream_fixed_in 0.22 is not a string"),
    ("drop_when", "[]", 1, "drop_when [] is not a string"),
    ("require", '["x"]', 2, "unknown key 'require' (known: "),
]


@pytest.mark.parametrize(("key", "value", "patch", "why"), MALFORMED)
def test_a_malformed_ledger_value_is_one_line_naming_patch_and_key(
    tmp_path: Path, key: str, value: str, patch: int, why: str
) -> None:
    patches = _patches_with(tmp_path, key, value, patch)
    with pytest.raises(SeriesError) as raised:
        load_series(patches / "series.toml")
    assert str(raised.value).startswith(f"{patches / 'series.toml'}: patch #{patch}: {why}")


#: The ledger's own keys.
MALFORMED_TOP = [
    ("patch", '"oops"', "patch 'oops' is not a list of tables"),
    ("patch", "[1, 2]", "patch [1, 2] is not a list of tables"),
    ("validated_base", "20.1", "validated_base 20.1 is not a string"),
    ("validated", '"0.20.1"', "unknown key 'validated' (known: patch, validated_base)"),
]


@pytest.mark.parametrize(("key", "value", "why"), MALFORMED_TOP)
def test_a_malformed_ledger_key_is_one_line_naming_it(
    tmp_path: Path, key: str, value: str, why: str
) -> None:
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    text = (PATCHES / "series.toml").read_text()
    head, sep, rest = text.partition("[[patch]]\n")
    head = "\n".join(line for line in head.split("\n") if not line.startswith(f"{key} = "))
    if key == "patch":
        rest, sep = "", ""
    (patches / "series.toml").write_text(f"{key} = {value}\n{head}{sep}{rest}")
    with pytest.raises(SeriesError) as raised:
        load_series(patches / "series.toml")
    assert str(raised.value) == f"{patches / 'series.toml'}: {why}" or str(raised.value).startswith(
        f"{patches / 'series.toml'}: {why}"
    )


def _build(patches: Path, tmp_path: Path) -> Any:
    """``tooling build`` with ``patches``, in an empty cache: a ledger it accepts goes on to
    the cache and stops there (exit 9); one it refuses stops first."""
    args = ["--no-progress", "--patches-dir", str(patches), "build", "--offline", "--no-probes"]
    env = {"VLLM_DFLASH_CACHE": str(tmp_path / "cache"), "TOOLING_PROBE_PYTHON": ""}
    return CliRunner(env=env).invoke(main, [*args, "--work-dir", str(tmp_path / "w")])


@pytest.mark.parametrize(
    ("key", "value", "patch", "why"),
    [
        ("touches_compiled_code", '"no"', 1, "touches_compiled_code 'no' is not true or false"),
        ("requires", '"id"', 5, "requires 'id' is not a list of strings"),
        ("files", '"x"', 1, "files 'x' is not a list of strings"),
        ("id", "7", 1, "id 7 is not a string"),
        ("patch", '"oops"', 0, "patch 'oops' is not a list of tables"),
        ("validated_base", '"9.9.9"', 0, "validated_base '9.9.9' is not a release bases.toml "),
    ],
)
def test_the_build_refuses_the_listed_ledgers_before_any_work(
    tmp_path: Path, key: str, value: str, patch: int, why: str
) -> None:
    """Each was built (exit 0 with the artifacts cached; a TypeError for ``patch``); here,
    with none cached, a ledger taken as good would stop at the cache instead."""
    patches = _patches_with(tmp_path, key, value, patch)
    done = _build(patches, tmp_path)
    where = f"patch #{patch}: " if patch else ""
    assert done.exit_code == SeriesError.exit_code, done.stderr
    assert done.stderr.startswith(f"error: {patches / 'series.toml'}: {where}{why}")
    assert done.stderr.count("\n") == 1 and not (tmp_path / "w").exists()


def test_verify_help_with_a_ledger_whose_patches_are_a_string_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = _patches_with(tmp_path, "patch", '"oops"', 0) / "series.toml"
    monkeypatch.setattr(registry_module, "LEDGER", ledger)
    registry.cache_clear()
    try:
        result = CliRunner().invoke(main, ["verify", "--help"])
    finally:
        registry.cache_clear()
    assert result.exit_code == SeriesError.exit_code
    assert result.stderr == f"error: {ledger}: patch 'oops' is not a list of tables\n"
