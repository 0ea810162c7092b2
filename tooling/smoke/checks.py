"""The smoke checks as pure functions: observations in, a verdict with evidence out.

Nothing here runs a process or touches the network, so each verdict can be
tested on captured observations.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import SmokeError
from .client import Completion
from .config import PREFIX_MAX_TOKENS, PREFIX_PROMPT_TOKENS, PREFIX_TAIL_TOKENS
from .distribution import NOISE_HEADROOM, SLACK, Outcome, Report
from .metrics import SpecDecodeStats


class Verdict(StrEnum):
    """A check's outcome. Strings underneath: the report's JSON and table carry the values."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    """The check could not run; counts as not passed."""
    INFO = "info"
    """Reported without a gate (acceptance without --min-acceptance-length)."""
    SKIP = "skip"
    """Not run because the caller asked so (e.g. no fidelity run); does not fail the smoke."""
    PENDING = "pending"
    """A report written while the run goes on: the steps the check reads have not all run."""


# The names the runner, the report and the tests use.
PASS = Verdict.PASS
FAIL = Verdict.FAIL
ERROR = Verdict.ERROR
INFO = Verdict.INFO
SKIP = Verdict.SKIP
PENDING = Verdict.PENDING

LOSSLESS = "lossless"
AUX_LAYERS = "aux_layers"
DRAFTER_WINDOWS = "drafter_windows"
PREFIX_CACHE = "prefix_cache"
FIDELITY = "fidelity"
ACCEPTANCE = "acceptance"
WARM_CACHE = "warm_cache"
SLOT_AUDIT = "slot_audit"
LOAD = "concurrent_load"
FIRST_TOKENS = "first_tokens"

TITLES = {
    LOSSLESS: "lossless greedy output",
    AUX_LAYERS: "fix 1: aux layers = target_layer_ids + 1",
    DRAFTER_WINDOWS: "fix 2: drafter sliding windows",
    PREFIX_CACHE: "fix 3: prefix cache keeps last block",
    FIDELITY: "drafts agree with reference dflash",
    ACCEPTANCE: "acceptance length",
    WARM_CACHE: "warm compile cache keeps fidelity",
    SLOT_AUDIT: "first-pass slots in own blocks",
    LOAD: "concurrent load through the server",
    FIRST_TOKENS: "lossless first tokens of K..K+2-token prompts",
}
ORDER = (
    LOSSLESS,
    AUX_LAYERS,
    DRAFTER_WINDOWS,
    PREFIX_CACHE,
    FIDELITY,
    ACCEPTANCE,
    WARM_CACHE,
    SLOT_AUDIT,
    LOAD,
    FIRST_TOKENS,
)


@dataclass
class CheckResult:
    """One check's verdict with its ``evidence`` in one line."""

    id: str
    status: Verdict
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


def _named(differing: list[dict[str, Any]]) -> str:
    return ", ".join(f"prompt {d['prompt']} at token {d['first_difference']}" for d in differing)


def first_differences(
    speculative: list[Completion], plain: list[Completion]
) -> list[dict[str, Any]]:
    """Per prompt whose completions differ: where first, and both token lists."""
    differing = []
    for i, (a, b) in enumerate(zip(speculative, plain, strict=True)):
        ta, tb = _tokens(a), _tokens(b)
        if ta != tb:
            first = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
            differing.append({"prompt": i, "first_difference": first, "spec": ta, "plain": tb})
    return differing


@dataclass(frozen=True)
class TieTolerance:
    """A tie tolerance of checks 1 and 5 (each its own floor): the floor, or
    ``NOISE_HEADROOM`` times the plain noise the run measured where that is larger (check
    10's rule). Check 5's drafter logits come out of the target's own output head at the
    target's width, so the rounding two kernel stacks put into them is the target's too."""

    floor: float
    noise: float | None
    """The largest first-token logprob difference between two plain runs (check 10);
    None where the run did not measure it."""

    @property
    def measured(self) -> bool:
        return self.noise is not None and math.isfinite(self.noise)

    @property
    def value(self) -> float:
        """The margins are differences of bf16 logits, whole bf16 steps; the noise is
        measured on fp32 log-softmaxes of them, so it reads a step a little short. SLACK
        covers that, as check 10 reads its own tolerance."""
        if self.noise is None or not math.isfinite(self.noise):
            return self.floor
        return max(self.floor, NOISE_HEADROOM * self.noise + SLACK)

    def describe(self) -> str:
        if not self.measured:
            return f"tie tolerance {self.floor:.4f} = the floor, plain noise not measured"
        if self.value > self.floor:
            return (
                f"tie tolerance {self.value:.4f} = {NOISE_HEADROOM:g} x the measured plain noise "
                f"{self.noise:.4f} + {SLACK:.4f} rounding, floor {self.floor:.4f}"
            )
        return f"tie tolerance {self.floor:.4f} = the floor, measured plain noise {self.noise:.4f}"

    def to_json(self) -> dict[str, Any]:
        source = "floor" if self.value == self.floor else "measured plain noise"
        return {
            "value": self.value,
            "floor": self.floor,
            "noise": self.noise if self.measured else None,
            "source": source,
        }


def check_lossless(
    speculative: list[Completion],
    plain: list[Completion],
    prompts: list[str],
    margins: list[dict[str, Any]] | None = None,
    tolerance: float = 0.0,
    noise: float | None = None,
) -> CheckResult:
    """Greedy completions with the drafter equal those without it, prompt by prompt.

    ``margins`` (the reference's, one per first difference, in order): how far
    each server's token is below the reference target's best logit there. A lost
    token is one the drafter's run emits where the target would not: more than the
    tie tolerance below the reference's best. Within it the target's own logits tie
    there, so rounding in other kernels (spec decoding runs other batch shapes, and a
    hybrid target's GDN layers other kernels) picks either. Where the drafter's token
    is within it and the plain run's is not, the plain engine is the one the
    reference puts off its best: the evidence names those, and they are no loss of
    the drafter's (a plain engine off the model fails check 10, which holds the two
    engines' logprobs to each other at every position). The tie tolerance is
    ``tolerance`` (the floor), or where larger check 10's tolerance over ``noise``: what
    two plain runs of the same prompts differ by, as check 10 measured it (None: not
    measured), since a difference within what plain runs move is a tie too.
    """
    if len(speculative) != len(prompts) or len(plain) != len(prompts):
        return error(
            LOSSLESS,
            f"got {len(speculative)} speculative and {len(plain)} plain completions "
            f"for {len(prompts)} prompts",
        )
    differing = first_differences(speculative, plain)
    tokens = len(_tokens(speculative[0])) if speculative else 0
    if not differing:
        return CheckResult(
            LOSSLESS,
            PASS,
            f"{len(prompts)}/{len(prompts)} greedy completions identical with and without the "
            f"drafter ({tokens} tokens each)",
        )
    where = _named(differing[:3])
    count = f"{len(differing)}/{len(prompts)} greedy completions differ with the drafter"
    details: dict[str, Any] = {"differing": differing, "margins": margins}
    if not margins or len(margins) != len(differing):
        return CheckResult(
            LOSSLESS, FAIL, f"{count} ({where}); the target's margins there unknown", details
        )
    tie = TieTolerance(tolerance, noise)
    details["tie_tolerance"] = tie.to_json()
    spreads = [m["spread"] for m in margins if m.get("spread") is not None]
    pairs = list(zip(differing, margins, strict=True))
    lost = [d for d, m in pairs if m["spec_gap"] > tie.value]
    plain_off = [d for d, m in pairs if m["spec_gap"] <= tie.value < m["plain_gap"]]
    details["lost"] = [d["prompt"] for d in lost]
    details["plain_past_tie"] = [d["prompt"] for d in plain_off]

    def gaps(side: str) -> str:
        return ", ".join(f"{m[side]:.4f}" for m in margins)

    # The verdict's reason first: a report's table shows the evidence's start.
    if lost:
        verdict = f"{len(lost)} where the drafter's token is past the tie ({_named(lost)})"
    elif plain_off:
        verdict = (
            f"the drafter's token at a tie of the target's logits at each, and "
            f"{len(plain_off)} where the plain run's is the one past it ({_named(plain_off)})"
        )
    else:
        verdict = f"each at a tie ({where})"
    evidence = (
        f"{count}, {verdict}; the target's logits there: the drafter's tokens within "
        f"{gaps('spec_gap')}, the plain run's within {gaps('plain_gap')} of its best "
        f"({tie.describe()}"
        + (f"; the logits' spread there {min(spreads):.2f} or more)" if spreads else ")")
    )
    return CheckResult(LOSSLESS, FAIL if lost else PASS, evidence, details)


def check_aux_layers(
    observed: tuple[int, ...] | None,
    expected: tuple[int, ...] | None,
    source: str,
    captured: tuple[int, ...] | None = None,
) -> CheckResult:
    """The engine captures target_layer_ids + 1 (HF ``hidden_states[id + 1]``).

    ``observed``: what the runner says (its log line). ``captured``: the HF layer
    each context-feature slice the drafter really received is nearest to (the
    reference run); it is what a compiled graph computes, whatever the runner says.
    """
    if expected is None:
        return error(AUX_LAYERS, "the drafter config has no dflash_config.target_layer_ids")
    if observed is None:
        return error(AUX_LAYERS, f"no 'Using auxiliary layers' line in {source}")
    details = {
        "observed": list(observed),
        "expected": list(expected),
        "source": source,
        "captured": list(captured) if captured is not None else None,
    }
    unchanged = tuple(i - 1 for i in expected)
    if observed == expected and captured not in (None, expected):
        return CheckResult(
            AUX_LAYERS,
            FAIL,
            f"runner says {observed}, but the drafter received hidden states of HF layers "
            f"{captured} (a compiled graph with other layers baked in?)",
            details,
        )
    if observed == expected:
        also = " (drafter's features match)" if captured is not None else ""
        return CheckResult(
            AUX_LAYERS, PASS, f"engine captures {observed} = target_layer_ids + 1{also}", details
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
    block_size: int | None = None
    """The engine's block size as its log states it (vLLM enlarges a hybrid target's
    attention blocks to the Mamba page); None where it states none."""


def full_block_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens a repeated prompt can take from the cache.

    Whole blocks only, and never the last prompt token, which must be computed
    to sample from: ((n - 1) // block) * block.
    """
    return ((prompt_tokens - 1) // block_size) * block_size


def prefix_prompt_tokens(block_size: int | None, max_model_len: int) -> int:
    """The repeated prompt's length on an engine whose log states ``block_size``: two
    full blocks and a tail, so that one dropped block still leaves one to tell by, and
    never shorter than PREFIX_PROMPT_TOKENS. SmokeError naming the figures where the
    prompt and its answer do not fit ``max_model_len``."""
    if block_size is None:
        return PREFIX_PROMPT_TOKENS
    tokens = max(PREFIX_PROMPT_TOKENS, 2 * block_size + PREFIX_TAIL_TOKENS)
    if tokens + PREFIX_MAX_TOKENS > max_model_len:
        raise SmokeError(
            f"the repeated prompt needs two {block_size}-token blocks and a "
            f"{PREFIX_TAIL_TOKENS}-token tail ({tokens} tokens) and {PREFIX_MAX_TOKENS} to "
            f"generate: more than max_model_len {max_model_len}"
        )
    return tokens


def check_prefix_cache(
    speculative: PrefixObservation, plain: PrefixObservation | None, block_size: int | None
) -> CheckResult:
    """A repeated prompt gets every full block from the cache with the DFlash drafter on.

    ``block_size`` is the configured one; an observation's own (its engine's log) takes
    its place. Where neither is known (a hybrid target whose engine stated none) the
    check compares with the server without speculation, which must reuse something.
    """
    size = speculative.block_size or block_size
    control_size = (plain.block_size or block_size) if plain else None
    control_expected: int | None
    if size is None:
        if plain is None or plain.hits <= 0 or plain.prompt_tokens != speculative.prompt_tokens:
            return error(PREFIX_CACHE, "no control reuse to compare with (hybrid target)")
        expected = control_expected = int(plain.hits)
    else:
        expected = full_block_tokens(speculative.prompt_tokens, size)
        control_expected = (
            full_block_tokens(plain.prompt_tokens, control_size) if plain and control_size else None
        )
    details: dict[str, Any] = {
        "expected": expected,
        "speculative": asdict(speculative),
        "plain": asdict(plain) if plain else None,
        "block_size": size or 0,
    }
    if expected == 0:
        return CheckResult(
            PREFIX_CACHE,
            ERROR,
            f"the repeated {speculative.prompt_tokens}-token prompt fills no {size}-token "
            "block: cannot judge",
            details,
        )
    if plain is not None and control_expected is not None and plain.hits != control_expected:
        return CheckResult(
            PREFIX_CACHE,
            ERROR,
            f"control server without speculation cached {plain.hits:.0f} of "
            f"{plain.prompt_tokens} tokens, expected {control_expected}: cannot judge",
            details,
        )
    summary = f"repeated {speculative.prompt_tokens}-token prompt: {speculative.hits:.0f} tokens "
    if speculative.block_size is None:
        control = f", {plain.hits:.0f} without speculation" if plain else ""
        summary += f"from the cache with DFlash{control} (full blocks: {expected})"
    else:
        summary += f"from the cache with DFlash (full {size}-token blocks: {expected})"
        if plain is not None:
            summary += (
                f"; {plain.hits:.0f} of a {plain.prompt_tokens}-token prompt without speculation"
            )
            if control_expected is not None:
                summary += f" (full {control_size}-token blocks: {control_expected})"
    if speculative.hits == expected:
        return CheckResult(PREFIX_CACHE, PASS, summary, details)
    dropped = size and speculative.hits == expected - size
    hint = " (one block dropped: fix 3 absent)" if dropped else ""
    if not size and speculative.hits < expected:
        hint = " (less than without speculation: fix 3 absent?)"
    return CheckResult(PREFIX_CACHE, FAIL, summary + hint, details)


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


def check_warm_cache(
    runs: dict[str, dict[str, Any] | None], gate: float, expected: Any
) -> CheckResult:
    """B (the wheel under test right after another build compiled into the same cache)
    keeps fidelity. ``runs``: A, B, C fidelity results (C: the main run, cold cache)."""

    def show(name: str) -> str:
        r = runs.get(name)
        if not r or r.get("agreement") is None:
            return f"{name} n/a"
        layers = (r.get("feature_layers") or {}).get("nearest")
        return f"{name} {r['agreement']:.1%}" + (f" layers {tuple(layers)}" if layers else "")

    evidence = "; ".join(show(n) for n in ("A", "B", "C"))
    details = {"runs": runs, "expected_layers": expected}
    if runs.get("B") is None:
        return CheckResult(WARM_CACHE, ERROR, f"run B did not finish: {evidence}", details)
    ok = fidelity_passes(runs["B"], gate, expected)
    return CheckResult(
        WARM_CACHE,
        PASS if ok else FAIL,
        f"{evidence} (A other build, B wheel after A, one cache; C cleared; gate {gate:.0%})",
        details,
    )


def check_slot_audit(audit: dict[str, Any], boundary: dict[str, Any] | None = None) -> CheckResult:
    """No first-pass query slot outside its request's blocks, over passes that include a
    row ending on a block's first slot: without one, stock vLLM's K-slot reservation would
    pass as well, and a verdict the audit could not reach is not a pass. ``boundary``: the
    run's boundary prompt (``engine_run``), whose reason it was not served is shown."""
    from .serving.slotaudit import SlotAudit, verdict_counts

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
    by there, every compared position's within twice what they differ by at those positions
    (``distribution.NOISE_HEADROOM``). A prompt the comparison could not judge is no pass:
    the check is an error, naming it."""
    rows = [r for r in report.rows if r.workload == "alone"]
    tolerance = (
        f"tolerance {report.tolerance:.4f} at the first token, {report.later_tolerance:.4f} "
        f"at every position ({NOISE_HEADROOM:g} x the plain noise {report.noise:.4f}, "
        f"{report.later_noise:.4f})"
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
