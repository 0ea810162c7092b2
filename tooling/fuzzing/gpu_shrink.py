"""Shrinking a GPU finding: which cases to serve next, planned here, served by a callback.

A candidate's answer costs GPU time, an engine pair's start most of it; so the plan serves
every simpler workload of the best case so far on one engine pair (one batch), and only
when none of them fails the same way tries settings back toward vLLM's defaults, one
setting a batch (each a new pair). Whichever candidate fails the same way first becomes
the best case, and the planning starts again from it. The workloads one step simpler are
the scheduler fuzzer's (``_schedfuzz.smaller_workloads``), and a request asking for fewer
logprobs.

``shrink`` drives a plan with a runner: ``runner(batch)`` answers, per candidate, whether
it failed the same way (True), did not (False), or was not served (None: the engine died
on an earlier one; it is asked again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..probes._schedfuzz import smaller_workloads
from .gpu_case import DEFAULTS, KS, GpuCase, GpuReq, GpuSettings

logger = logging.getLogger(__name__)

#: Workload candidates one engine pair serves at most.
BATCH = 16

Runner = Callable[[list[GpuCase]], list[bool | None]]


def workload_candidates(case: GpuCase) -> list[GpuCase]:
    """``case`` with a workload one step simpler, the boldest first."""
    reqs = case.requests
    # The scheduler fuzzer's simpler workloads keep each request's class: GpuReq here.
    out = [
        replace(case, requests=tuple(r for r in w if isinstance(r, GpuReq)))
        for w in smaller_workloads(reqs)
        if w
    ]
    for i, r in enumerate(reqs):
        if r.logprobs > 2:
            fewer: tuple[GpuReq, ...] = (*reqs[:i], replace(r, logprobs=2), *reqs[i + 1 :])
            out.append(replace(case, requests=fewer))
    return out


def settings_candidates(case: GpuCase) -> list[GpuCase]:
    """``case`` with one setting back at vLLM's default (K one step smaller), in the order
    a user most often leaves them: fixes 33 and 22's options first, unset (the wheel's
    default)."""
    s = case.settings
    simpler: list[GpuSettings] = [
        replace(s, **{name: getattr(DEFAULTS, name)})
        for name in (
            "join_hold_steps",
            "drafter_full_graphs",
            "async_scheduling",
            "long_prefill_token_threshold",
            "kv_cache_dtype",
            "gdn_state_dtype",
            "cudagraph_mode",
            "prefix_caching",
            "max_num_batched_tokens",
            "max_num_seqs",
        )
    ]
    smaller_k = [k for k in KS if k < s.k]
    if smaller_k:
        simpler.append(replace(s, k=smaller_k[-1]))
    return [replace(case, settings=x) for x in simpler if x != s]


@dataclass
class ShrinkPlan:
    """The state of one shrink: the best case so far and the candidates still to ask."""

    best: GpuCase
    batch_size: int = BATCH
    phase: str = "workload"
    """"workload" (many candidates a batch) or "settings" (one a batch)."""
    pending: list[GpuCase] = field(default_factory=list)
    fresh: bool = True
    """Whether ``pending`` has yet to be planned from ``best``."""
    asked: int = 0
    steps: int = 0
    """Candidates that became the best case."""
    last: list[GpuCase] = field(default_factory=list)

    def next_batch(self) -> list[GpuCase]:
        """The candidates to serve next, all of one settings; [] when the shrink is done."""
        if self.fresh:
            self.pending, self.fresh = workload_candidates(self.best), False
            self.phase = "workload"
        if not self.pending and self.phase == "workload":
            self.phase, self.pending = "settings", settings_candidates(self.best)
        size = self.batch_size if self.phase == "workload" else 1
        self.last = self.pending[:size]
        return list(self.last)

    def tell(self, answers: list[bool | None]) -> None:
        """What the runner answered for the last batch, in its order."""
        for candidate, answer in zip(self.last, answers, strict=False):
            if answer is None:
                break  # this and the rest were not served: asked again
            self.asked += 1
            self.pending.remove(candidate)
            if answer:
                self.best, self.fresh = candidate, True
                self.steps += 1
                logger.debug("shrink: %d requests now fail the same way", len(candidate.requests))
                return


def shrink(
    case: GpuCase,
    runner: Runner,
    seconds: float,
    clock: Callable[[], float] = time.monotonic,
) -> ShrinkPlan:
    """The plan after shrinking ``case`` for at most ``seconds`` (a batch started before then
    is finished); its ``best`` is the smallest case found that fails the same way."""
    plan = ShrinkPlan(case)
    deadline = clock() + seconds
    while clock() < deadline:
        batch = plan.next_batch()
        if not batch:
            break
        answers = runner(batch)
        if not any(a is not None for a in answers):
            break  # nothing served: no engine pair starts for these settings
        plan.tell(answers)
    return plan
