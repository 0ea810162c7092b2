"""What ``tooling smoke`` was asked for, carried out: the wheel under test installed and put
first, then the trained pair's acceptance table, a dry run's plan, or the smoke run itself; the
stage's one entry for the command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..fsutil import check_creatable
from .config import SmokeConfig
from .plan import render
from .report import format_table
from .runner import describe_plan, run_smoke
from .site import install_for_smoke, parse_engines, put_first

#: Each engine process of ``--trained-hybrid`` (start, the checks, speed) ends within this,
#: unless --time-limit says otherwise.
TRAINED_ENGINE_LIMIT_S = 900.0


@dataclass(frozen=True)
class SmokeRequest:
    config: SmokeConfig
    """What to run; its ``other_site`` is the --stock-site given (a ``stock_wheel`` fills it)."""
    cache_dir: Path
    """The artifact cache (where a trained pair is kept)."""
    wheel: Path | None = None
    """A vLLM wheel to install (no deps) and test instead of this interpreter's vLLM."""
    stock_wheel: Path | None = None
    """Another vLLM wheel to install for the warm-cache check."""
    trained: bool = False
    """The acceptance table on the trained pair instead of the smoke run."""
    trained_hybrid: bool = False
    """The hybrid pair's acceptance, strict lossless check and speed instead of the smoke run."""
    engines: tuple[str, ...] = ()
    """With ``trained`` or ``trained_hybrid``: ``NAME=DIR`` vLLM installs to measure."""
    dry_run: bool = False


@dataclass(frozen=True)
class SmokeOutcome:
    data: dict[str, Any]
    """The JSON document."""
    text: str
    """The same for people."""
    failure: str | None = None
    """Why the run failed, once its result is shown."""


def smoke_requested(
    request: SmokeRequest, notify: Callable[[str], None] | None = None
) -> SmokeOutcome:
    """Run ``request``; ``notify`` hears the smoke run's progress lines."""
    config = request.config
    workdir = config.workdir
    if request.stock_wheel is not None and config.other_site is not None:
        raise SmokeError("give --stock-site or --stock-wheel, not both")
    if request.engines and not (request.trained or request.trained_hybrid):
        raise SmokeError("--engine names installs for --trained or --trained-hybrid: add one")
    if request.dry_run:
        if request.trained or request.trained_hybrid:
            raise SmokeError(
                "--dry-run prints a smoke's plan, which --trained and --trained-hybrid do not "
                "make: drop one of them"
            )
        # A plan writes nothing: no workdir, no install of --wheel.
        plan = describe_plan(config)
        return SmokeOutcome({"ok": True, "plan": plan.to_json()}, render(plan))
    check_creatable(workdir, "--workdir", SmokeError)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.wheel is not None:
        put_first(install_for_smoke(request.wheel.resolve(), workdir / "site"))
    if request.trained:
        from .trained import measure_trained

        measured = measure_trained(workdir, parse_engines(request.engines), request.cache_dir)
        failed = ", ".join(measured.failed)
        return SmokeOutcome(
            measured.data,
            measured.table,
            f"engines failed to run: {failed} (logs in {workdir})" if failed else None,
        )
    if request.trained_hybrid:
        from .trained import measure_trained_hybrid

        hybrid = measure_trained_hybrid(
            workdir,
            parse_engines(request.engines),
            request.cache_dir,
            config.timeouts.total or TRAINED_ENGINE_LIMIT_S,
        )
        return SmokeOutcome(
            hybrid.data,
            hybrid.text,
            None if hybrid.ok else f"the trained hybrid pair's checks failed (see {workdir})",
        )
    if request.stock_wheel is not None:
        stock_site = install_for_smoke(request.stock_wheel.resolve(), workdir / "stock-site")
        config = replace(config, other_site=str(stock_site.resolve()))
    report = run_smoke(config, notify=notify)
    return SmokeOutcome(
        report.to_json(), format_table(report), None if report.passed else report.summary_line()
    )
