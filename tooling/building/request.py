"""What ``tooling build`` was asked for, carried out: the upstream fetched, the series applied
in its work tree (locked), and the wheel built in the mode asked; the stage's one entry.
"""

from __future__ import annotations

import logging
import platform
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import BuildError
from ..fetching.bases import BaseCatalog
from ..fetching.fetch import FetchOptions
from ..fetching.upstream import SourceRequest, fetch_requested
from ..fsutil import locked
from ..patching.apply import NO_PROBE_PYTHON, ensure_patched
from ..patching.outcome import SeriesReport
from ..patching.request import apply_options
from ..patching.series import Series
from ..patching.worktree import check_work_dir, default_work_dir
from .build import BuildOptions, BuildResult, build_precompiled, source_date_epoch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelRequest:
    source: SourceRequest
    catalog: BaseCatalog
    fetch: FetchOptions
    series: Series
    """The series to apply, without the patches skipped for an ablation."""
    dist_dir: Path
    mode: str = "precompiled"
    """"precompiled" (the official kernels reused) or "source" (vLLM's own build)."""
    work_dir: Path | None = None
    """The work tree (default: build/work/vllm-<base>...)."""
    build_tag: str | None = None
    probe_python: Path | None = None
    """--probe-python as given (default: $TOOLING_PROBE_PYTHON, else the cached probe env)."""
    probes: bool = True
    """False: build without behavioural checks, not even the configured interpreter's."""
    use_precompiled_kernels: bool = False
    """Source mode: vLLM's Python-only build against the cached official wheel."""
    build_python: Path | None = None
    max_jobs: int | None = None
    cuda_arch_list: str = "9.0"
    source_date_epoch: str | None = None
    """``$SOURCE_DATE_EPOCH`` as the command line read it (None: unset), checked here."""


def unprobed(report: SeriesReport) -> SeriesReport:
    """``report`` without probe verdicts: what a build without probes knows of the tree."""
    outcomes = [replace(o, probe_before=None, probe_after=None) for o in report.outcomes]
    return replace(report, outcomes=outcomes, probe_python=None)


@dataclass(frozen=True)
class BuiltWheel:
    result: BuildResult
    report: SeriesReport
    """The series as applied to the tree the wheel was built from."""

    def to_json(self) -> dict[str, Any]:
        result = self.result
        return {
            "ok": True,
            "wheel": str(result.path),
            "filename": result.filename,
            "version": result.version,
            "sha256": result.sha256,
            "size": result.size,
            "mode": result.mode,
            "seconds": result.seconds,
            "patches": [
                {"id": o.patch_id, "status": o.status, "probe": (o.probe_after or {}).get("status")}
                for o in self.report.outcomes
            ],
            "notes": result.notes,
            # Provenance, not part of the wheel: the members the build writes are stored, so
            # neither shapes its bytes, and in the wheel they would make it differ by machine.
            "builder": {"python": platform.python_version(), "zlib": zlib.ZLIB_RUNTIME_VERSION},
        }


def build_requested(
    request: WheelRequest,
    *,
    on_applied: Callable[[SeriesReport], None] = lambda _report: None,
) -> BuiltWheel:
    """Fetch, patch (``on_applied`` sees a fresh series report) and build ``request``'s wheel."""
    if request.dist_dir.exists() and not request.dist_dir.is_dir():
        raise BuildError(f"--dist {request.dist_dir.resolve()} is a file, not a folder")
    # Refused before any work, not after the tree is made.
    epoch = source_date_epoch(request.source_date_epoch)
    if request.use_precompiled_kernels and request.mode != "source":
        raise BuildError("--use-precompiled-kernels goes with --mode source")
    check_work_dir(request.work_dir)
    base = request.source.base_version or request.catalog.default
    # A fix with no code for a ported base is refused before anything is fetched.
    series = request.series.for_base(base, strict=True)
    # Precompiled mode re-verifies the official wheel while it copies (build.py).
    upstream = fetch_requested(
        request.catalog, request.source, request.fetch, verify_wheel=request.mode == "source"
    )
    git_commit = upstream.git.commit if upstream.git else None
    work = (
        request.work_dir or default_work_dir(upstream.base.version, git_commit, series.skipped)
    ).resolve()
    logger.debug("build a %s wheel of vLLM %s in %s", request.mode, upstream.base.version, work)
    # Held until the wheel is written: the build reads the tree's commits after it is patched.
    with locked(work):
        options = apply_options(
            series, request.catalog, request.fetch, request.probe_python, probes=request.probes
        )
        if request.probes and options.probe_python is None:
            raise BuildError(NO_PROBE_PYTHON)
        report = ensure_patched(
            upstream, series, work, options, require_probes=request.probes, on_applied=on_applied
        )
        if not request.probes:
            # A tree an earlier run probed keeps that run's verdicts; a build without probes
            # records none, or its wheel would depend on the tree's history.
            report = unprobed(report)
        if request.mode == "source":
            from .source_build import SourceBuildOptions, build_from_source

            result = build_from_source(
                upstream,
                series,
                report,
                SourceBuildOptions(
                    dist_dir=request.dist_dir,
                    use_precompiled_kernels=request.use_precompiled_kernels,
                    build_tag=request.build_tag,
                    source_date_epoch=epoch,
                    build_python=request.build_python,
                    max_jobs=request.max_jobs,
                    cuda_arch_list=request.cuda_arch_list,
                ),
            )
        else:
            result = build_precompiled(
                upstream,
                series,
                report,
                BuildOptions(
                    dist_dir=request.dist_dir, build_tag=request.build_tag, source_date_epoch=epoch
                ),
            )
    return BuiltWheel(result, report)
