"""The pinned data files read with every value checked against its type: the ledger
(``patches/series.toml``, exit 10) and the bases (``patches/bases.toml``, exit 3). A wrong
value is one line naming the file, the table and the key, never read as something it does
not say (``"no"`` as true, ``"id"`` as the patches ``i`` and ``d``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import ConfigError, SeriesError
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
    (
        "validated",
        '"0.20.1"',
        "unknown key 'validated' (known: patch, ported_bases, validated_base)",
    ),
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


def _bases_with(tmp_path: Path, table: str, key: str, value: str) -> Path:
    """A copy of ``patches/`` whose bases.toml gives ``key`` of ``table`` (its header, e.g.
    ``[bases."0.20.1".wheel]``, "" for the top) the TOML ``value`` ("" removes it)."""
    copy = shutil.copytree(PATCHES, tmp_path / "patches")
    lines = (PATCHES / "bases.toml").read_text().split("\n")
    start = lines.index(table) + 1 if table else 0
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    block = [line for line in lines[start:end] if not line.startswith(f"{key} = ")]
    new = [f"{key} = {value}"] if value else []
    (copy / "bases.toml").write_text("\n".join([*lines[:start], *new, *block, *lines[end:]]))
    return copy


BASE = '[bases."0.20.1"]'
MALFORMED_BASES = [
    (BASE, "release_date", "20260504", "[bases.'0.20.1']: release_date 20260504 is not a "),
    (BASE, "release_date", '"May 4"', "[bases.'0.20.1']: release_date 'May 4' is not a date"),
    (BASE, "probe_env", "0.2", "[bases.'0.20.1']: probe_env 0.2 is not a string"),
    (BASE, "sdists", "1", "[bases.'0.20.1']: unknown key 'sdists' (known: "),
    (
        f"{BASE[:-1]}.sdist]",
        "size",
        '"33519792"',
        "[bases.'0.20.1'].sdist: size '33519792' is not a whole ",
    ),
    (f"{BASE[:-1]}.sdist]", "size", "-1", "[bases.'0.20.1'].sdist: size -1 is below 1"),
    (
        f"{BASE[:-1]}.sdist]",
        "filename",
        '"../../x.tar.gz"',
        "[bases.'0.20.1'].sdist: filename '../../x.tar.gz' ",
    ),
    (f"{BASE[:-1]}.sdist]", "sha256", "[1]", "[bases.'0.20.1'].sdist: sha256 [1] is not a string"),
    (f"{BASE[:-1]}.wheel]", "filename", "", "[bases.'0.20.1'].wheel: missing key 'filename'"),
    (
        f"{BASE[:-1]}.wheel]",
        "wheel_commit",
        "132765",
        "[bases.'0.20.1'].wheel: wheel_commit 132765 is not a ",
    ),
    (
        f"{BASE[:-1]}.git]",
        "commit_verified",
        '"no"',
        "[bases.'0.20.1'].git: commit_verified 'no' is not true ",
    ),
    (f"{BASE[:-1]}.git]", "tag", "1", "[bases.'0.20.1'].git: tag 1 is not a string"),
    ("", "default", "0.2", "default 0.2 is not a string"),
    ("", "git_url", "[]", "git_url [] is not a string"),
    ("", "bases_dir", '"x"', "unknown key 'bases_dir' (known: bases, default, git_url)"),
]


@pytest.mark.parametrize(("table", "key", "value", "why"), MALFORMED_BASES)
def test_a_malformed_bases_value_is_one_line_naming_table_and_key(
    tmp_path: Path, table: str, key: str, value: str, why: str
) -> None:
    patches = _bases_with(tmp_path, table, key, value)
    result = CliRunner().invoke(
        main, ["--patches-dir", str(patches), "fetch", "--offline", "--no-wheel"]
    )
    assert result.exit_code == ConfigError.exit_code, result.stderr
    assert result.stderr.startswith(f"error: {patches / 'bases.toml'}: {why}"), result.stderr
    assert result.stderr.count("\n") == 1
