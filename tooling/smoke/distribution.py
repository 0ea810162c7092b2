"""First-token distributions: does a DFlash engine compute what the plain target computes?

On random weights nearly every position is a near-tie, so two engines' greedy
strings part at the first tie whatever they compute, and "the completions
differ" says little. What says a lot is the distribution: the top-k logprobs
each engine returns at the positions where both have seen the same context.
This module plans the GPU runs (``serving/distribution.py``, one engine per
process) and compares what they return, position by position (the hybrid defects'
proof runs it on its own: ``tooling.trained.hybrid_proof``):

- the noise: the plain engine serves every prompt alone and then all of them
  in one batch; the largest logprob difference between those two plain runs,
  over the top-k tokens both list, is what numerics alone move. It is measured
  twice: at the first token, and at every compared position (numerics drift
  further over a completion than at its first token, and a dozen prompts'
  eight positions are eight times the samples of their first tokens);
- a DFlash engine passes where its first token's top-k logprobs are within
  twice the first-token noise (``NOISE_HEADROOM``; never below one bf16 step of
  a logit, 2^-6 at the logits' scale) of the plain run's, its logprobs at every
  compared position within twice the noise at those positions, and where its
  greedy token differs from the plain one, the plain run itself had the two
  within the tolerance of that position (a tie). Positions are compared up to
  and including the first greedy difference: after it the contexts differ.
  Past the first token a DFlash engine computes with its verification kernels
  (K+1 queries a step) where the plain engine decodes one token a step, so the
  later positions are held to the noise plain shows there: between its two runs,
  and between its decode and the same tokens scored in one pass of many tokens
  (a prefill), whichever is larger;
- where the DFlash engine's greedy token is not in the plain run's top-k, the
  plain margin is only known to be at least the spread of that list: past the
  tolerance that is a fail, within it no verdict (``UNDETERMINED``), never a
  pass. ``LOGPROBS`` (vLLM's own limit) keeps that rare.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from .distribution_plan import (
    FIRST_POSITIONS,
    TO_MAX_LEN,
    TO_MAX_LEN_TOKENS,
    Variant,
    first_token_prompts,
)

#: One bf16 step of a logit at the scale random and trained logits take (2 to 4).
FLOOR = 2.0**-6
#: Room for the fp32 log-softmax around bf16 logits: both sides of a comparison are a
#: whole number of bf16 steps apart, up to this.
SLACK = 2.0**-10
#: The tolerance over the measured noise. Either reason alone asks for it: two tokens trade
#: places when their logits move apart, up to twice what one moves; and the noise is the
#: largest of a dozen plain pairs, which a dozen more deltas of the same spread exceed half
#: the time (the largest of the 24 lies in either dozen alike). A defect moves the first
#: token out of the plain top-k, far past this.
NOISE_HEADROOM = 2.0


# --- comparing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One request's greedy tokens and, per position, token id -> logprob of its top-k."""

    tokens: list[int]
    logprobs: list[dict[str, float]]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        return cls(tokens=list(data["tokens"]), logprobs=list(data["logprobs"]))


@dataclass(frozen=True)
class Comparison:
    positions: int
    """Positions compared: up to and including the first greedy difference."""
    max_delta: float
    """Largest |logprob difference| over the tokens both top-k lists hold, at those positions."""
    held_delta: float
    """The same over the first ``FIRST_POSITIONS`` of them, the positions the noise is
    measured at; past them (the longer workloads) the difference is reported, not judged."""
    first_delta: float
    """The same, at the first position only."""
    diverged_at: int | None
    """The first position whose greedy tokens differ, None where none does."""
    divergence_margin: float | None
    """There, the plain run's logprob of its own token minus that of the other's token
    (None where the other's token is not in the plain top-k: a margin beyond the list)."""
    first_token_in_plain_topk: bool
    margin_at_least: float | None = None
    """Where the margin is beyond the list: the plain run's best logprob there minus the
    least it lists, which the unknown margin is at least."""


def _delta(a: dict[str, float], b: dict[str, float]) -> float:
    shared = a.keys() & b.keys()
    return max((abs(a[t] - b[t]) for t in shared), default=float("inf"))


def compare(plain: Run, other: Run, positions: int) -> Comparison:
    """``other`` against ``plain`` over their first ``positions`` tokens."""
    n = min(positions, len(plain.tokens), len(other.tokens))
    deltas: list[float] = []
    diverged_at = margin = at_least = None
    for i in range(n):
        deltas.append(_delta(plain.logprobs[i], other.logprobs[i]))
        if plain.tokens[i] != other.tokens[i]:
            diverged_at = i
            listed = plain.logprobs[i]
            best = listed[str(plain.tokens[i])]
            theirs = listed.get(str(other.tokens[i]))
            if theirs is not None:
                margin = best - theirs
            else:
                at_least = best - min(listed.values())
            break
    return Comparison(
        positions=len(deltas),
        max_delta=max(deltas, default=0.0),
        held_delta=max(deltas[:FIRST_POSITIONS], default=0.0),
        first_delta=deltas[0] if deltas else 0.0,
        diverged_at=diverged_at,
        divergence_margin=margin,
        first_token_in_plain_topk=bool(other.tokens)
        and str(other.tokens[0]) in (plain.logprobs[0] if plain.logprobs else {}),
        margin_at_least=at_least,
    )


def at_most(margin: float | None, limit: float) -> bool:
    """``margin`` no more than ``limit``, both whole bf16 steps read through fp32 (``SLACK``);
    None (no margin measured) is not."""
    return margin is not None and margin <= limit + SLACK


def tolerance_for(measured: float) -> float:
    """The tolerance for a measured plain noise: ``NOISE_HEADROOM`` times it, at least
    ``FLOOR``."""
    return max(NOISE_HEADROOM * measured, FLOOR)


class Outcome(StrEnum):
    """One prompt's comparison. A row's verdict and the report's JSON carry the values."""

    PASS = "pass"
    FAIL = "fail"
    UNDETERMINED = "undetermined"
    """The greedy tokens part where the plain run does not list the other's token and its
    list is narrower than the tolerance: the margin there could be a tie or not."""


@dataclass(frozen=True)
class Noise:
    """What two plain runs of the same prompts differ by: the largest logprob difference
    at the first token, and at every position ``compare`` reaches (at least as large)."""

    first: float
    positions: float
    scored: float | None = None
    """At every position, plain's decode against the same tokens scored in one pass of
    many tokens (None where that run is absent). Plain's two runs decode with the same
    kernels and can agree to the bit, where a DFlash engine verifies K + 1 tokens a pass,
    which rounds otherwise."""

    @property
    def later(self) -> float:
        """The noise the positions after the first are held to: the larger of the two."""
        return max(self.positions, self.scored or 0.0)

    @property
    def tolerance(self) -> Tolerance:
        return Tolerance(tolerance_for(self.first), tolerance_for(self.later))


@dataclass(frozen=True)
class Tolerance:
    first: float
    """For the first token's logprobs and a greedy difference there."""
    later: float
    """For every compared position's logprobs and a greedy difference past the first."""


def judge(c: Comparison, tolerance: Tolerance) -> Outcome:
    """The other engine's first token has the plain distribution, every compared position's
    logprobs are within what plain runs move there, and its greedy tokens are the plain ones
    up to ties."""
    if not (at_most(c.first_delta, tolerance.first) and at_most(c.held_delta, tolerance.later)):
        return Outcome.FAIL
    if c.diverged_at is None:
        return Outcome.PASS
    limit = tolerance.first if c.diverged_at == 0 else tolerance.later
    if c.divergence_margin is not None:
        return Outcome.PASS if at_most(c.divergence_margin, limit) else Outcome.FAIL
    if c.margin_at_least is None or not at_most(c.margin_at_least, limit):
        return Outcome.FAIL
    return Outcome.UNDETERMINED


def noise(
    alone: dict[str, Run], together: dict[str, Run], scored: dict[str, Run] | None = None
) -> Noise:
    """The largest differences two plain runs of the same prompts show, and where ``scored``
    is given, those between plain's decode and the same tokens scored in one pass."""
    found = [compare(alone[n], together[n], FIRST_POSITIONS) for n in alone if n in together]
    scored = scored or {}
    passes = [compare(alone[n], scored[n], FIRST_POSITIONS) for n in alone if n in scored]
    return Noise(
        first=max((c.first_delta for c in found), default=0.0),
        positions=max((c.held_delta for c in found), default=0.0),
        scored=max((c.held_delta for c in passes), default=0.0) if passes else None,
    )


# --- reporting ------------------------------------------------------------------------


@dataclass
class Row:
    variant: str
    workload: str
    prompt: str
    verdict: str
    evidence: str


@dataclass
class Report:
    tolerance: float
    """For the first token: ``NOISE_HEADROOM`` x ``noise``."""
    noise: float
    """The first-token noise (checks 1 and 5 take their tie tolerance from it)."""
    later_tolerance: float = FLOOR
    """For every compared position: ``NOISE_HEADROOM`` x ``later_noise``."""
    later_noise: float = 0.0
    """The noise at every compared position (the larger of the two references')."""
    scored_noise: float | None = None
    """Of that, plain's decode against the same tokens scored in one pass (``Noise.scored``)."""
    rows: list[Row] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    undetermined: list[str] = field(default_factory=list)
    """The comparisons an expected pass could not be judged on (never a pass)."""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.undetermined

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tolerance": self.tolerance,
            "noise": self.noise,
            "later_tolerance": self.later_tolerance,
            "later_noise": self.later_noise,
            "scored_noise": self.scored_noise,
            "failures": self.failures,
            "undetermined": self.undetermined,
            "rows": [asdict(r) for r in self.rows],
        }


def _runs(result: dict[str, Any], key: str) -> dict[str, Run]:
    return {name: Run.from_json(r) for name, r in (result.get(key) or {}).items()}


def _describe(c: Comparison) -> str:
    parts = [
        f"first token delta {c.first_delta:.4f}",
        f"max delta {c.max_delta:.4f} over {c.positions}",
    ]
    if c.diverged_at is not None:
        if c.divergence_margin is not None:
            margin = f"{c.divergence_margin:.4f}"
        elif c.margin_at_least is not None:
            margin = f"beyond its top-k, at least {c.margin_at_least:.4f}"
        else:
            margin = "beyond its top-k"
        parts.append(f"greedy differs at {c.diverged_at} (plain margin {margin})")
    if not c.first_token_in_plain_topk:
        parts.append("first token not in the plain top-k")
    return "; ".join(parts)


def build_report(results: dict[str, dict[str, Any]], plan: list[Variant]) -> Report:
    """Compare every variant's runs with the plain engine's; collect what breaks the plan."""
    plain = results.get("plain") or {"ok": False, "error": "no result"}
    if not plain.get("ok", True):
        report = Report(tolerance=FLOOR, noise=float("nan"))
        report.failures.append(f"plain: {plain.get('error')}")
        return report
    measured = noise(_runs(plain, "alone"), _runs(plain, "together"), _runs(plain, "scored"))
    tolerance = measured.tolerance
    report = Report(
        tolerance=tolerance.first,
        noise=measured.first,
        later_tolerance=tolerance.later,
        later_noise=measured.later,
        scored_noise=measured.scored,
    )
    if not math.isfinite(measured.later):
        # Two plain runs that share no top-k token where their contexts are the same leave
        # no noise to hold anything to.
        report.failures.append("plain: its two runs share no top-k token at a position")
        return report
    plain_runs = {**_runs(plain, "alone"), **_runs(plain, "staggered")}
    for v in plan:
        if v.name == "plain":
            continue
        result = results.get(v.name)
        if result is None or not result.get("ok", True):
            error = (result or {}).get("error", "no result")
            report.rows.append(Row(v.name, "engine", "-", "error", error))
            if v.expect != "report":
                report.failures.append(f"{v.name}: {error}")
            continue
        _compare_variant(report, v, result, plain_runs)
    return report


def _compare_variant(
    report: Report, v: Variant, result: dict[str, Any], plain_runs: dict[str, Run]
) -> None:
    k = v.num_speculative_tokens
    k_plus_one = {p["name"] for p in first_token_prompts(k) if p["length"] == k + 1}
    tolerance = Tolerance(report.tolerance, report.later_tolerance)
    ran_k_plus_one = stock_failed_k_plus_one = False
    for workload, runs in (
        ("alone", _runs(result, "alone")),
        ("staggered", _runs(result, "staggered")),
    ):
        for name, run in sorted(runs.items()):
            if workload == "staggered":
                positions = len(run.tokens)
            else:
                positions = TO_MAX_LEN_TOKENS if name == TO_MAX_LEN else FIRST_POSITIONS
            c = compare(plain_runs[name], run, positions)
            outcome = judge(c, tolerance)
            report.rows.append(Row(v.name, workload, name, outcome, _describe(c)))
            if name in k_plus_one:
                ran_k_plus_one = True
                stock_failed_k_plus_one |= outcome == Outcome.FAIL
            if v.expect == "fixed" and outcome == Outcome.FAIL:
                report.failures.append(f"{v.name} {name}: {_describe(c)}")
            elif v.expect == "fixed" and outcome == Outcome.UNDETERMINED:
                report.undetermined.append(f"{v.name} {name}: {_describe(c)}")
    reach = result.get("drafter_reach", {}).get(TO_MAX_LEN)
    if reach is not None:
        last = result["max_model_len"] - 1
        verdict = "pass" if reach <= last else "fail"
        evidence = f"drafter's last query position {reach}, last valid position {last}"
        row = Row(v.name, "max_model_len", TO_MAX_LEN, verdict, evidence)
        _add(report, v, row, f"the drafter queried position {reach} > {last}")
    concurrent = result.get("concurrent")
    if concurrent:
        finished, requests = concurrent["finished"], concurrent["requests"]
        evidence = (
            f"{finished} finished, {concurrent['tokens']} tokens, at most "
            f"{concurrent['most_running']} running at once, {concurrent['seconds']:.1f} s"
        )
        verdict = "pass" if finished == requests else "fail"
        row = Row(v.name, "concurrent", f"{requests} requests", verdict, evidence)
        _add(report, v, row, f"{finished} of {requests} finished")
    if v.expect == "stock" and ran_k_plus_one and not stock_failed_k_plus_one:
        report.failures.append(f"{v.name}: stock passed every K+1 prompt (the check is blind)")


def _add(report: Report, v: Variant, row: Row, failure: str) -> None:
    """``row`` in the report, and ``failure`` among its failures where a fixed engine failed."""
    report.rows.append(row)
    if v.expect == "fixed" and row.verdict == "fail":
        report.failures.append(f"{v.name}: {failure}")
