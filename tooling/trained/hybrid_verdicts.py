"""The trained hybrid pair's verdicts (pure): the strict lossless check, acceptance beside the
reference's, and decode speed, from what the engines returned (``hybrid_plan.load_results``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..smoke.distribution import at_most
from .hybrid_plan import (
    FIRST_PREFIX_PROMPT,
    SPEC,
    TIE_MARGIN,
    is_prefix_prompt,
)

# -- verdicts (pure) ---------------------------------------------------------------------------


def top2_margin(position: dict[str, float]) -> float:
    """The gap between the two best logprobs at one position (inf with one candidate)."""
    best = sorted(position.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


@dataclass
class PromptVerdict:
    prompt: str
    compared: int
    """Positions compared (up to the first difference, or all)."""
    first_difference: int | None
    plain_margin: float | None
    """The plain run's top-2 margin at the first difference."""
    tie: bool

    @property
    def ok(self) -> bool:
        return self.first_difference is None or self.tie


def compare_completion(
    name: str, plain: dict[str, Any], drafted: dict[str, Any], tie_margin: float = TIE_MARGIN
) -> PromptVerdict:
    """One checked prompt: where the drafted completion first leaves the plain one, and why."""
    a, b = plain["tokens"], drafted["tokens"]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            margin = top2_margin(plain["logprobs"][i]) if i < len(plain["logprobs"]) else None
            tie = at_most(margin, tie_margin)
            return PromptVerdict(name, i, i, margin, tie)
    if len(a) != len(b):
        return PromptVerdict(name, min(len(a), len(b)), min(len(a), len(b)), None, False)
    return PromptVerdict(name, len(a), None, None, False)


@dataclass
class LosslessVerdict:
    engine: str
    prompts: list[PromptVerdict] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.prompts) and all(p.ok for p in self.prompts)

    @property
    def failures(self) -> list[PromptVerdict]:
        return [p for p in self.prompts if not p.ok]

    @property
    def ties(self) -> list[PromptVerdict]:
        return [p for p in self.prompts if p.first_difference is not None and p.tie]


def lossless(engine: str, plain: dict[str, Any], drafted: dict[str, Any]) -> LosslessVerdict:
    """The strict check of one drafted engine against the plain engine."""
    if not plain.get("ok") or not drafted.get("ok"):
        bad = plain if not plain.get("ok") else drafted
        return LosslessVerdict(engine, error=str(bad.get("error", "no result")))
    verdict = LosslessVerdict(engine)
    for name, result in drafted["lossless"].items():
        if name not in plain["lossless"]:
            return LosslessVerdict(engine, error=f"the plain engine did not serve {name}")
        verdict.prompts.append(compare_completion(name, plain["lossless"][name], result))
    return verdict


def cache_misses(engine: str, result: dict[str, Any]) -> list[str]:
    """The prefix-cache prompts served after another with the same prefix that found nothing
    in the cache: there the check proves nothing about prefix caching."""
    return [
        f"{engine}: {name} found no tokens in the prefix cache"
        for name, served in result.get("lossless", {}).items()
        if is_prefix_prompt(name)
        and name != FIRST_PREFIX_PROMPT
        and not served.get("num_cached_tokens")
    ]


@dataclass
class AcceptanceRow:
    engine: str
    k: int
    concurrency: int
    drafts: int
    accepted: int
    per_position: list[float]
    most_running: int
    equal_plain: int
    prompts: int

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def acceptance_rows(
    name: str, result: dict[str, Any], plain: dict[str, Any] | None
) -> list[AcceptanceRow]:
    rows = []
    for level, data in result.get("acceptance", {}).items():
        spec = data["spec"]
        drafts = int(spec.get(f"{SPEC}num_drafts", 0))
        per_pos = spec.get(f"{SPEC}num_accepted_tokens_per_pos", []) or []
        plain_out = (plain or {}).get("acceptance", {}).get("1", {}).get("outputs", [])
        rows.append(
            AcceptanceRow(
                engine=name,
                k=int(result.get("num_speculative_tokens", 0)),
                concurrency=int(level),
                drafts=drafts,
                accepted=int(spec.get(f"{SPEC}num_accepted_tokens", 0)),
                per_position=[a / drafts for a in per_pos] if drafts else [],
                most_running=int(data.get("most_running", 0)),
                equal_plain=sum(a == b for a, b in zip(data["outputs"], plain_out, strict=False)),
                prompts=len(data["outputs"]),
            )
        )
    return rows


@dataclass
class SpeedRow:
    concurrency: int
    plain_tps: float
    drafted_tps: float
    plain_first_s: float
    drafted_first_s: float
    plain_steady_s: float
    drafted_steady_s: float
    plain_most_running: int
    drafted_most_running: int

    @property
    def ratio(self) -> float:
        return self.drafted_tps / self.plain_tps if self.plain_tps else 0.0


def _steady(passes: list[dict[str, Any]]) -> tuple[float, float]:
    """Tokens/s and seconds of the median pass after the first (a pass that still compiles
    for a shape of its own is an outlier, not a share of the figure)."""
    steady = sorted(passes[1:] or passes, key=lambda p: p["seconds"] / max(p["tokens"], 1))
    middle = steady[(len(steady) - 1) // 2 : len(steady) // 2 + 1]
    seconds = statistics.fmean(p["seconds"] for p in middle)
    tokens = statistics.fmean(p["tokens"] for p in middle)
    return (tokens / seconds if seconds else 0.0), seconds


def speed_rows(plain: dict[str, Any], drafted: dict[str, Any]) -> list[SpeedRow]:
    rows = []
    for level, passes in drafted.get("speed", {}).items():
        base = plain.get("speed", {}).get(level)
        if not base:
            continue
        p_tps, p_s = _steady(base)
        d_tps, d_s = _steady(passes)
        rows.append(
            SpeedRow(
                concurrency=int(level),
                plain_tps=p_tps,
                drafted_tps=d_tps,
                plain_first_s=base[0]["seconds"],
                drafted_first_s=passes[0]["seconds"],
                plain_steady_s=p_s,
                drafted_steady_s=d_s,
                plain_most_running=max(p.get("most_running", 0) for p in base),
                drafted_most_running=max(p.get("most_running", 0) for p in passes),
            )
        )
    return rows
