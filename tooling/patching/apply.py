"""Apply the patch series to an upstream tree, one commit per patch, and say what happened.

For each patch one status is decided, from three observations made before
anything is written: does the patch apply forward, does it apply in reverse,
and does the base already behave as fixed (its probe). ``outcome.decide`` is the pure
rule; ``apply_series`` gathers the observations and carries the decision out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import git

from ..errors import SeriesError, WorkTreeError
from ..fetching.upstream import Upstream
from ..fsutil import atomic_write_text
from ..gitutil import git_error_summary
from ..probing import (
    PRESENT,
    ProbeHost,
    ProbeResult,
    ProbeRun,
    ProbeTarget,
    run_probes,
    start_probes,
)
from . import worktree
from .hunks import parse_diff, place_hunk
from .outcome import (
    ALREADY_APPLIED,
    APPLIED,
    CONFLICT,
    NOT_ATTEMPTED,
    NOT_NEEDED,
    SKIPPED,
    SUPERSEDED,
    PatchOutcome,
    SeriesReport,
    decide,
)
from .series import CodeState, Patch, Series

logger = logging.getLogger(__name__)

REPORT_FILE = "dflash-series.json"
#: git apply's words for a patch file it cannot parse (a ledger problem, not a conflict).
_MALFORMED = re.compile(
    r"(corrupt patch at line \d+|patch with only garbage at line \d+|"
    r"patch fragment without header at line \d+|No valid patches in input)"
)


#: Why a command that needs the probes' verdicts stops before it starts without them.
NO_PROBE_PYTHON = (
    "no probe interpreter: run `tooling probe-env`, set "
    "TOOLING_PROBE_PYTHON or pass --probe-python (or --no-probes)"
)


@dataclass(frozen=True)
class ApplyOptions:
    probe_python: Path | None
    three_way: bool = False
    keep_going: bool = False
    preimages: tuple[bytes, ...] = ()
    """Blobs of the validated base's files, seeded for ``--3way`` on other bases."""
    log_dir: Path | None = None
    pycache: Path | None = None
    probe_cache: Path | None = None
    """Where probe verdicts are kept (``ProbeTarget.cache``); None: every run probes."""
    baselines: Path | None = None
    """Where a source's baseline commit is made once (``worktree.baseline_repo``); None:
    every new tree hashes and commits its files itself."""

    def probe_target(self, root: Path) -> ProbeTarget | None:
        if self.probe_python is None:
            return None
        return ProbeTarget(
            python=self.probe_python, root=root, pycache=self.pycache, cache=self.probe_cache
        )


def describe_conflict(repo_dir: Path, patch: Patch) -> list[str]:
    """One line per hunk that does not stand where the patch expects it."""
    text = patch.file.read_text(encoding="utf-8", errors="replace")
    lines: list[str] = []
    for file_diff in parse_diff(text):
        target = repo_dir / (file_diff.old_path or file_diff.path)
        if not target.is_file():
            lines.append(f"{file_diff.path}: file is missing from the base")
            continue
        content = target.read_text(encoding="utf-8", errors="replace").splitlines()
        for hunk in file_diff.hunks:
            placement = place_hunk(content, hunk)
            if placement.found_at is None or placement.moved_by:
                lines.append(placement.describe())
    return lines


def _probe(results: dict[str, ProbeResult] | None, patch: Patch) -> ProbeResult | None:
    return results.get(patch.probe) if results else None


def _as_json(result: ProbeResult | None) -> dict[str, Any] | None:
    return result.to_json() if result else None


def create_work_tree(upstream: Upstream, work_dir: Path, baselines: Path | None = None) -> git.Repo:
    """A fresh tree at ``work_dir``; callers sharing it hold ``locked(work_dir)``.

    A write that fails (a full disk) is a WorkTreeError naming the tree; the
    staging folder is already gone by then.
    """
    try:
        if upstream.git is not None:
            return worktree.create_from_clone(upstream.git.clone, upstream.git.commit, work_dir)
        message = (
            f"upstream vLLM {upstream.base.version} ({upstream.base.sdist.filename})\n\n"
            f"sdist sha256 {upstream.base.sdist.sha256}\n"
        )
        return worktree.create_from_tree(upstream.source_dir, work_dir, message, baselines)
    except shutil.Error as e:
        # copytree gathers one (source, target, why) per file; the first says it.
        why = re.search(r"\[Errno \d+\] ([^:']+)", str(e.args[0][0][2]))
        reason = why.group(1) if why else str(e.args[0][0][2])
    except OSError as e:
        reason = e.strerror or str(e)
    except git.GitCommandError as e:
        reason = git_error_summary(e)
    raise WorkTreeError(f"cannot create the work tree {work_dir}: {reason}")


def apply_series(
    upstream: Upstream, series: Series, work_dir: Path, options: ApplyOptions
) -> SeriesReport:
    """Create ``work_dir`` from ``upstream`` and apply ``series`` to it.

    The probe runs (the base, a 3-way merge's check, the patched tree) share one
    interpreter start (``tooling.probing.host``). On a ported base each fix brings the code
    the ledger names there (``Series.for_base``; a build resolves it strictly first).
    """
    series = series.for_base(upstream.base.version, strict=False)
    host = ProbeHost(options.probe_python, options.pycache) if options.probe_python else None
    with host or contextlib.nullcontext():
        return _apply_series(upstream, series, work_dir, options, host)


def _apply_series(
    upstream: Upstream,
    series: Series,
    work_dir: Path,
    options: ApplyOptions,
    host: ProbeHost | None,
) -> SeriesReport:
    log_dir = options.log_dir or work_dir.parent / f"{work_dir.name}.logs"
    probe_target = options.probe_target(upstream.source_dir)
    before_run = (
        start_probes(probe_target, series.probes, log=log_dir / "probes-base.log", host=host)
        if probe_target
        else None
    )
    repo = None
    try:
        saved = worktree.clear_way(work_dir)
        repo = create_work_tree(upstream, work_dir, options.baselines)
        if options.three_way and options.preimages:
            worktree.seed_preimages(repo, list(options.preimages))
        return _patch_tree(
            upstream, series, work_dir, options, host, repo, before_run, saved, log_dir
        )
    except BaseException:
        # The base probes must not outlive a failed run (nor their temp folder).
        if before_run is not None:
            before_run.close()
        # A tree this run made is not left half-patched under the real name, where `patch
        # export` would take it for the series (a conflict is no exception: its tree stays).
        if repo is not None and work_dir.exists():
            with contextlib.suppress(OSError):  # the first error is the one to report
                worktree.discard(work_dir)
        raise


def _patch_tree(
    upstream: Upstream,
    series: Series,
    work_dir: Path,
    options: ApplyOptions,
    host: ProbeHost | None,
    repo: git.Repo,
    before_run: ProbeRun | None,
    saved: Path | None,
    log_dir: Path,
) -> SeriesReport:
    """Apply ``series`` to the fresh tree ``repo`` at ``work_dir``, probe it and save the
    report."""
    before = before_run.wait() if before_run else None

    outcomes: list[PatchOutcome] = []
    stopped = False
    for patch in series.patches:
        outcome = PatchOutcome(
            patch_id=patch.id,
            patch_file=patch.ledger_file,
            sha256=patch.sha256,
            status=NOT_ATTEMPTED,
            message="not attempted: an earlier patch conflicted",
            probe_before=_as_json(_probe(before, patch)),
        )
        outcomes.append(outcome)
        if stopped:
            continue
        _apply_one(repo, work_dir, patch, outcome, _probe(before, patch), options, log_dir, host)
        if outcome.status == CONFLICT and not options.keep_going:
            stopped = True
    for skipped in series.skipped:
        outcomes.append(
            PatchOutcome(
                patch_id=skipped,
                patch_file="",
                sha256="",
                status=SKIPPED,
                message="skipped on request (--skip)",
            )
        )

    patched_target = options.probe_target(work_dir)
    if patched_target is not None:
        after = run_probes(
            patched_target, series.probes, log=log_dir / "probes-patched.log", host=host
        )
        for patch, outcome in zip(series.patches, outcomes, strict=False):
            result = _probe(after, patch)
            outcome.probe_after = _as_json(result)
            if outcome.status in (APPLIED, ALREADY_APPLIED, SUPERSEDED) and (
                result is None or result.status != PRESENT
            ):
                outcome.problem = (
                    f"probe {patch.probe} reads {result.status if result else 'nothing'} "
                    f"after the series: {result.evidence if result else ''}"
                )

    report = SeriesReport(
        base=upstream.base.version,
        source=upstream.source,
        upstream_identity=upstream.identity,
        series_digest=series.digest,
        work_dir=str(work_dir),
        baseline=repo.rev_parse(worktree.BASELINE_TAG).hexsha,
        head=repo.head.commit.hexsha,
        outcomes=outcomes,
        probe_python=str(options.probe_python) if options.probe_python else None,
        saved_work=str(saved) if saved else None,
    )
    save_report(work_dir, report)
    return report


def _apply_one(
    repo: git.Repo,
    work_dir: Path,
    patch: Patch,
    outcome: PatchOutcome,
    probe_before: ProbeResult | None,
    options: ApplyOptions,
    log_dir: Path,
    host: ProbeHost | None,
) -> None:
    if patch.expect in (CodeState.SUPERSEDED, CodeState.NOT_NEEDED):
        _as_declared(patch, outcome, probe_before)
        return
    forward_ok, complaint = worktree.apply_check(repo, patch.file)
    if not forward_ok and (malformed := _MALFORMED.search(complaint)):
        raise SeriesError(
            f"patch {patch.id}: {patch.ledger_file} is not a valid patch ({malformed.group(0)})"
        )
    reverse_ok = False if forward_ok else worktree.apply_check(repo, patch.file, reverse=True)[0]
    status = decide(forward_ok, reverse_ok, probe_before.status if probe_before else None)
    trailers = {worktree.TRAILER_FILE: patch.ledger_file, worktree.TRAILER_SHA: patch.sha256}
    outcome.status = status
    logger.debug("patch %s: %s", patch.id, status)
    if status == APPLIED:
        outcome.commit = worktree.am(repo, patch.file, trailers)
        outcome.method = "strict"
        outcome.message = f"applied as {outcome.commit[:12]}"
    elif status == ALREADY_APPLIED:
        outcome.message = "already in the base: the patch reverses cleanly; not applied again"
    elif status == SUPERSEDED:
        assert probe_before is not None
        outcome.message = (
            f"superseded upstream: the base already behaves as fixed "
            f"({probe_before.evidence}); not applied"
        )
    else:
        outcome.conflicts = describe_conflict(work_dir, patch) or [complaint.splitlines()[-1]]
        outcome.message = "does not apply: " + "; ".join(outcome.conflicts)
        if options.three_way:
            _try_three_way(repo, work_dir, patch, outcome, trailers, options, log_dir, host)


def _as_declared(patch: Patch, outcome: PatchOutcome, probe_before: ProbeResult | None) -> None:
    """A fix the ledger says a ported base does not need, or already has. Superseded is a
    claim about behaviour: it holds only where the probe reads present on the base, and is a
    conflict otherwise. Without probes (``--no-probes``) it cannot be checked, and says so."""
    assert patch.code is not None
    if patch.expect is CodeState.NOT_NEEDED:
        outcome.status = NOT_NEEDED
        outcome.message = f"not needed on {patch.base}: {patch.code.why}"
        return
    if probe_before is None:
        outcome.status = SUPERSEDED
        outcome.message = f"superseded by the ledger, not checked (no probes): {patch.code.why}"
    elif probe_before.status == PRESENT:
        outcome.status = SUPERSEDED
        outcome.message = (
            f"superseded upstream: the base already behaves as fixed ({probe_before.evidence}); "
            "as the ledger says"
        )
    else:
        outcome.status = CONFLICT
        outcome.conflicts = [f"probe {patch.probe} reads {probe_before.status}"]
        outcome.message = (
            f"series.toml says superseded here, but probe {patch.probe} reads "
            f"{probe_before.status}: {probe_before.evidence}"
        )


def _try_three_way(
    repo: git.Repo,
    work_dir: Path,
    patch: Patch,
    outcome: PatchOutcome,
    trailers: dict[str, str],
    options: ApplyOptions,
    log_dir: Path,
    host: ProbeHost | None,
) -> None:
    """Fall back to a 3-way merge; keep it only if the patch's probe then reads present."""
    previous = repo.head.commit.hexsha
    try:
        commit = worktree.am(repo, patch.file, trailers, three_way=True)
    except git.GitCommandError as e:
        outcome.message += f"; --3way failed too: {git_error_summary(e)}"
        return
    target = options.probe_target(work_dir)
    if target is None:
        worktree.reset_to(repo, previous)
        outcome.message += "; --3way merged, but no probe interpreter can confirm it: dropped"
        return
    log = log_dir / f"probes-3way-{patch.id}.log"
    result = run_probes(target, (patch.probe,), log=log, host=host)[patch.probe]
    if result.status != PRESENT:
        worktree.reset_to(repo, previous)
        outcome.message += f"; --3way merged, but its probe reads {result.status}: dropped"
        return
    outcome.status = APPLIED
    outcome.method = "3way"
    outcome.commit = commit
    outcome.message = f"applied by 3-way merge as {commit[:12]} (probe: {result.evidence})"


def report_path(work_dir: Path) -> Path:
    return work_dir / ".git" / REPORT_FILE


def save_report(work_dir: Path, report: SeriesReport) -> None:
    atomic_write_text(report_path(work_dir), json.dumps(report.to_json(), indent=2) + "\n")


@contextlib.contextmanager
def forgotten_on_error(work_dir: Path) -> Iterator[None]:
    """On an error, ``work_dir``'s saved report goes: the tree is applied afresh by the next
    run rather than reused (its baseline was made from a source found changed)."""
    try:
        yield
    except BaseException:
        report_path(work_dir).unlink(missing_ok=True)
        raise


def load_report(work_dir: Path) -> SeriesReport | None:
    """The report ``tooling patch`` saved in ``work_dir``; None when there is none, and a
    WorkTreeError naming it (and the way out) when it does not read back."""
    path = report_path(work_dir)
    if not path.is_file():
        return None
    try:
        return SeriesReport.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        raise WorkTreeError(
            f"{path}: the work tree's series report is damaged ({why}); run "
            f"`tooling patch --work-dir {work_dir}` to make the tree again (work of yours "
            "in it is moved aside)"
        ) from None


def reusable_report(work_dir: Path, upstream: Upstream, series: Series) -> SeriesReport | None:
    """The saved report when ``work_dir`` is exactly this series on this upstream, else None."""
    report = load_report(work_dir)
    if report is None or not report.ok:
        return None
    series = series.for_base(upstream.base.version, strict=False)
    if (report.upstream_identity, report.series_digest) != (upstream.identity, series.digest):
        return None
    repo = git.Repo(work_dir)
    if repo.head.commit.hexsha != report.head or repo.is_dirty(untracked_files=False):
        return None
    return report


def default_tree(upstream: Upstream, series: Series) -> Path:
    """The work tree ``tooling patch`` and ``tooling build`` use for this series on ``upstream``
    unless told otherwise (``worktree.default_work_dir``), absolute."""
    commit = upstream.git.commit if upstream.git else None
    return worktree.default_work_dir(upstream.base.version, commit, series.skipped).resolve()


def ensure_patched(
    upstream: Upstream,
    series: Series,
    work_dir: Path,
    options: ApplyOptions,
    *,
    require_probes: bool,
    on_applied: Callable[[SeriesReport], None] = lambda _report: None,
) -> SeriesReport:
    """The applied series for ``upstream`` in ``work_dir`` (locked by the caller): the saved
    report when the tree is current, else the series applied afresh (``on_applied`` sees that
    report first) and PatchConflictError unless every patch went in."""
    if work_dir.is_dir():
        report = reusable_report(work_dir, upstream, series)
        if report is not None and (report.probe_python or not require_probes):
            logger.debug("%s: the series is applied already (its saved report)", work_dir)
            return report
    report = apply_series(upstream, series, work_dir, options)
    on_applied(report)
    report.raise_unless_ok()
    return report
