"""Checks 5, 6 and 8 to 10: fidelity to the reference, the slot audit, the concurrent load,
acceptance, and the first tokens against the plain engine's."""

from __future__ import annotations

from typing import Any

from ..distribution import NOISE_HEADROOM, Outcome, Report
from ..metrics import SpecDecodeStats
from .base import (
    ACCEPTANCE,
    ERROR,
    FAIL,
    FIDELITY,
    FIRST_TOKENS,
    INFO,
    LOAD,
    PASS,
    SLOT_AUDIT,
    CheckResult,
    error,
)
from .lossless import (
    TieTolerance,
)


def check_fidelity(
    result: dict[str, Any], gate: float, tie: TieTolerance | None = None
) -> CheckResult:
    """vLLM's drafts equal the reference's on at least ``gate`` of draft tokens, a draft
    within ``tie``'s tolerance of the reference's best logit counting as equal (``result``
    gated at it: ``agreement.with_tolerance``)."""
    if not result.get("ok", True):
        return error(FIDELITY, f"reference comparison failed: {result.get('error')}")
    rate = result.get("agreement")
    total = int(result.get("compared_tokens", 0))
    if rate is None or total == 0:
        return error(FIDELITY, "no proposal could be compared with the reference")
    per_pos = " ".join(f"{p:.1%}" for p in result.get("per_position", []))
    evidence = (
        f"{rate:.1%} of {total} draft tokens equal the reference's "
        f"(per position {per_pos}; gate {gate:.0%})"
    )
    if result.get("mismatches"):
        # Near ties flip under bf16 rounding; many far-off mismatches mean a real bug.
        evidence += (
            f"; {result.get('near_ties', 0)} of {result['mismatches']} mismatches are near ties"
        )
    if tie is not None:
        evidence += f"; {result.get('tolerated', 0)} within the {tie.describe()}"
    groups = result.get("group_agreement") or {}
    low = {g: r for g, r in groups.items() if r is not None and r < gate}
    exact = result.get("group_exact_agreement") or {}

    def group(name: str, rate: float) -> str:
        bare = exact.get(name)
        return f"{name} {rate:.1%}" + (f" (exact {bare:.1%})" if bare not in (None, rate) else "")

    if groups:
        evidence += "; " + ", ".join(group(g, r) for g, r in groups.items() if r is not None)
    if result.get("other_context_agreement") is not None:
        other = "HF target" if result.get("context") == "engine" else "engine"
        evidence += (
            f"; with {other} features {result['other_context_agreement']:.1%} (sequential prompts)"
        )
    passed = rate >= gate and not low
    details = dict(result)
    if tie is not None:
        details["tie_tolerance"] = tie.to_json()
    return CheckResult(FIDELITY, PASS if passed else FAIL, evidence, details)


def fidelity_passes(result: dict[str, Any] | None, gate: float, expected_layers: Any) -> bool:
    """One engine run's fidelity, as the warm-cache check needs it: the gated agreement
    and, where recorded, the captured feature layers."""
    if not result or not result.get("ok", True) or result.get("agreement") is None:
        return False
    layers = result.get("feature_layers") or {}
    if layers and list(layers.get("nearest") or []) != list(expected_layers or []):
        return False
    return result["agreement"] >= gate


def check_slot_audit(audit: dict[str, Any], boundary: dict[str, Any] | None = None) -> CheckResult:
    """No first-pass query slot outside its request's blocks, over passes that include a
    row ending on a block's first slot: without one, stock vLLM's K-slot reservation would
    pass as well, and a verdict the audit could not reach is not a pass. ``boundary``: the
    run's boundary prompt (``engine_run``), whose reason it was not served is shown."""
    from ..serving.slotaudit import SlotAudit, verdict_counts

    counts = SlotAudit.from_json(audit)
    if counts.slots == 0:
        return CheckResult(SLOT_AUDIT, ERROR, "no first-pass slot was audited", audit)
    if counts.outside or counts.other_live or counts.misplaced:
        return CheckResult(SLOT_AUDIT, FAIL, verdict_counts(counts), audit)
    if counts.boundary_rows == 0:
        why = "no audited row ended on a block's first slot, so K reserved slots pass as K+1"
        if boundary and boundary.get("not_served"):
            why += f" (boundary prompt not served: {boundary['not_served']})"
        return CheckResult(SLOT_AUDIT, ERROR, f"{why}: {verdict_counts(counts)}", audit)
    return CheckResult(SLOT_AUDIT, PASS, verdict_counts(counts), audit)


def check_load(spec: dict[str, Any], plain: dict[str, Any]) -> CheckResult:
    """Every concurrent request answered on both servers; the same prefix reuse."""
    details = {"dflash": spec, "plain": plain}
    failed = spec["measured"]["failed"] + spec["first"]["failed"]
    control_failed = plain["measured"]["failed"] + plain["first"]["failed"]
    m, p = spec["measured"], plain["measured"]

    def ms(x: float | None) -> str:
        return f"{x * 1000:.0f}ms" if x is not None else "n/a"

    evidence = (
        f"{m['requests']} concurrent: {failed} failed; {m['tokens_per_s'] or 0:.0f} tok/s "
        f"(plain {p['tokens_per_s'] or 0:.0f}), p50/p99 {ms(m['p50_latency_s'])}/"
        f"{ms(m['p99_latency_s'])} (plain {ms(p['p50_latency_s'])}/{ms(p['p99_latency_s'])}); "
        f"first burst p99 {ms(spec['first']['p99_latency_s'])}; cached tokens "
        f"{m['cached_tokens']} vs {p['cached_tokens']} without the drafter"
    )
    if spec.get("acceptance_length") is not None:
        evidence += f"; acceptance under load {spec['acceptance_length']:.3f}"
    if control_failed:
        return CheckResult(LOAD, ERROR, f"control server failed requests: {evidence}", details)
    ok = failed == 0 and m["cached_tokens"] == p["cached_tokens"]
    return CheckResult(LOAD, PASS if ok else FAIL, evidence, details)


def check_acceptance(stats: SpecDecodeStats | None, minimum: float | None) -> CheckResult:
    """Acceptance length from /metrics, gated only when ``minimum`` is given."""
    if stats is None:
        return error(ACCEPTANCE, "the speculative server exported no spec_decode counters")
    length = stats.acceptance_length
    if length is None:
        return error(ACCEPTANCE, "the speculative server made no drafts")
    rates = " ".join(f"{r:.2f}" for r in stats.per_position_rate())
    evidence = (
        f"acceptance length {length:.3f} ({stats.num_accepted_tokens:.0f} accepted over "
        f"{stats.num_drafts:.0f} drafts; per position {rates})"
    )
    details = stats.to_json()
    if minimum is None:
        return CheckResult(ACCEPTANCE, INFO, evidence, details)
    status = PASS if length >= minimum else FAIL
    return CheckResult(ACCEPTANCE, status, f"{evidence}; minimum {minimum:.3f}", details)


def check_first_tokens(report: Report) -> CheckResult:
    """Prompts of K, K+1, K+2 (and 3(K+1)) tokens, each served alone with and without the
    drafter: the first token's top-k logprobs agree within twice what two plain runs differ
    by there, every compared position's within twice what plain differs by at those positions
    (``distribution.NOISE_HEADROOM``): between its two runs, or between its decode and the
    same tokens scored in one pass, whichever is larger. A prompt the comparison could not
    judge is no pass: the check is an error, naming it."""
    rows = [r for r in report.rows if r.workload == "alone"]
    scored = report.scored_noise
    tolerance = (
        f"tolerance {report.tolerance:.4f} at the first token, {report.later_tolerance:.4f} "
        f"at every position ({NOISE_HEADROOM:g} x the plain noise {report.noise:.4f}, "
        f"{report.later_noise:.4f}"
        + ("" if scored is None else f"; decode against one pass {scored:.4f}")
        + ")"
    )
    details = report.to_json()
    if report.failures and not rows:
        return CheckResult(FIRST_TOKENS, ERROR, "; ".join(report.failures), details)
    # Failures first: a prompt without a verdict does not hide one that failed.
    for found, outcome, status, what in (
        (report.failures, Outcome.FAIL, FAIL, "off"),
        (
            report.undetermined,
            Outcome.UNDETERMINED,
            ERROR,
            "without a verdict (the plain top-k does not list the token the DFlash engine "
            "chose, and is narrower than the tolerance)",
        ),
    ):
        if found:
            named = [r for r in rows if r.verdict == outcome]
            which = "; ".join(f"{r.prompt}: {r.evidence}" for r in named[:3])
            evidence = f"{len(named)} of {len(rows)} prompts {what}, {tolerance}: {which}"
            return CheckResult(FIRST_TOKENS, status, evidence, details)
    return CheckResult(
        FIRST_TOKENS, PASS, f"{len(rows)} prompts served alone within {tolerance}", details
    )
