"""The GPU fuzzer's campaign: engine pairs of drawn settings, their findings judged, shrunk
and saved as case files, and the campaign's report.

For each case number N of campaign S the settings are drawn (``gpu_case.draw_settings``),
an engine pair serves ``workloads`` workloads drawn for it (``gpu_pair.run_pair``), and the
oracles judge what both engines recorded (``gpu_oracles``). Each finding is saved as a case
file at once (the settings and the workload it failed in), then shrunk on the GPU
(``gpu_shrink``: the plan is pure, the pair runner answers it) and saved again. The report
(``gpu_report``) is rewritten after every engine pair: a campaign stopped by a signal keeps
every finding and the report of what ran.

The pair runner is a parameter (``PairRunner``): the campaign's own is ``gpu_pair.run_pair``
on the GPU; what it returns is all the campaign reads. So is the vetter (``Vetter``): before
the first pair, the campaign's own (``gpu_pair.vet_settings``) builds the DFlash engine's
vLLM config for several times as many draws as it will serve, with no engine started, and the
campaign serves the first draws that config accepts, each refused one recorded as refused.
A refusal had cost its pair both processes' start and ended it without a workload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cases import write_case_file
from .gpu_case import (
    GpuCase,
    GpuCaseFile,
    GpuReq,
    GpuSettings,
    draw_settings,
    scheduler_case_file,
    write_gpu_case_file,
)
from .gpu_oracles import Evidence, Mode, Verdict
from .gpu_pair import GpuTarget, Judgement, PairRun, judge_pair, run_pair, vet_settings
from .gpu_report import CampaignReport, Finding
from .gpu_shrink import shrink

logger = logging.getLogger(__name__)
#: The suffix of the scheduler-side case saved beside each finding, for the CPU fuzzer: not
#: a finding of its own, so a reader of a campaign's findings passes it by.
SCHEDULER_SIDE = ".scheduler.json"

#: Findings of one kind shrunk per campaign; more are saved as found.
SHRINK_PER_KIND = 2
GIB = 1 << 30

#: (settings, case number, workloads to draw, workloads to replay or None, work folder,
#: seconds) -> what both engines recorded.
PairRunner = Callable[
    [GpuSettings, int, int, list[tuple[GpuReq, ...]] | None, Path, float], PairRun
]
#: Drawn settings -> each one's refusal by the DFlash engine's config, or None where it
#: passes; None for all when they could not be vetted.
Vetter = Callable[[list[GpuSettings]], list[str | None] | None]
#: Draws vetted for each engine pair the plan serves.
VET_DRAWS = 4


@dataclass(frozen=True)
class GpuPlan:
    """What to run: ``settings`` engine pairs of campaign ``seed``, ``workloads`` workloads
    each, or the ``replay`` cases as they are."""

    seed: int = 0
    settings: int = 4
    workloads: int = 16
    seconds: float | None = None
    """No engine pair starts after this long."""
    pair_seconds: float = 1800.0
    """An engine pair's processes are stopped after this long (a step that never returns)."""
    shrink: bool = True
    shrink_seconds: float = 1800.0
    replay: tuple[GpuCaseFile, ...] = ()
    mode: Mode = field(default_factory=Mode)
    kv_cache_memory_bytes: int = 8 * GIB
    max_k: int | None = None
    """The most drafts a step the pair's drafter takes (``gpu_pair.PairShape``)."""
    join_hold: bool = False
    """The vLLM under test takes fix 33's ``join_hold_steps`` (``gpu_pair.Interpreter``):
    only then is it drawn, as stock vLLM refuses the key. A replay serves its cases as saved."""
    drafter_graphs: bool = False
    """The vLLM under test takes fix 22's ``dflash_full_cudagraphs``: only then is it drawn."""
    one_at_a_time: bool = False
    """Each pair's engines serve one after the other (``gpu_pair.run_pair``): a GPU that
    holds one engine of the pair only."""


def alone(settings: GpuSettings) -> tuple[GpuReq, ...]:
    """The workload a finding with none of its own is saved with (an engine that never
    started, acceptance over a pair): one prompt of K + 1 tokens, the first step's batch."""
    return (GpuReq(arrival=0, prompt_len=settings.k + 1, max_tokens=settings.k + 1),)


class Campaign:
    """One campaign's state: the report, the findings saved, the runner that serves pairs."""

    def __init__(
        self,
        plan: GpuPlan,
        out_dir: Path,
        found_on: str,
        runner: PairRunner,
        vetter: Vetter | None = None,
    ) -> None:
        self.plan = plan
        self.out_dir = out_dir
        self.runner = runner
        self.vetter = vetter
        self.report = CampaignReport(found_on=found_on, seed=plan.seed, mode=plan.mode.kind)
        self.shrunk: dict[str, int] = {}

    def run(self) -> CampaignReport:
        """Every engine pair of the plan (until ``seconds``); the report, also when a signal
        ends the campaign (every finding so far saved)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            if self.plan.replay:
                for index, case_file in enumerate(self.plan.replay):
                    self._replay(index, case_file)
            else:
                for number in self._numbers():
                    if (
                        self.plan.seconds is not None
                        and time.monotonic() - started > self.plan.seconds
                    ):
                        break
                    self._pair(number)
        except BaseException:
            self.report.stopped = True
            raise
        finally:
            self.report.write(self.out_dir)
        return self.report

    def _numbers(self) -> list[int]:
        """The draws to serve: the first ``settings`` the DFlash engine's config accepts
        among ``VET_DRAWS`` times as many, the refused ones recorded (no pair started);
        without a vetter, where vetting failed or refused every draw, the first
        ``settings`` as drawn."""
        everything = list(range(self.plan.settings))
        if self.vetter is None:
            return everything
        count = self.plan.settings * VET_DRAWS
        drawn = [self._draw(n) for n in range(count)]
        refused = self.vetter(drawn)
        if refused is None or None not in refused:
            # Every draw refused reads as the vetting's own failure (a model the config
            # cannot inspect refuses them all alike): the pairs show it instead.
            if refused is not None:
                logger.info("every draw refused by its config: each pair starts as drawn")
            return everything
        kept: list[int] = []
        for number, (settings, why) in enumerate(zip(drawn, refused, strict=True)):
            if len(kept) == self.plan.settings:
                break
            if why is None:
                kept.append(number)
                continue
            logger.info("draw %d refused by its config, no engine started: %s", number, why)
            self.report.refused.append(f"{settings}: {why}")
            self.report.vetted += 1
        self.report.write(self.out_dir)
        return kept

    def _draw(self, number: int) -> GpuSettings:
        plan = self.plan
        return draw_settings(plan.seed, number, plan.max_k, plan.join_hold, plan.drafter_graphs)

    def _serve(
        self, settings: GpuSettings, number: int, replay: list[tuple[GpuReq, ...]] | None, name: str
    ) -> Judgement:
        work = self.out_dir / "pairs" / name
        pair = self.runner(
            settings, number, self.plan.workloads, replay, work, self.plan.pair_seconds
        )
        if name.startswith("shrink-"):
            self.report.shrink_seconds += pair.seconds
        else:
            self.report.gpu_seconds += pair.seconds
        return judge_pair(pair, self.plan.mode)

    def _count(self, judged: Judgement, settings: GpuSettings) -> None:
        self.report.pairs += 1
        if judged.refused:
            self.report.refused.append(f"{settings}: {judged.refused}")
        self.report.workloads += judged.served
        self.report.requests += judged.requests
        self.report.excused += judged.excused
        self.report.cut += judged.cut
        if judged.acceptance is not None:
            self.report.acceptance.append(judged.acceptance)

    def _pair(self, number: int) -> None:
        settings = self._draw(number)
        logger.info("engine pair %d: %s", number, settings)
        judged = self._serve(settings, number, None, f"pair-{number}")
        self._count(judged, settings)
        for verdict in judged.verdicts:
            self._finding(number, settings, verdict, judged)
        self.report.write(self.out_dir)

    def _replay(self, index: int, case_file: GpuCaseFile) -> None:
        case = case_file.case
        judged = self._serve(case.settings, index, [case.requests], f"replay-{index}")
        self._count(judged, case.settings)
        outcome = "refused" if judged.refused else "pass"
        if judged.verdicts:
            outcome = judged.verdicts[0].kind
        self.report.replayed.append(
            {
                "outcome": outcome,
                "expected": case_file.kind,
                "detail": judged.verdicts[0].detail if judged.verdicts else judged.refused or "",
            }
        )
        for verdict in judged.verdicts:
            self._finding(index, case.settings, verdict, judged, shrinkable=False)
        self.report.write(self.out_dir)

    def _finding(
        self,
        number: int,
        settings: GpuSettings,
        verdict: Verdict,
        judged: Judgement,
        *,
        shrinkable: bool = True,
    ) -> None:
        workload = verdict.workload
        if workload is not None and workload in judged.requests_of:
            requests = tuple(GpuReq(**r) for r in judged.requests_of[workload])
        else:
            requests = alone(settings)
        case = GpuCase(settings, requests)
        prefix = "replay" if self.plan.replay else "finding"
        path = self.out_dir / f"{prefix}-{verdict.kind}-{number}-{len(self.report.findings)}.json"
        finding = Finding(verdict.kind, verdict.detail, verdict.engine, number, workload, path)
        finding.excused = verdict.excused
        finding.evidence = verdict.evidence
        self._save(finding, case)
        self.report.findings.append(finding)
        self.report.write(self.out_dir)
        logger.info("finding %s saved: %s", verdict.kind, path)
        kept = self.shrunk.get(verdict.kind, 0)
        if not (shrinkable and self.plan.shrink and kept < SHRINK_PER_KIND):
            return
        if verdict.kind in ("acceptance",) or workload is None:
            return  # a pair's figure, or an engine that never started: nothing to shrink
        self.shrunk[verdict.kind] = kept + 1
        shrunk = self._shrink(number, case, verdict.kind)
        if shrunk is not None:
            finding.shrunk = True
            smaller, finding.evidence = shrunk
            self._save(finding, smaller)
            self.report.write(self.out_dir)

    def _shrink(
        self, number: int, case: GpuCase, kind: str
    ) -> tuple[GpuCase, tuple[Evidence, ...]] | None:
        """The smallest case found that fails with ``kind`` and the evidence of its token
        differences, None when none smaller did."""
        rounds = iter(range(1 << 30))
        evidence: dict[GpuCase, tuple[Evidence, ...]] = {}

        def answer(batch: list[GpuCase]) -> list[bool | None]:
            judged = self._serve(
                batch[0].settings,
                number,
                [c.requests for c in batch],
                f"shrink-{number}-{kind}-{next(rounds)}",
            )
            failing = {v.workload: v for v in judged.verdicts if v.kind == kind}
            for i, v in failing.items():
                if i is not None and i < len(batch):
                    evidence[batch[i]] = v.evidence
            return [
                True if i in failing else False if i < judged.served else None
                for i in range(len(batch))
            ]

        plan = shrink(case, answer, self.plan.shrink_seconds)
        logger.info("shrink of %s: %d steps, %d candidates asked", kind, plan.steps, plan.asked)
        return (plan.best, evidence.get(plan.best, ())) if plan.steps else None

    def _save(self, finding: Finding, case: GpuCase) -> None:
        """The finding's case, and beside it its scheduler side for the CPU fuzzer."""
        assert finding.file is not None
        write_gpu_case_file(
            finding.file,
            GpuCaseFile(
                case,
                finding.kind,
                finding.detail,
                self.report.found_on,
                finding.excused,
                finding.evidence,
            ),
        )
        cpu = scheduler_case_file(case, f"the scheduler side of {finding.file.name}")
        write_case_file(finding.file.with_suffix(SCHEDULER_SIDE), cpu)


def campaign_runner(target: GpuTarget, plan: GpuPlan) -> PairRunner:
    """The pair runner of a campaign on ``target``'s GPU."""

    def serve(
        settings: GpuSettings,
        number: int,
        workloads: int,
        replay: list[tuple[GpuReq, ...]] | None,
        work: Path,
        limit_s: float,
    ) -> PairRun:
        return run_pair(
            target,
            settings,
            work,
            limit_s,
            kv_cache_memory_bytes=plan.kv_cache_memory_bytes,
            seed=plan.seed,
            number=number,
            workloads=workloads,
            replay=replay,
            one_at_a_time=plan.one_at_a_time,
        )

    return serve


def run_gpu_campaign(
    target: GpuTarget, plan: GpuPlan, out_dir: Path, found_on: str
) -> CampaignReport:
    """``plan`` on ``target``'s GPU; findings, ``summary.json`` and ``summary.md`` in
    ``out_dir`` whatever ends it."""
    logger.debug("GPU fuzz campaign of %s into %s", target.describe(), out_dir)

    def vetter(settings: list[GpuSettings]) -> list[str | None] | None:
        return vet_settings(target, settings, out_dir / "vet", plan.kv_cache_memory_bytes)

    runner = campaign_runner(target, plan)
    return Campaign(plan, out_dir, found_on, runner, None if plan.replay else vetter).run()
