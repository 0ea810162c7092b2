"""Regenerate patch files from a work tree's commits, and check that patches/ is current.

The round trip is the contract: ``git am`` of a patch file followed by
``format-patch`` of the resulting commit gives back the same bytes, so a
drift check can fail CI the moment someone edits a patch by hand or
forgets to export a change made in the work tree.
"""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import git

from ..errors import SeriesError
from ..fetching.upstream import Upstream
from ..fsutil import atomic_output, atomic_write_text, run_prefix, sha256_bytes
from . import worktree
from .apply import ApplyOptions, apply_series
from .series import CodeState, Patch, Series

logger = logging.getLogger(__name__)


@dataclass
class ExportedPatch:
    file: str
    sha256: str
    state: str
    """"unchanged", "updated", "new" (not in series.toml) or "missing" (no commit made it)."""


@dataclass
class ExportResult:
    patches: list[ExportedPatch] = field(default_factory=list)
    check: bool = False
    """Compared only (``--check``): a drift is then a failure, not the news of a write."""

    @property
    def drifted(self) -> list[ExportedPatch]:
        return [p for p in self.patches if p.state != "unchanged"]

    @property
    def ok(self) -> bool:
        return not (self.check and self.drifted)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "check": self.check, "patches": [vars(p) for p in self.patches]}

    def raise_unless_ok(self) -> None:
        if not self.ok:
            names = ", ".join(f"{p.file} ({p.state})" for p in self.drifted)
            raise SeriesError(f"patches/ is out of date: {names}; run `tooling patch export`")


def _slug(subject: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52] or "patch"


def render_patches(repo: git.Repo) -> list[tuple[str, bytes]]:
    """(file name, bytes) for every commit after the baseline, oldest first."""
    out = []
    for index, commit in enumerate(worktree.series_commits(repo), start=1):
        name = commit.patch_file or f"{index:04d}-{_slug(commit.subject)}.patch"
        out.append((name, worktree.format_patch(repo, commit.sha)))
    return out


def exported(series: Series) -> tuple[Patch, ...]:
    """The patches whose files an export writes: on a ported base its ports alone (a fix the
    ledger names no code for there has none to export), elsewhere every patch."""
    if series.base is None:
        return series.patches
    return tuple(p for p in series.patches if p.expect is CodeState.PORT)


def compare(rendered: list[tuple[str, bytes]], patches_dir: Path, series: Series) -> ExportResult:
    """How ``rendered`` differs from what ``patches_dir`` and the ledger hold."""
    listed = {p.ledger_file for p in exported(series)}
    result = ExportResult()
    for name, data in rendered:
        path = patches_dir / name
        digest = sha256_bytes(data)
        if name not in listed:
            state = "new"
        elif path.is_file() and path.read_bytes() == data:
            state = "unchanged"
        else:
            state = "updated"
        result.patches.append(ExportedPatch(name, digest, state))
    rendered_names = {name for name, _ in rendered}
    for patch in exported(series):
        if patch.ledger_file not in rendered_names:
            result.patches.append(ExportedPatch(patch.ledger_file, "", "missing"))
    return result


def update_ledger(series_path: Path, file_name: str, digest: str) -> None:
    """Rewrite the sha256 of ``file_name``'s entry in series.toml, keeping everything else."""
    text = series_path.read_text(encoding="utf-8")
    pattern = re.compile(
        rf'(file = "{re.escape(file_name)}"\s*\nsha256 = ")[0-9a-f]{{64}}(")', re.M
    )
    new, count = pattern.subn(rf"\g<1>{digest}\g<2>", text)
    if count != 1:
        raise SeriesError(
            f'{series_path}: expected `file = "{file_name}"` followed by its sha256 line'
        )
    atomic_write_text(series_path, new)


def export_patches(work_dir: Path, series: Series) -> ExportResult:
    """Write the work tree's commits over patches/ and update the ledger's digests."""
    patches_dir = series.path.parent
    repo = worktree.made_tree(work_dir)
    if repo is None:
        raise SeriesError(
            f"{work_dir}: not a work tree made by `tooling patch` (no git repository with "
            "its baseline tag); give --work-dir one, or run `tooling patch` first"
        )
    rendered = render_patches(repo)
    if series.base is not None:
        # Only a port is written for a ported base: a commit named after a patch file of the
        # validated line would write that base's copy over the validated line's patch.
        stray = [name for name, _ in rendered if not name.startswith(f"{series.base}/")]
        if stray:
            raise SeriesError(
                f"{work_dir}: a commit names {stray[0]}, which is no port of {series.base} "
                f"(a port's Patch-File trailer is {series.base}/NAME); nothing is written"
            )
    result = compare(rendered, patches_dir, series)
    missing = [p.file for p in result.patches if p.state == "missing"]
    if missing:
        # Written anyway, patches/ would keep those files and the ledger would still list
        # them: the export would not be the tree's series. Nothing is written.
        raise SeriesError(
            f"{work_dir}: no commit carries {len(missing)} of the ledger's patches "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): finish `tooling "
            "patch`, or take them out of series.toml first"
        )
    for (name, data), exported in zip(rendered, result.patches, strict=False):
        if exported.state == "unchanged":
            continue
        logger.debug("export %s (%s)", patches_dir / name, exported.state)
        with atomic_output(patches_dir / name) as f:
            f.write(data)
        if exported.state == "updated":
            update_ledger(series.path, name, exported.sha256)
    return result


def check_export(upstream: Upstream, series: Series, baselines: Path | None = None) -> ExportResult:
    """Apply the series to a scratch tree and compare its export with patches/ (no writes).

    With ``baselines`` (the cache's folder) the scratch tree is a clone of the release's
    cached baseline commit, as ``patch`` and ``build`` make theirs, rather than a copy
    whose thousands of files are hashed and committed again on every check."""
    series = series.for_base(upstream.base.version, strict=False)
    with tempfile.TemporaryDirectory(prefix=run_prefix("dflash-export-")) as tmp:
        work = Path(tmp) / "work"
        # On a ported base a fix not yet decided there conflicts: its ports are still checked.
        options = ApplyOptions(
            probe_python=None,
            log_dir=Path(tmp) / "logs",
            baselines=baselines,
            keep_going=series.base is not None,
        )
        logger.debug("check the export on a scratch tree %s", work)
        apply_series(upstream, series, work, options)
        rendered = render_patches(git.Repo(work))
    return replace(compare(rendered, series.path.parent, series), check=True)
