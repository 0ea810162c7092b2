"""Every folder a command is given to make or fill, under hostile input: a name too long for
the temp sibling it is made as (255 characters), a file where a folder must be, a place
nothing can be made in (``/proc``). Each is one line naming the option, with the command's
own exit code, before any work: they were an ENAMETOOLONG ("unexpected OSError"), a
NotADirectoryError, or a traceback in the recipe's child."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import (
    BundleError,
    CacheWriteError,
    SmokeError,
    TrainSettingsError,
    WorkTreeError,
)

from .wheels import build_wheel

#: Each command's folder option: (arguments before it, the option, exit code, how the
#: error names it).
FOLDERS = {
    "patch": (["patch"], "--work-dir", WorkTreeError.exit_code, "--work-dir"),
    "build": (["build", "--no-probes"], "--work-dir", WorkTreeError.exit_code, "--work-dir"),
    "train": (
        ["train", "--python", "/bin/false", "--preset", "smoke"],
        "--out-dir",
        TrainSettingsError.exit_code,
        "--out-dir",
    ),
    "smoke": (["smoke", "--tiny"], "--workdir", SmokeError.exit_code, "--workdir"),
    "bundle": (["bundle", "--wheel", "{wheel}"], "--out", BundleError.exit_code, "--out"),
    "cache": (
        ["--cache-dir"],
        "",
        CacheWriteError.exit_code,
        "the cache (--cache-dir, $VLLM_DFLASH_CACHE)",
    ),
}
#: What is given, and the reason the one line gives.
HOSTILE = {
    "255-character name": ("{tmp}/" + "n" * 255, "the name nnnnnnnnnnnnnnnnnnnn... is 255 bytes"),
    "no room for its sibling": ("{tmp}/" + "m" * 245, "is 245 bytes; at most 239 fit here"),
    "under a file": ("{tmp}/notes.txt/sub", "{tmp}/notes.txt is a file, not a folder"),
    "in /proc": ("/proc/dflash-x", "cannot make folders in /proc ("),
}


def _invoke(tmp_path: Path, kind: str, folder: str) -> Any:
    before, option, _, _ = FOLDERS[kind]
    wheel = build_wheel(tmp_path / "dist", "vllm", "0.20.1+dflash.12.abc")
    args = [a.format(wheel=wheel) for a in before]
    if kind == "cache":
        args = ["--cache-dir", folder, "fetch", "--offline"]
    else:
        args += [option, folder]
    env = {"VLLM_DFLASH_CACHE": str(tmp_path / "cache"), "TOOLING_PROBE_PYTHON": ""}
    return CliRunner(env=env).invoke(main, ["--no-progress", *args])


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("kind", list(FOLDERS))
def test_a_folder_that_cannot_be_one_is_refused_in_one_line(
    tmp_path: Path, kind: str, hostile: str
) -> None:
    if kind == "cache" and hostile == "in /proc":
        pytest.skip("a read-only cache that holds what a command needs is used")
    (tmp_path / "dist").mkdir()
    (tmp_path / "notes.txt").write_text("keep")
    given, why = (v.format(tmp=tmp_path) for v in HOSTILE[hostile])
    result = _invoke(tmp_path, kind, given)
    _, _, code, what = FOLDERS[kind]
    assert result.exit_code == code, result.output
    assert result.stderr.startswith(f"error: {what} {given}: "), result.stderr
    assert why in result.stderr and result.stderr.count("\n") == 1, result.stderr
    # Nothing was made, and the file in the way is as it was.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_a_cache_that_is_a_file_is_one_line_from_the_variable_too(tmp_path: Path) -> None:
    """VLLM_DFLASH_CACHE=/etc/passwd was a NotADirectoryError."""
    mine = tmp_path / "passwd"
    mine.write_text("root:x:0:0\n")
    result = CliRunner(env={"VLLM_DFLASH_CACHE": str(mine)}).invoke(main, ["fetch", "--offline"])
    assert (result.exit_code, result.stderr) == (
        CacheWriteError.exit_code,
        f"error: the cache (--cache-dir, $VLLM_DFLASH_CACHE) {mine}: {mine} is a file, not a "
        "folder\n",
    )
    assert mine.read_text() == "root:x:0:0\n"
