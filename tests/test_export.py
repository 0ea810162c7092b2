"""Patch export: byte-for-byte round trip and the drift check CI relies on."""

from __future__ import annotations

import json
import shutil

import git
import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import SeriesError
from tooling.fsutil import sha256_file
from tooling.patching import worktree
from tooling.patching.apply import apply_series
from tooling.patching.export import check_export, export_patches, render_patches
from tooling.patching.series import load_series

from .helpers import PATCHES, apply_options, touched_upstream


@pytest.mark.slow
def test_export_round_trips_byte_for_byte(patched_0201, series):
    rendered = render_patches(git.Repo(patched_0201.work_dir))
    assert [name for name, _ in rendered] == [p.file.name for p in series.patches]
    for (_, data), patch in zip(rendered, series.patches, strict=True):
        assert data == patch.file.read_bytes()


@pytest.mark.slow
def test_check_passes_on_the_committed_series(upstream_0201, series, cache):
    result = check_export(upstream_0201, series, cache.baselines)
    assert result.patches and result.drifted == []


@pytest.mark.slow
def test_check_catches_a_hand_edited_patch(tmp_path, upstream_0201, cache):
    """A hand edit git still accepts (stale line numbers) is not what export would write."""
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    patch = folder / "0003-eagle-cache-drop.patch"
    text = patch.read_bytes()
    header = text[text.index(b"\n@@ -") + 1 :].split(b"\n", 1)[0]
    start = int(header.split(b" ")[1].split(b",")[0][1:])
    edited = header.replace(f"-{start},".encode(), f"-{start - 3},".encode(), 1)
    patch.write_bytes(text.replace(header, edited, 1))
    from tooling.patching.export import update_ledger

    update_ledger(folder / "series.toml", patch.name, sha256_file(patch))
    result = check_export(upstream_0201, load_series(folder / "series.toml"), cache.baselines)
    assert [(p.file, p.state) for p in result.drifted] == [(patch.name, "updated")]


def patched_copy(tmp_path, upstream, cache):
    """A copy of patches/ (its ledger, series and folder) and a work tree made from it."""
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    series = load_series(folder / "series.toml")
    touched = touched_upstream(upstream, series, tmp_path / "base")
    report = apply_series(touched, series, tmp_path / "w", apply_options(None, cache))
    return folder, series, report, git.Repo(report.work_dir)


@pytest.mark.slow
def test_export_writes_an_amended_commit_and_updates_the_ledger(tmp_path, upstream_0201, cache):
    folder, series, report, repo = patched_copy(tmp_path, upstream_0201, cache)
    # Reword the last patch's message in the work tree, keeping its trailers.
    last = series.patches[-1]
    subject = last.title.split(":", 1)[0] + ":"
    message = repo.head.commit.message.replace(subject, subject[:-1] + " (v2):", 1)
    repo.git.commit("--amend", "-m", message, env=worktree.git_env())
    result = export_patches(report.work_dir, series)
    states = {p.file: p.state for p in result.patches}
    assert states == {p.file.name: "unchanged" for p in series.patches[:-1]} | {
        last.file.name: "updated"
    }
    exported = folder / last.file.name
    assert f"Subject: {subject[:-1]} (v2):".encode() in exported.read_bytes()
    reloaded = load_series(folder / "series.toml")  # digests match again
    assert reloaded.get(last.id).sha256 == sha256_file(exported)


@pytest.mark.slow
def test_export_of_a_tree_missing_ledger_patches_writes_nothing(tmp_path, upstream_0201, cache):
    """A tree whose last commits are gone (a half-made or cut-back tree): export refused,
    patches/ and the ledger untouched."""
    folder, series, report, repo = patched_copy(tmp_path, upstream_0201, cache)
    repo.git.reset("--hard", "HEAD~2")
    before = {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    gone = [p.file.name for p in series.patches[-2:]]
    with pytest.raises(
        SeriesError, match=rf"no commit carries 2 of the ledger's patches \({gone[0]}"
    ):
        export_patches(report.work_dir, series)
    assert {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_cli_export_check_exit_code_on_drift(tmp_path, cache):
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    patch = folder / "0001-dflash-layer-id-offset.patch"
    patch.write_bytes(patch.read_bytes() + b"\n")
    from tooling.patching.export import update_ledger

    update_ledger(folder / "series.toml", patch.name, sha256_file(patch))
    result = CliRunner().invoke(
        main, ["--patches-dir", str(folder), "--no-progress", "patch", "export", "--check"]
    )
    assert result.exit_code == SeriesError.exit_code
    assert "patches/ is out of date: 0001-dflash-layer-id-offset.patch (updated)" in result.stderr


def test_update_ledger_refuses_an_unknown_file(tmp_path):
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    with pytest.raises(SeriesError, match='expected `file = "nope.patch"`'):
        from tooling.patching.export import update_ledger

        update_ledger(folder / "series.toml", "nope.patch", "0" * 64)


@pytest.mark.parametrize("repository", [False, True])
def test_export_of_a_folder_that_is_no_work_tree_names_it(tmp_path, repository):
    """A plain folder, or a repository `tooling patch` did not make (no baseline tag)."""
    folder = tmp_path / "plain"
    folder.mkdir()
    if repository:
        git.Repo.init(folder)
    result = CliRunner().invoke(main, ["patch", "--work-dir", str(folder), "export", "--json"])
    assert result.exit_code == SeriesError.exit_code, result.output
    message = (
        f"{folder}: not a work tree made by `tooling patch` (no git repository with its "
        "baseline tag); give --work-dir one, or run `tooling patch` first"
    )
    assert result.stderr == f"error: {message}\n"
    assert json.loads(result.stdout)["error"] == message
