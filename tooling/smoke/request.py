"""What ``tooling smoke`` was asked for: the request every program of the command reads, what
none of them runs refused, the wheel under test installed and put first, and the smoke run (or
a dry run's plan). The trained pairs' programs are ``tooling.trained.request``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..fsutil import check_creatable
from .config import SmokeConfig
from .plan import describe_plan, render
from .report import format_table
from .runner import run_smoke
from .site import install_for_smoke, put_first

logger = logging.getLogger(__name__)


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


def check_request(request: SmokeRequest) -> None:
    """Refuse what no program of the command runs, before anything is written or installed."""
    config = request.config
    if request.stock_wheel is not None and config.other_site is not None:
        raise SmokeError("give --stock-site or --stock-wheel, not both")
    if request.engines and not (request.trained or request.trained_hybrid):
        raise SmokeError("--engine names installs for --trained or --trained-hybrid: add one")
    if request.dry_run and (request.trained or request.trained_hybrid):
        raise SmokeError(
            "--dry-run prints a smoke's plan, which --trained and --trained-hybrid do not "
            "make: drop one of them"
        )


def prepare_workdir(request: SmokeRequest) -> Path:
    """The workdir made, and the wheel under test installed there and put first."""
    workdir = request.config.workdir
    check_creatable(workdir, "--workdir", SmokeError)
    workdir.mkdir(parents=True, exist_ok=True)
    logger.debug("workdir %s", workdir)
    if request.wheel is not None:
        put_first(install_for_smoke(request.wheel.resolve(), workdir / "site"))
    return workdir


def smoke_run_requested(
    request: SmokeRequest, notify: Callable[[str], None] | None = None
) -> SmokeOutcome:
    """The smoke run of a checked ``request`` (``check_request``), or its plan for a dry run;
    ``notify`` hears the run's progress lines."""
    config = request.config
    if request.dry_run:
        # A plan writes nothing: no workdir, no install of --wheel.
        logger.debug("dry run: the plan alone")
        plan = describe_plan(config)
        return SmokeOutcome({"ok": True, "plan": plan.to_json()}, render(plan))
    workdir = prepare_workdir(request)
    if request.stock_wheel is not None:
        stock_site = install_for_smoke(request.stock_wheel.resolve(), workdir / "stock-site")
        config = replace(config, other_site=str(stock_site.resolve()))
    report = run_smoke(config, notify=notify)
    return SmokeOutcome(
        report.to_json(), format_table(report), None if report.passed else report.summary_line()
    )
