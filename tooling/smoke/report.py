"""The smoke's result: a summary table for people, JSON for machines, a PNG of acceptance."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import atomic_output, atomic_write_text
from .checks import (
    AUX_LAYERS,
    DRAFTER_WINDOWS,
    ERROR,
    FAIL,
    FIDELITY,
    FIRST_TOKENS,
    LOSSLESS,
    ORDER,
    PASS,
    PENDING,
    PREFIX_CACHE,
    SKIP,
    SLOT_AUDIT,
    WARM_CACHE,
    CheckResult,
)

logger = logging.getLogger(__name__)

FIXED = "fixed"
STOCK = "stock"
# What stock vLLM 0.20.1 does (upstream-notes section 7): lossless, but every
# fix check fails. ``--expect stock`` turns the smoke into a negative control.
# The warm-cache and slot-audit checks fail on stock too (no fix 1, no fix 4),
# when they ran (skipped checks are not held against the control).
STOCK_FAILS = (AUX_LAYERS, DRAFTER_WINDOWS, PREFIX_CACHE, FIDELITY, WARM_CACHE, SLOT_AUDIT)
# The first tokens of a (K+1)-token prompt on a hybrid target are wrong on stock (the
# step runs as a uniform decode and never writes the recurrent state); on an
# attention-only target stock computes them right.


@dataclass
class StepRecord:
    """One step of the run (models, a server, a child): how long, how it ended, its log."""

    name: str
    seconds: float
    ok: bool
    message: str = ""
    log: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    started_s: float | None = None
    """When the step began, seconds after the run's start: steps overlap, so the run's
    critical path is read from these, not from the durations."""


@dataclass
class SmokeReport:
    """Everything a smoke run found."""

    checks: list[CheckResult]
    steps: list[StepRecord]
    workdir: Path
    models: dict[str, Any]
    engine: dict[str, Any]
    vllm: dict[str, Any] = field(default_factory=dict)
    plot: Path | None = None
    expect: str = FIXED
    """``fixed``: every check must pass. ``stock``: 1 must pass and 2-5 must fail."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The plan the run executed (``plan.SmokePlan.to_json``), as ``--dry-run`` prints it."""
    incomplete: str = ""
    """Empty once the run is over; while it goes on, how far it got (``wave 2 of 4 done``):
    the report written after each wave, so a run cut short keeps the verdicts it reached."""

    @property
    def passed(self) -> bool:
        """True when the run is over and the checks came out as ``expect`` says (info and
        skip never fail)."""
        return not self.incomplete and not self.unexpected()

    def unexpected(self) -> list[CheckResult]:
        """The checks whose outcome differs from the expectation."""
        if self.expect == STOCK:
            hybrid = bool((self.models.get("target_info") or {}).get("hybrid"))
            return [
                c
                for c in self.checks
                if (c.id in STOCK_FAILS and c.status not in (FAIL, SKIP))
                or (c.id == LOSSLESS and c.status not in (PASS, SKIP))
                or (c.id == FIRST_TOKENS and c.status not in (FAIL if hybrid else PASS, SKIP))
            ]
        return self.failed()

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status in (FAIL, ERROR)]

    def summary_line(self) -> str:
        """One line: the verdict and which checks did not come out as expected."""
        where = self.workdir / "report.json"
        if self.incomplete:
            ordered = sorted(self.checks, key=lambda c: c.number)
            so_far = ", ".join(f"{c.number} {c.status}" for c in ordered if c.status != PENDING)
            pending = ", ".join(str(c.number) for c in ordered if c.status == PENDING)
            return (
                f"smoke incomplete, {self.incomplete}: so far {so_far or 'no verdict'}; "
                f"pending {pending or 'none'} (report: {where})"
            )
        if self.expect == STOCK:
            wrong = self.unexpected()
            if not wrong:
                # Name what was measured: a quick run skips the lossless check, and on a
                # hybrid target stock's first tokens fail, so "lossless" is claimed only
                # when that check ran and passed.
                ordered = sorted(self.checks, key=lambda c: c.number)
                failed = ", ".join(f"{c.number} {c.id}" for c in ordered if c.status == FAIL)
                lossless = any(c.id == LOSSLESS and c.status == PASS for c in self.checks)
                tail = "; output lossless" if lossless else ""
                return f"smoke behaved as stock vLLM: failed {failed}{tail} ({where})"
            names = ", ".join(f"{c.number} {c.id} ({c.status})" for c in wrong)
            return f"smoke did not behave as stock vLLM: {names} (report: {where})"
        bad = self.failed()
        if not bad:
            skipped = [str(c.number) for c in self.checks if c.status == SKIP]
            note = f", skipped {', '.join(skipped)}" if skipped else ""
            return f"smoke passed: {len(self.checks)} checks{note} (report: {where})"
        names = ", ".join(f"{c.number} {c.id} ({c.status})" for c in bad)
        return f"smoke failed: {names} (report: {where})"

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "complete": not self.incomplete,
            "incomplete": self.incomplete or None,
            "expect": self.expect,
            "summary": self.summary_line(),
            "checks": [c.to_json() for c in sorted(self.checks, key=lambda c: ORDER.index(c.id))],
            "steps": [s.__dict__ for s in self.steps],
            "models": self.models,
            "engine": self.engine,
            "vllm": self.vllm,
            "workdir": str(self.workdir),
            "plot": str(self.plot) if self.plot else None,
            "plan": self.plan,
        }

    def write_json(self, path: Path | None = None) -> Path:
        """Write the JSON report (default ``workdir/report.json``) atomically; return its path."""
        target = path or self.workdir / "report.json"
        atomic_write_text(target, json.dumps(self.to_json(), indent=2, default=str) + "\n")
        logger.debug("wrote %s", target)
        return target


def format_table(report: SmokeReport, width: int = 110) -> str:
    """A fixed-width summary: one row per check, then the steps and the verdict."""
    rows = []
    title_w = max(len(c.title) for c in report.checks) if report.checks else 10
    for check in sorted(report.checks, key=lambda c: ORDER.index(c.id)):
        line = f"{check.number:>2}  {check.title:<{title_w}}  {check.status.upper():<5}  "
        evidence = check.evidence
        room = max(width - len(line), 20)
        if len(evidence) > room:
            evidence = evidence[: room - 1] + "…"
        rows.append(line + evidence)
    vllm = report.vllm.get("version")
    where = report.vllm.get("location")
    header = f"vLLM {vllm} at {where}" if vllm else "vLLM version unknown"
    steps = "; ".join(f"{s.name} {s.seconds:.0f}s{'' if s.ok else ' FAILED'}" for s in report.steps)
    lines = [header, *rows, f"steps: {steps}"]
    if report.plot:
        lines.append(f"plot: {report.plot}")
    lines.append(report.summary_line())
    return "\n".join(lines)


def plot_acceptance(per_position: list[float], path: Path, title: str) -> Path | None:
    """Bar chart of acceptance per draft position as a PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.debug("no matplotlib: no plot of the acceptance")
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    positions = list(range(1, len(per_position) + 1))
    ax.bar(positions, per_position, color="#3b6ea8")
    for x, y in zip(positions, per_position, strict=True):
        ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(positions)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with atomic_output(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path
