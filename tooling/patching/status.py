"""The forward canary: the status of every patch on every pinned release.

Each base gets a scratch work tree and the full apply engine (text checks
and probes before and after), so a cell says what ``tooling patch`` would
do there: applied, already-applied, superseded or conflict, and flags a
patch that goes in but does not change behaviour.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import PatchConflictError, ProbeError, ToolingError, error_for_exit_code
from ..fetching.bases import Base
from ..fetching.fetch import FetchOptions
from ..fetching.upstream import fetch_upstream
from ..probing import scratch_folder
from .apply import NO_PROBE_PYTHON, ApplyOptions, apply_series
from .outcome import SeriesReport
from .series import Series

logger = logging.getLogger(__name__)


@dataclass
class BaseStatus:
    base: str
    report: SeriesReport | None
    error: str | None = None
    """Why the release has no report (it could not be fetched or patched)."""
    exit_code: int = ToolingError.exit_code
    """That error's own exit code."""

    def cell(self, patch_id: str) -> str:
        if self.report is None:
            return "error"
        outcome = self.report.outcome(patch_id)
        return outcome.status + ("!" if outcome.problem else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "error": self.error,
            "report": self.report.to_json() if self.report else None,
        }


def base_status(
    base: Base, series: Series, fetch: FetchOptions, options: ApplyOptions, scratch: Path
) -> BaseStatus:
    logger.debug("status of the series on vLLM %s", base.version)
    try:
        upstream = fetch_upstream(base, fetch, with_wheel=False)
        work = scratch / f"vllm-{base.version}"
        report = apply_series(
            upstream,
            series,
            work,
            replace(options, keep_going=True, log_dir=scratch / f"logs-{base.version}"),
        )
        return BaseStatus(base.version, report)
    except ToolingError as e:
        logger.debug("vLLM %s: %s", base.version, e)
        return BaseStatus(base.version, None, error=str(e), exit_code=e.exit_code)


@dataclass
class Canary:
    """``patch status``: the matrix, how long it took, and the verdict on it."""

    series: Series
    results: list[BaseStatus]
    seconds: float
    probed: bool = True
    """False under --no-probes: text only, so a patch upstream superseded reads conflict,
    and no applied patch was checked by behaviour."""

    @property
    def unchecked(self) -> list[BaseStatus]:
        """Releases with no status: no answer, which is no pass."""
        return [r for r in self.results if r.report is None]

    @property
    def ok(self) -> bool:
        """Newer releases only report; the series' validated base must apply cleanly, and
        every release must have been looked at."""
        validated = next((r for r in self.results if r.base == self.series.validated_base), None)
        clean = validated is None or (validated.report is not None and validated.report.ok)
        return clean and not self.unchecked

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "probed": self.probed,
            "seconds": self.seconds,
            "patches": [p.id for p in self.series.patches],
            "bases": [r.to_json() for r in self.results],
        }

    def raise_unless_ok(self) -> None:
        if self.unchecked:
            first = self.unchecked[0]
            raise error_for_exit_code(
                first.exit_code,
                f"{len(self.unchecked)} of {len(self.results)} releases reached no status; "
                f"{first.base}: {first.error}",
            )
        if not self.ok:
            raise PatchConflictError(
                "the series does not apply cleanly on its validated base "
                f"{self.series.validated_base}"
            )


def canary(
    bases: list[Base],
    series: Series,
    fetch: FetchOptions,
    options: ApplyOptions,
    *,
    workers: int = 2,
    on_done: Callable[[BaseStatus], object] | None = None,
    require_probes: bool = True,
) -> Canary:
    """Status of every patch on every base, in the order of ``bases``, timed, with its
    verdict. Without a probe interpreter a superseded patch cannot be told from a conflict:
    a ProbeError unless not ``require_probes`` (--no-probes), which the result then says."""
    if require_probes and options.probe_python is None:
        raise ProbeError(NO_PROBE_PYTHON)
    started = time.perf_counter()
    with scratch_folder("dflash-status-", options.pycache) as scratch:

        def one(base: Base) -> BaseStatus:
            result = base_status(base, series, fetch, options, scratch)
            if on_done:
                on_done(result)
            return result

        pool = ThreadPoolExecutor(max_workers=max(1, workers))
        try:
            results = list(pool.map(one, bases))
        finally:
            # Stopped (a signal), the releases not started yet are dropped: only those
            # running finish, not every one queued.
            pool.shutdown(wait=True, cancel_futures=True)
    return Canary(
        series, results, time.perf_counter() - started, probed=options.probe_python is not None
    )
