"""A GPU fuzz campaign's report: what ran (engine pairs, workloads, requests, GPU minutes),
what each oracle found, and what was excused; as ``summary.json`` and ``summary.md``, each
rewritten whole after every engine pair, so a stopped campaign leaves a report of what ran."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_text
from ..report import markdown_table
from .gpu_oracles import Evidence

logger = logging.getLogger(__name__)

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"


@dataclass
class Finding:
    kind: str
    detail: str
    engine: str
    number: int
    """The engine pair (the case number of the campaign, or the replayed case's index)."""
    workload: int | None
    file: Path | None = None
    shrunk: bool = False
    excused: tuple[str, ...] = ()
    evidence: tuple[Evidence, ...] = ()
    """Its token differences, for the case file (``gpu_case.GpuCaseFile.evidence``)."""


@dataclass
class CampaignReport:
    found_on: str
    seed: int
    mode: str
    pairs: int = 0
    """Engine pairs started (settings drawn or replayed)."""
    refused: list[str] = field(default_factory=list)
    """Settings vLLM refused at start-up, each with its reason."""
    vetted: int = 0
    """Of ``refused``, those refused by the DFlash engine's config alone, before any engine
    of theirs started (``serving.gpu_vet``): no pair, no GPU time."""
    workloads: int = 0
    requests: int = 0
    gpu_seconds: float = 0.0
    """Wall time of the campaign's engine pairs: both engines of a pair share one GPU."""
    shrink_seconds: float = 0.0
    """Wall time of the engine pairs that served shrinks (not counted in the rate)."""
    findings: list[Finding] = field(default_factory=list)
    excused: int = 0
    """Differences the output oracle excused (near ties), over every workload."""
    cut: int = 0
    """Workloads an engine ended when its pair's time ran out, its steps still returning."""
    acceptance: list[float] = field(default_factory=list)
    """Each engine pair's mean acceptance length."""
    replayed: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def requests_per_gpu_minute(self) -> float:
        return self.requests / (self.gpu_seconds / 60) if self.gpu_seconds else 0.0

    def by_oracle(self) -> dict[str, int]:
        return dict(sorted(Counter(f.kind for f in self.findings).items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.findings and not self.errors and not self.stopped,
            "found_on": self.found_on,
            "seed": self.seed,
            "mode": self.mode,
            "pairs": self.pairs,
            "refused": self.refused,
            "refused_before_start": self.vetted,
            "workloads": self.workloads,
            "requests": self.requests,
            "gpu_minutes": round(self.gpu_seconds / 60, 2),
            "shrink_gpu_minutes": round(self.shrink_seconds / 60, 2),
            "requests_per_gpu_minute": round(self.requests_per_gpu_minute, 2),
            "findings_by_oracle": self.by_oracle(),
            "excused": self.excused,
            "cut": self.cut,
            "acceptance": [round(a, 3) for a in self.acceptance],
            "stopped": self.stopped,
            "errors": self.errors,
            "replayed": self.replayed,
            "findings": [
                {
                    "kind": f.kind,
                    "detail": f.detail,
                    "engine": f.engine,
                    "number": f.number,
                    "workload": f.workload,
                    "file": str(f.file) if f.file else None,
                    "shrunk": f.shrunk,
                    "excused": list(f.excused),
                }
                for f in self.findings
            ],
        }

    def to_markdown(self) -> str:
        head = (
            f"# GPU fuzz campaign, seed {self.seed} ({self.mode})\n\n"
            f"On {self.found_on}: {self.pairs} engine pairs "
            f"({len(self.refused) - self.vetted} refused at start-up; {self.vetted} more "
            f"settings refused by their config, no engine started) x "
            f"{self.workloads} workloads x {self.requests} requests in "
            f"{self.gpu_seconds / 60:.1f} GPU minutes ({self.requests_per_gpu_minute:.1f} "
            f"requests a GPU minute)"
            + (", stopped early" if self.stopped else "")
            + f"; shrinks took {self.shrink_seconds / 60:.1f} GPU minutes more"
            + f"; {self.excused} differences excused as near ties"
            + f"; {self.cut} workloads cut at their pair's time.\n"
        )
        parts = [head]
        if self.findings:
            counts = [[kind, str(n)] for kind, n in self.by_oracle().items()]
            table = "\n".join(markdown_table(["oracle", "findings"], counts))
            parts.append("## Findings by oracle\n\n" + table)
            rows = [
                [
                    f.kind,
                    str(f.number),
                    "-" if f.workload is None else str(f.workload),
                    f.engine,
                    f.detail.replace("|", "/"),
                    f.file.name if f.file else "-",
                ]
                for f in self.findings
            ]
            parts.append(
                "## Findings\n\n"
                + "\n".join(
                    markdown_table(["oracle", "pair", "workload", "engine", "detail", "case"], rows)
                )
            )
        else:
            parts.append("No finding.\n")
        if self.refused:
            parts.append("## Refused at start-up\n\n" + "\n".join(f"- {r}" for r in self.refused))
        if self.errors:
            parts.append("## Errors\n\n" + "\n".join(f"- {e}" for e in self.errors))
        return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"

    def write(self, out_dir: Path) -> None:
        atomic_write_text(out_dir / SUMMARY_JSON, json.dumps(self.to_json(), indent=1) + "\n")
        atomic_write_text(out_dir / SUMMARY_MD, self.to_markdown())
        logger.debug("report written: %s", out_dir / SUMMARY_MD)
