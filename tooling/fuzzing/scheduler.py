"""The scheduler fuzzer's campaign: jobs in probe interpreters, their findings saved as cases.

The fuzzer runs inside the probe interpreter, beside the vLLM it questions
(``tooling/probes/_schedfuzz.py``); this module plans a campaign over jobs (case numbers
split into contiguous ranges, each case drawn from the campaign's seed and its number
alone, so a campaign's cases are the same whatever the number of jobs), starts one
interpreter per job, and merges what they wrote. Findings are saved as case files
(``cases``) as soon as the run ends, by a signal too: a job rewrites its results after
every finding, so a stopped campaign keeps every finding made so far.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_text
from ..probing.launch import ProbeTarget, child_env, new_run_folder, remove_run_folder
from ..probing.package import copy_probe_package, probe_command
from ..procs import log_tail, start_group, stop_group
from .cases import CaseFile, validate_case, write_case_file

logger = logging.getLogger(__name__)

MODULE = "_schedfuzz"
SUMMARY = "summary.json"


@dataclass(frozen=True)
class CampaignPlan:
    """What to run: ``cases`` cases of campaign ``seed`` over ``jobs`` interpreters, or the
    ``replay`` cases as they are."""

    seed: int = 0
    cases: int = 1000
    jobs: int = 1
    seconds: float | None = None
    shrink: bool = True
    replay: tuple[CaseFile, ...] = ()

    def job_files(self) -> list[dict[str, Any]]:
        """Each job's instructions (``_schedfuzz``'s JOB file)."""
        if self.replay:
            return [{"replay": [c.case for c in self.replay], "shrink": False, "seconds": None}]
        jobs = max(1, min(self.jobs, self.cases))
        size, extra = divmod(self.cases, jobs)
        out, first = [], 0
        for j in range(jobs):
            count = size + (1 if j < extra else 0)
            out.append(
                {
                    "seed": self.seed,
                    "first": first,
                    "cases": count,
                    "seconds": self.seconds,
                    "shrink": self.shrink,
                }
            )
            first += count
        return out


@dataclass
class Finding:
    kind: str
    detail: str
    case: dict[str, Any]
    """The smallest failing case the shrink found (the drawn one when not shrunk)."""
    drawn: dict[str, Any]
    number: int | None
    facts: dict[str, Any] = field(default_factory=dict)
    saved: Path | None = None


@dataclass
class CampaignResult:
    found_on: str
    cases: int = 0
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    stopped: bool = False
    """Ended by a signal or a failed job before every case ran."""
    errors: list[str] = field(default_factory=list)
    replayed: list[dict[str, Any]] = field(default_factory=list)
    """With ``--replay``: each case's outcome, in the order given."""

    @property
    def cases_per_second(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.findings and not self.errors and not self.stopped,
            "found_on": self.found_on,
            "cases": self.cases,
            "seconds": round(self.seconds, 2),
            "cases_per_second": round(self.cases_per_second, 2),
            "outcomes": dict(sorted(self.outcomes.items())),
            "stopped": self.stopped,
            "errors": self.errors,
            "replayed": self.replayed,
            "findings": [
                {
                    "kind": f.kind,
                    "detail": f.detail,
                    "number": f.number,
                    "file": str(f.saved) if f.saved else None,
                }
                for f in self.findings
            ],
        }


def run_campaign(target: ProbeTarget, plan: CampaignPlan, out_dir: Path) -> CampaignResult:
    """Run ``plan`` against ``target``'s vLLM; findings and ``summary.json`` go to
    ``out_dir``, whatever ends the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = new_run_folder("dflash-schedfuzz-", target.pycache)
    result = CampaignResult(found_on=target.describe())
    started = time.monotonic()
    procs: list[Any] = []
    outputs: list[Path] = []
    try:
        copy_probe_package(workdir)
        env = child_env(target, workdir)
        for j, job in enumerate(plan.job_files()):
            job_file, output = workdir / f"job-{j}.json", workdir / f"out-{j}.json"
            job_file.write_text(json.dumps(job))
            outputs.append(output)
            log = out_dir / "logs" / f"job-{j}.log"
            cmd = probe_command(target.python, MODULE, [str(job_file), str(output)])
            procs.append(start_group(cmd, log=log, env=env, cwd=workdir, truncate_log=True))
            logger.debug("fuzz job %d started, its log %s", j, log)
        for j, proc in enumerate(procs):
            if proc.wait() != 0:
                result.errors.append(
                    f"job {j} exited {proc.returncode}: "
                    f"{log_tail(out_dir / 'logs' / f'job-{j}.log')}"
                )
    except BaseException:
        result.stopped = True
        raise
    finally:
        for proc in procs:
            stop_group(proc, grace_s=2.0)
        result.seconds = time.monotonic() - started
        _merge(result, outputs)
        if result.errors:
            result.stopped = True
        _save(result, out_dir)
        remove_run_folder(workdir, target.pycache)
    return result


def _merge(result: CampaignResult, outputs: list[Path]) -> None:
    for output in outputs:
        try:
            data = json.loads(output.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a job stopped before its first write found nothing yet
        result.cases += int(data.get("cases", 0))
        result.replayed += data.get("replayed", [])
        for kind, count in data.get("outcomes", {}).items():
            result.outcomes[kind] = result.outcomes.get(kind, 0) + int(count)
        for f in data.get("findings", []):
            case = f.get("shrunk") or f["case"]
            detail = f.get("shrunk_detail") or f["detail"]
            result.findings.append(
                Finding(
                    kind=f["kind"],
                    detail=detail,
                    case=case,
                    drawn=f["case"],
                    number=f.get("number"),
                    facts=f.get("shrunk_facts") or f.get("facts", {}),
                )
            )


def _save(result: CampaignResult, out_dir: Path) -> None:
    for i, finding in enumerate(result.findings):
        name = f"finding-{finding.kind}-{finding.number if finding.number is not None else i}"
        path = out_dir / f"{name}.json"
        validate_case(finding.case, str(path))
        write_case_file(path, CaseFile(finding.case, finding.kind, finding.detail, result.found_on))
        finding.saved = path
        logger.debug("finding %s saved: %s", finding.kind, path)
    atomic_write_text(out_dir / SUMMARY, json.dumps(result.to_json(), indent=1) + "\n")
    logger.debug("%d cases in %.1f s, summary: %s", result.cases, result.seconds, out_dir / SUMMARY)
