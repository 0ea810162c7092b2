"""What ``tooling patch`` and ``tooling patch export`` were asked for, carried out: the upstream
fetched, the series applied in its locked work tree, or the work tree's commits exported (or the
export checked); the stage's entries for the commands, and the apply options every command that
applies the series builds the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import SeriesError
from ..fetching.bases import BaseCatalog, load_bases
from ..fetching.fetch import FetchOptions
from ..fetching.upstream import SourceRequest, fetch_requested, fetch_upstream
from ..fsutil import locked
from ..probing.env import resolve_probe_python
from .apply import ApplyOptions, apply_series
from .export import ExportResult, check_export, export_patches
from .outcome import SeriesReport
from .series import Series, load_ledger
from .worktree import check_work_dir, default_work_dir

logger = logging.getLogger(__name__)


def three_way_preimages(
    series: Series, catalog: BaseCatalog, options: FetchOptions
) -> tuple[bytes, ...]:
    """For ``--3way``: the validated base's copies of every file the series touches (fetched,
    source only), the blobs a 3-way merge on another base needs."""
    if not series.validated_base:
        return ()
    validated = fetch_upstream(catalog.get(series.validated_base), options, with_wheel=False)
    return tuple(
        (validated.source_dir / f).read_bytes()
        for p in series.patches
        for f in p.files
        if (validated.source_dir / f).is_file()
    )


def apply_options(
    series: Series,
    catalog: BaseCatalog,
    fetch: FetchOptions,
    probe_python: Path | None,
    *,
    three_way: bool = False,
    keep_going: bool = False,
    probes: bool = True,
) -> ApplyOptions:
    """How to apply ``series``: the probe interpreter (``probe_python`` as given, else the
    configured one; none when not ``probes``) and, for ``three_way``, the preimages fetched."""
    preimages: tuple[bytes, ...] = ()
    if three_way:
        preimages = three_way_preimages(series, catalog, fetch)
    return ApplyOptions(
        probe_python=resolve_probe_python(probe_python, fetch.cache) if probes else None,
        three_way=three_way,
        keep_going=keep_going,
        preimages=preimages,
        pycache=fetch.cache.root / "pycache",
        probe_cache=fetch.cache.probes,
        baselines=fetch.cache.baselines,
    )


@dataclass(frozen=True)
class PatchRequest:
    source: SourceRequest
    catalog: BaseCatalog
    fetch: FetchOptions
    series: Series
    """The series to apply, without the patches left out."""
    work_dir: Path | None = None
    """The work tree (default: build/work/vllm-<base>...)."""
    probe_python: Path | None = None
    """--probe-python as given (default: $TOOLING_PROBE_PYTHON, else the cached probe env)."""
    three_way: bool = False
    keep_going: bool = False


def patch_requested(request: PatchRequest) -> SeriesReport:
    """The series applied to the requested upstream in its work tree (locked meanwhile)."""
    check_work_dir(request.work_dir)
    series = request.series
    upstream = fetch_requested(request.catalog, request.source, request.fetch, with_wheel=False)
    options = apply_options(
        series,
        request.catalog,
        request.fetch,
        request.probe_python,
        three_way=request.three_way,
        keep_going=request.keep_going,
    )
    git_commit = upstream.git.commit if upstream.git else None
    work = (
        request.work_dir or default_work_dir(upstream.base.version, git_commit, series.skipped)
    ).resolve()
    with locked(work):
        logger.debug("apply %d patches in %s", len(series.patches), work)
        return apply_series(upstream, series, work, options)


def export_requested(
    source: SourceRequest,
    fetch: FetchOptions,
    patches_dir: Path,
    work_dir: Path | None,
    *,
    check: bool = False,
) -> ExportResult:
    """The work tree's commits written over ``patches_dir``; with ``check``, the series applied
    to a scratch tree of ``source`` (default: the validated base) and compared instead."""
    if check:
        series = load_ledger(patches_dir)
        # Unless told one base: the validated base's patches and every ported base's ports.
        bases = (
            [source.base_version]
            if source.base_version
            else [series.validated_base, *series.ported_bases]
        )
        catalog = load_bases(patches_dir / "bases.toml")
        result = ExportResult(check=True)
        for base in bases:
            upstream = fetch_requested(
                catalog,
                replace(source, base_version=base),
                fetch,
                with_wheel=False,
            )
            result.patches += check_export(upstream, series, fetch.cache.baselines).patches
        return result
    # The work tree's commits are the truth here: the ledger's digests are about to change.
    series = load_ledger(patches_dir, check_digests=False)
    base = f"{source.base_version or series.validated_base}"
    # A ported base's tree carries its ports: they are what the export writes.
    series = series.for_base(base, strict=False)
    work = Path(work_dir or default_work_dir(base))
    with locked(work.resolve()):
        if not work.is_dir():
            raise SeriesError(f"{work}: no work tree to export (run `tooling patch` first)")
        logger.debug("export the commits of %s over %s", work, patches_dir)
        return export_patches(work, series)
