"""The apply engine on real vLLM release sources: statuses, probes, conflicts, refusals."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import git
import pytest

from tooling.errors import SeriesError, WorkTreeError
from tooling.fetching.upstream import Upstream
from tooling.patching import worktree
from tooling.patching.apply import apply_series, describe_conflict, load_report
from tooling.patching.hunks import parse_diff
from tooling.patching.outcome import (
    ALREADY_APPLIED,
    APPLIED,
    CONFLICT,
    NOT_ATTEMPTED,
    SUPERSEDED,
    decide,
)
from tooling.patching.series import load_series
from tooling.probing import ABSENT, PRESENT

from .helpers import PATCHES, apply_options, touched_upstream


@pytest.mark.parametrize(
    ("forward", "reverse", "probe", "expected"),
    [
        (True, False, ABSENT, APPLIED),
        (True, False, None, APPLIED),
        (True, False, PRESENT, SUPERSEDED),  # never fix the fix: +1 twice is +2
        (False, True, PRESENT, ALREADY_APPLIED),
        (False, True, ABSENT, ALREADY_APPLIED),
        (False, False, PRESENT, SUPERSEDED),
        (False, False, ABSENT, CONFLICT),
        (False, False, "unknown", CONFLICT),
    ],
)
def test_decide(forward, reverse, probe, expected):
    assert decide(forward, reverse, probe) == expected


@pytest.mark.slow
def test_0201_all_apply_and_each_probe_flips(patched_0201, series):
    assert patched_0201.ok
    for outcome in patched_0201.outcomes:
        assert outcome.status == APPLIED, outcome.message
        assert outcome.probe_before["status"] == ABSENT, outcome.probe_before
        assert outcome.probe_after["status"] == PRESENT, outcome.probe_after
    after = {o.patch_id: o.probe_after for o in patched_0201.outcomes}
    assert "(2, 17, 32, 47, 62)" in after["dflash-layer-id-offset"]["evidence"]
    swa = after["dflash-swa-config"]["details"]
    assert swa["masks"] == [[15, 0], [15, 0], [-1, -1]]
    assert [c["kv_spec"] for c in swa["calls"]] == ["FullAttentionSpec"] * 3
    assert after["dflash-fp8-kv-cache"]["details"]["query_start_loc"]["cpu"] == "torch.int32"
    assert after["eagle-cache-drop"]["details"]["cached_dflash"] == 192
    assert after["eagle-cache-drop"]["details"]["hybrid_cached_dflash"] == 192
    before = {o.patch_id: o.probe_before for o in patched_0201.outcomes}
    assert before["eagle-cache-drop"]["details"]["cached_dflash"] == 176
    assert before["dflash-fp8-kv-cache"]["details"]["query_start_loc"]["cpu"] == "torch.int64"
    assert before["eagle-cache-drop"]["details"]["hybrid_cached_dflash"] == 176
    assert before["dflash-lookahead-slots"]["details"]["outside"] == {
        "first prefill K=3": 4,
        "first prefill K=15": 16,
        "decode all-accepted K=3": 1,
    }
    assert set(after["dflash-lookahead-slots"]["details"]["outside"].values()) == {0}
    # Fix 24: decodes without drafts start from the slot each verify step accepted into, and
    # the request passed over keeps its count (3) where the tree before reset it to 1.
    state = after["hybrid-accepted-state"]["details"]
    assert state["no_drafts"]["slots"] == {"r0": 1, "r1": 3, "r2": 0}
    assert (state["kept_count"], before["hybrid-accepted-state"]["details"]["kept_count"]) == (3, 1)
    # A request resumed after a preemption starts again at 1 (its states went with its
    # blocks), and the runner's dummy batch (a capture's warm-up) reads no count of 0.
    assert state["recompute"]["resumed_count"] == 1
    assert [d["path"] for d in state["dummies"]] == ["non-speculative"] * 2


@pytest.mark.slow
def test_0201_one_commit_per_patch_with_trailers(patched_0201, series):
    repo = git.Repo(patched_0201.work_dir)
    commits = worktree.series_commits(repo)
    assert [c.patch_file for c in commits] == [p.file.name for p in series.patches]
    assert [c.patch_sha256 for c in commits] == [p.sha256 for p in series.patches]
    assert [c.sha for c in commits] == [o.commit for o in patched_0201.outcomes]
    assert not repo.is_dirty(untracked_files=True)


@pytest.mark.slow
def test_0220_offset_is_superseded_not_reapplied(patched_0220):
    report = patched_0220
    offset = report.outcome("dflash-layer-id-offset")
    assert offset.status == SUPERSEDED and offset.commit is None
    assert offset.probe_after["status"] == PRESENT
    assert "(2, 17, 32, 47, 62)" in offset.probe_after["evidence"]  # not +2
    swa = report.outcome("dflash-swa-config")
    assert swa.status == CONFLICT
    assert any("qwen3_dflash.py hunk #" in c for c in swa.conflicts)
    assert report.outcome("eagle-cache-drop").status == APPLIED
    assert report.outcome("eagle-cache-drop").probe_after["status"] == PRESENT
    fp8 = report.outcome("dflash-fp8-kv-cache")
    assert fp8.status == SUPERSEDED and fp8.commit is None
    # 0.22.0 still reserves K slots and none on a first prefill.
    assert report.outcome("dflash-lookahead-slots").status == APPLIED
    assert report.outcome("dflash-lookahead-slots").probe_after["status"] == PRESENT
    assert not report.ok


@pytest.fixture
def touched(tmp_path, upstream_0201: Upstream, series) -> Upstream:
    return touched_upstream(upstream_0201, series, tmp_path / "base")


@pytest.mark.slow
def test_conflict_names_patch_file_hunk_and_line(tmp_path, touched, series, cache):
    tree = touched.source_dir
    target = tree / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    text = target.read_text()
    old = '        layer_ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)\n'
    target.write_text(text.replace(old, old.replace("layer_ids =", "layer_ids  =")))
    report = apply_series(touched, series, tmp_path / "w", apply_options(None, cache))
    first = report.outcome("dflash-layer-id-offset")
    assert first.status == CONFLICT
    (conflict,) = first.conflicts
    assert "vllm/v1/worker/gpu_model_runner.py hunk #1" in conflict
    assert "line 4961 expected" in conflict and "layer_ids  = getattr" in conflict
    assert [o.status for o in report.outcomes[1:]] == [NOT_ATTEMPTED] * (len(series.patches) - 1)


@pytest.mark.slow
def test_keep_going_reports_every_later_patch(tmp_path, touched, series, cache):
    tree = touched.source_dir
    target = tree / "vllm" / "model_executor" / "models" / "qwen3_dflash.py"
    target.write_text(target.read_text().replace("class DFlashQwen3Attention", "class Renamed"))
    report = apply_series(
        touched,
        series,
        tmp_path / "w",
        apply_options(None, cache, keep_going=True),
    )
    # Patch 5 is written on patch 2's lines in the same file, so it conflicts too, and so
    # do patch 22, written on patch 5's, patches 32 and 40, on patch 22's, and patch 33, on
    # patch 32's; every other later patch is still tried and applied.
    statuses = {o.patch_id: o.status for o in report.outcomes}
    conflicting = {
        "dflash-swa-config",
        "dflash-fp8-kv-cache",
        "drafter-full-graphs",
        "gdn-spec-replay",
        "join-hold",
        "dflash-step-graphs",
    }
    assert statuses == {p.id: CONFLICT if p.id in conflicting else APPLIED for p in series.patches}


@pytest.mark.slow
def test_lines_that_moved_are_reported_with_the_offset(tmp_path, touched, series, cache):
    tree = touched.source_dir
    runner = "vllm/v1/worker/gpu_model_runner.py"
    target = tree / runner
    lines = target.read_text().splitlines(keepends=True)
    lines.insert(100, "# three lines\n# added\n# upstream\n")
    target.write_text("".join(lines))
    report = apply_series(touched, series, tmp_path / "w", apply_options(None, cache))
    # git applies at an offset (no fuzz involved); the text was only moved.
    outcome = report.outcome("dflash-layer-id-offset")
    assert outcome.status == APPLIED and outcome.method == "strict"
    patch = series.get("dflash-layer-id-offset")
    (file_diff,) = parse_diff(patch.file.read_text())
    (hunk,) = file_diff.hunks
    moved_to = hunk.old_start + 3
    # The hunk report names the new place and the offset...
    assert describe_conflict(tree, patch) == [
        f"{runner} hunk #1 ({hunk.header.strip()}): context found at line {moved_to}, moved by +3"
    ]
    # ...and the patch's lines went in there, three lines below where the patch says.
    committed = git.Repo(tmp_path / "w").git.show(f"{outcome.commit}:{runner}").splitlines()
    assert committed[moved_to - 1 : moved_to - 1 + len(hunk.new_lines)] == list(hunk.new_lines)


@pytest.mark.slow
def test_already_applied_patch_is_detected(tmp_path, touched, series, cache):
    tree = touched.source_dir
    repo = git.Repo.init(tree)
    repo.git.apply(str(series.patches[0].file))
    shutil.rmtree(tree / ".git")
    report = apply_series(touched, series, tmp_path / "w", apply_options(None, cache))
    first = report.outcome("dflash-layer-id-offset")
    assert first.status == ALREADY_APPLIED and first.commit is None
    assert [o.status for o in report.outcomes[1:]] == [APPLIED] * (len(series.patches) - 1)


def ledger_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    return folder


def test_digest_mismatch_is_refused(tmp_path):
    folder = ledger_copy(tmp_path)
    patch = folder / "0002-dflash-swa-config.patch"
    patch.write_bytes(patch.read_bytes().replace(b"sliding", b"slidinG", 1))
    with pytest.raises(SeriesError, match="0002-dflash-swa-config.patch has sha256 .* but"):
        load_series(folder / "series.toml")


@pytest.mark.slow
def test_corrupt_patch_file_is_refused_by_name(tmp_path, touched, cache):
    folder = ledger_copy(tmp_path)
    patch = folder / "0001-dflash-layer-id-offset.patch"
    patch.write_bytes(patch.read_bytes().replace(b"@@ -4958,11 +4958,20 @@", b"@@ garbage @@"))
    from tooling.fsutil import sha256_file
    from tooling.patching.export import update_ledger

    update_ledger(folder / "series.toml", patch.name, sha256_file(patch))
    series = load_series(folder / "series.toml")
    with pytest.raises(
        SeriesError,
        match=r"dflash-layer-id-offset: 0001-dflash-layer-id-offset"
        r"\.patch is not a valid patch \(patch with only garbage",
    ):
        apply_series(touched, series, tmp_path / "w", apply_options(None, cache))


@pytest.mark.slow
def test_a_series_that_fails_half_way_leaves_no_half_patched_tree(tmp_path, touched, cache):
    """Two patches applied, the third unreadable: the tree this run made goes, so `patch
    export` cannot take two commits for the series (an interrupted run left one so)."""
    folder = ledger_copy(tmp_path)
    patch = folder / "0003-eagle-cache-drop.patch"
    garbled = re.sub(rb"\n@@ -[0-9, +]+ @@", b"\n@@ garbage @@", patch.read_bytes(), count=1)
    patch.write_bytes(garbled)
    from tooling.fsutil import sha256_file
    from tooling.patching.export import update_ledger

    update_ledger(folder / "series.toml", patch.name, sha256_file(patch))
    series = load_series(folder / "series.toml")
    work = tmp_path / "w"
    with pytest.raises(SeriesError, match=r"eagle-cache-drop: 0003-eagle-cache-drop\.patch is not"):
        apply_series(touched, series, work, apply_options(None, cache))
    assert not work.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".w.")] == []


def test_missing_patch_file_is_refused(tmp_path):
    folder = ledger_copy(tmp_path)
    (folder / "0003-eagle-cache-drop.patch").unlink()
    with pytest.raises(SeriesError, match="file .*0003-eagle-cache-drop.patch is missing"):
        load_series(folder / "series.toml")


@pytest.mark.slow
def test_git_source_end_to_end(tmp_path, touched, series, cache, catalog):
    """A local git repository of the real 0.20.1 files the series touches, tagged, fetched
    and patched."""
    from tooling.fetching.gitsource import fetch_git

    remote = touched.source_dir
    repo = git.Repo.init(remote, initial_branch="main")
    repo.git.add("--all", "--force")
    repo.git.commit("-m", "v0.20.1", env=worktree.git_env())
    repo.create_tag("v0.20.1")
    base = dataclasses.replace(
        catalog.get("0.20.1"),
        git=dataclasses.replace(catalog.get("0.20.1").git, commit=repo.head.commit.hexsha),
    )
    fetched = fetch_git(base, cache.__class__(tmp_path / "cache"), url=f"file://{remote}")
    upstream = Upstream(base, "git", fetched.source_dir, None, git=fetched)
    report = apply_series(upstream, series, tmp_path / "w", apply_options(None, cache))
    assert report.ok and report.baseline == repo.head.commit.hexsha
    assert [o.status for o in report.outcomes] == [APPLIED] * len(series.patches)


@pytest.mark.parametrize(
    "text", ['{"base": "0.20.1"}', '{"outcomes": [', "[]", '{"outcomes": [{"x": 1}]}']
)
def test_a_damaged_series_report_names_itself_and_the_way_out(tmp_path, text):
    """A work tree's saved report that does not read back stops the build on every rerun:
    the error names the file and the command that makes the tree again."""
    report = tmp_path / "w" / ".git" / "dflash-series.json"
    report.parent.mkdir(parents=True)
    report.write_text(text)
    with pytest.raises(WorkTreeError) as e:
        load_report(tmp_path / "w")
    assert str(e.value).startswith(f"{report}: the work tree's series report is damaged (")
    assert str(e.value).endswith(
        f"; run `tooling patch --work-dir {tmp_path / 'w'}` to make the tree again "
        "(work of yours in it is moved aside)"
    )
