"""The six smoke checks as pure functions: observations in, a verdict with evidence out.

Nothing here runs a process or touches the network, so each verdict can be
tested on captured observations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .client import Completion
from .metrics import SpecDecodeStats

PASS = "pass"
FAIL = "fail"
ERROR = "error"
"""The check could not run; counts as not passed."""
INFO = "info"
"""Reported without a gate (acceptance without --min-acceptance-length)."""
SKIP = "skip"
"""Not run because the caller asked so (e.g. no fidelity run); does not fail the smoke."""

LOSSLESS = "lossless"
AUX_LAYERS = "aux_layers"
DRAFTER_WINDOWS = "drafter_windows"
PREFIX_CACHE = "prefix_cache"
FIDELITY = "fidelity"
ACCEPTANCE = "acceptance"

TITLES = {
    LOSSLESS: "lossless greedy output",
    AUX_LAYERS: "fix 1: aux layers = target_layer_ids + 1",
    DRAFTER_WINDOWS: "fix 2: drafter sliding windows",
    PREFIX_CACHE: "fix 3: prefix cache keeps last block",
    FIDELITY: "drafts agree with reference dflash",
    ACCEPTANCE: "acceptance length",
}
ORDER = (LOSSLESS, AUX_LAYERS, DRAFTER_WINDOWS, PREFIX_CACHE, FIDELITY, ACCEPTANCE)


@dataclass
class CheckResult:
    """One check's verdict: ``status`` is pass, fail, error or info; ``evidence`` one line."""

    id: str
    status: str
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def number(self) -> int:
        return ORDER.index(self.id) + 1

    @property
    def title(self) -> str:
        return TITLES[self.id]

    @property
    def passed(self) -> bool:
        return self.status in (PASS, INFO, SKIP)

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "title": self.title, **asdict(self)}


def error(check: str, message: str) -> CheckResult:
    """The verdict for a check whose observations could not be made."""
    return CheckResult(check, ERROR, message)


def skipped(check: str, message: str) -> CheckResult:
    """The verdict for a check the caller chose not to run."""
    return CheckResult(check, SKIP, message)


def _tokens(c: Completion) -> tuple[Any, ...]:
    return c.token_ids if c.token_ids is not None else (c.text,)


def check_lossless(
    speculative: list[Completion], plain: list[Completion], prompts: list[str]
) -> CheckResult:
    """Greedy completions with the drafter equal those without it, prompt by prompt."""
    if len(speculative) != len(prompts) or len(plain) != len(prompts):
        return error(
            LOSSLESS,
            f"got {len(speculative)} speculative and {len(plain)} plain completions "
            f"for {len(prompts)} prompts",
        )
    differing = []
    for i, (a, b) in enumerate(zip(speculative, plain, strict=True)):
        ta, tb = _tokens(a), _tokens(b)
        if ta != tb:
            first = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
            differing.append({"prompt": i, "first_difference": first, "spec": ta, "plain": tb})
    tokens = len(_tokens(speculative[0])) if speculative else 0
    if differing:
        where = ", ".join(
            f"prompt {d['prompt']} at token {d['first_difference']}" for d in differing[:3]
        )
        return CheckResult(
            LOSSLESS,
            FAIL,
            f"{len(differing)}/{len(prompts)} greedy completions differ with the drafter ({where})",
            {"differing": differing},
        )
    return CheckResult(
        LOSSLESS,
        PASS,
        f"{len(prompts)}/{len(prompts)} greedy completions identical with and without the "
        f"drafter ({tokens} tokens each)",
    )


def check_aux_layers(
    observed: tuple[int, ...] | None, expected: tuple[int, ...] | None, source: str
) -> CheckResult:
    """The engine captures target_layer_ids + 1 (HF ``hidden_states[id + 1]``)."""
    if expected is None:
        return error(AUX_LAYERS, "the drafter config has no dflash_config.target_layer_ids")
    if observed is None:
        return error(AUX_LAYERS, f"no 'Using auxiliary layers' line in {source}")
    details = {"observed": list(observed), "expected": list(expected), "source": source}
    unchanged = tuple(i - 1 for i in expected)
    if observed == expected:
        return CheckResult(
            AUX_LAYERS, PASS, f"engine captures {observed} = target_layer_ids + 1", details
        )
    hint = " (the ids unchanged: fix 1 absent)" if observed == unchanged else ""
    return CheckResult(
        AUX_LAYERS,
        FAIL,
        f"engine captures {observed}, expected target_layer_ids + 1 = {expected}{hint}",
        details,
    )


def check_windows(observed: list[dict[str, Any]], expected: list[tuple[int, int]]) -> CheckResult:
    """Each drafter attention layer computes with the window its layer_types ask for."""
    windows = [tuple(o["window"]) if o["window"] is not None else None for o in observed]
    details = {"observed": observed, "expected": [list(w) for w in expected]}
    if len(windows) != len(expected):
        return CheckResult(
            DRAFTER_WINDOWS,
            FAIL,
            f"{len(windows)} drafter attention layers, config has {len(expected)}",
            details,
        )
    shown = ", ".join(str(w) for w in windows)
    if windows == [tuple(w) for w in expected]:
        note = "" if any(w != (-1, -1) for w in expected) else " (no sliding layers to tell)"
        return CheckResult(
            DRAFTER_WINDOWS, PASS, f"FlashAttention windows {shown} as configured{note}", details
        )
    return CheckResult(
        DRAFTER_WINDOWS,
        FAIL,
        f"FlashAttention windows {shown}, expected {', '.join(str(tuple(w)) for w in expected)}",
        details,
    )


@dataclass(frozen=True)
class PrefixObservation:
    """The second of two identical requests on one server: what the prefix cache served."""

    prompt_tokens: int
    hits: float
    """Delta of vllm:prefix_cache_hits over the second request."""
    queries: float
    cached_tokens: int | None
    """The second answer's usage.prompt_tokens_details.cached_tokens."""


def full_block_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens a repeated prompt can take from the cache.

    Whole blocks only, and never the last prompt token, which must be computed
    to sample from: ((n - 1) // block) * block.
    """
    return ((prompt_tokens - 1) // block_size) * block_size


def check_prefix_cache(
    speculative: PrefixObservation, plain: PrefixObservation | None, block_size: int
) -> CheckResult:
    """A repeated prompt gets every full block from the cache with the DFlash drafter on."""
    expected = full_block_tokens(speculative.prompt_tokens, block_size)
    details: dict[str, Any] = {
        "expected": expected,
        "speculative": asdict(speculative),
        "plain": asdict(plain) if plain else None,
        "block_size": block_size,
    }
    control = f", {plain.hits:.0f} without speculation" if plain else ""
    if plain is not None and plain.hits != expected:
        return CheckResult(
            PREFIX_CACHE,
            ERROR,
            f"control server without speculation cached {plain.hits:.0f} of "
            f"{plain.prompt_tokens} tokens, expected {expected}: cannot judge",
            details,
        )
    summary = (
        f"repeated {speculative.prompt_tokens}-token prompt: {speculative.hits:.0f} tokens "
        f"from the cache with DFlash{control} (full blocks: {expected})"
    )
    if speculative.hits == expected:
        return CheckResult(PREFIX_CACHE, PASS, summary, details)
    hint = " (one block dropped: fix 3 absent)" if speculative.hits == expected - block_size else ""
    return CheckResult(PREFIX_CACHE, FAIL, summary + hint, details)


def check_fidelity(result: dict[str, Any], gate: float) -> CheckResult:
    """vLLM's drafts equal the reference's on at least ``gate`` of draft tokens."""
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
    return CheckResult(FIDELITY, PASS if rate >= gate else FAIL, evidence, dict(result))


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
