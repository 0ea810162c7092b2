"""The verdicts of a run from what its steps observed (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from . import checks
from .checks import CheckResult
from .config import LOSSLESS_PROMPTS, DrafterInfo, SmokeConfig
from .distribution import Report
from .observe import ServerObservations
from .serving.agreement import with_tolerance


def lossless_divergences(
    spec: ServerObservations, plain: ServerObservations
) -> list[dict[str, Any]]:
    """Where the servers' greedy completions first differ, as the reference's input:
    ``context`` (prompt ids and the common tokens) and ``tokens`` (with, without the
    drafter). Empty when any difference cannot be placed (the check then says so)."""
    ids = spec.prompt_ids
    if ids is None or len(spec.completions) != len(ids) or len(plain.completions) != len(ids):
        return []
    found = []
    for d in checks.first_differences(spec.completions, plain.completions):
        i, first = d["prompt"], d["first_difference"]
        if first is None or len(ids[i]) != spec.completions[i].prompt_tokens:
            return []  # one is a prefix of the other, or the ids are not what was served
        found.append(
            {
                "context": ids[i] + list(d["spec"][:first]),
                "tokens": [d["spec"][first], d["plain"][first]],
            }
        )
    return found


def _why(obs: ServerObservations | None, key: str) -> str:
    if obs is None:
        return "the server did not run"
    return obs.errors.get(key, "")


@dataclass(frozen=True)
class _Seen:
    """What the steps observed, as ``evaluate`` is handed it."""

    config: SmokeConfig
    info: DrafterInfo | None
    info_error: str
    spec: ServerObservations | None
    plain: ServerObservations | None
    engine_result: dict[str, Any] | None
    engine_error: str
    fidelity: dict[str, Any] | None
    fidelity_error: str
    warm: dict[str, dict[str, Any] | None] | None
    first_tokens: Report | None
    first_tokens_error: str
    block_size: int | None

    @property
    def noise(self) -> float | None:
        return self.first_tokens.noise if self.first_tokens else None

    @property
    def fidelity_tie(self) -> checks.TieTolerance:
        return checks.TieTolerance(self.config.fidelity_tie_tolerance, self.noise)


def _lossless(seen: _Seen) -> CheckResult:
    spec, plain = seen.spec, seen.plain
    if spec is None or plain is None or "lossless" in spec.errors or "lossless" in plain.errors:
        why = _why(spec, "lossless") or _why(plain, "lossless")
        return checks.error(checks.LOSSLESS, f"completions missing: {why}")
    return checks.check_lossless(
        spec.completions,
        plain.completions,
        list(LOSSLESS_PROMPTS),
        margins=(seen.fidelity or {}).get("divergences"),
        tolerance=seen.config.lossless_tie_tolerance,
        noise=seen.noise,
    )


def _aux_layers(seen: _Seen) -> CheckResult:
    """The server log; the in-process run's record when the log has none."""
    spec, info, engine_result = seen.spec, seen.info, seen.engine_result
    if info is None:
        return checks.error(checks.AUX_LAYERS, seen.info_error)
    observed = spec.aux_layers if spec else None
    source = f"the server log {spec.log}" if spec else "the server log"
    if observed is None and engine_result and engine_result.get("aux_layers"):
        observed = tuple(engine_result["aux_layers"])
        source = "the in-process model runner"
    layers = (seen.fidelity or {}).get("feature_layers") or {}
    captured = tuple(layers["nearest"]) if layers.get("nearest") else None
    return checks.check_aux_layers(observed, info.expected_aux_layers(), source, captured)


def _drafter_windows(seen: _Seen) -> CheckResult:
    if seen.info is None:
        return checks.error(checks.DRAFTER_WINDOWS, seen.info_error)
    if seen.engine_result is None:
        return checks.error(checks.DRAFTER_WINDOWS, seen.engine_error)
    return checks.check_windows(seen.engine_result["windows"], seen.info.expected_windows())


def _prefix_cache(seen: _Seen) -> CheckResult:
    spec, plain = seen.spec, seen.plain
    if spec is None or spec.prefix is None:
        why = _why(spec, "prefix")
        return checks.error(checks.PREFIX_CACHE, f"no prefix-cache observation: {why}")
    control = plain.prefix if plain else None
    return checks.check_prefix_cache(spec.prefix, control, seen.block_size)


def _fidelity(seen: _Seen) -> CheckResult:
    if seen.fidelity is None:
        return checks.error(checks.FIDELITY, seen.fidelity_error)
    tie = seen.fidelity_tie
    gated = with_tolerance(seen.fidelity, tie.value)
    verdict = checks.check_fidelity(gated, seen.config.fidelity_gate, tie)
    if seen.config.engine.kv_cache_dtype != "auto":
        # A quantized KV cache is not the bf16 reference's arithmetic: the
        # figure is reported, not gated.
        verdict = replace(verdict, status=checks.INFO)
    return verdict


def _acceptance(seen: _Seen) -> CheckResult:
    spec = seen.spec
    if spec is None or "metrics" in spec.errors:
        why = _why(spec, "metrics")
        return checks.error(checks.ACCEPTANCE, f"no /metrics: {why}")
    return checks.check_acceptance(spec.spec_stats, seen.config.min_acceptance_length)


def _warm_cache(seen: _Seen) -> CheckResult:
    expected = seen.info.expected_aux_layers() if seen.info else None
    tie = seen.fidelity_tie.value
    runs = {
        name: with_tolerance(run, tie) if run else run for name, run in (seen.warm or {}).items()
    }
    return checks.check_warm_cache(runs, seen.config.fidelity_gate, expected)


def _slot_audit(seen: _Seen) -> CheckResult:
    """The in-process concurrent batch."""
    engine_result = seen.engine_result
    if engine_result is None or engine_result.get("slot_audit") is None:
        return checks.error(checks.SLOT_AUDIT, f"no in-process run: {seen.engine_error}")
    audit, boundary = engine_result["slot_audit"], engine_result.get("boundary_prompt")
    return checks.check_slot_audit(audit, boundary)


def _load(seen: _Seen) -> CheckResult:
    """Concurrent load through both servers."""
    spec, plain = seen.spec, seen.plain
    if spec is None or plain is None or spec.load is None or plain.load is None:
        why = _why(spec, "load") or _why(plain, "load") or "no bursts ran"
        return checks.error(checks.LOAD, f"no concurrent load: {why}")
    return checks.check_load(spec.load, plain.load)


def _first_tokens(seen: _Seen) -> CheckResult:
    """The first tokens of K, K+1 and K+2-token prompts, each alone."""
    if seen.first_tokens is None:
        return checks.error(checks.FIRST_TOKENS, seen.first_tokens_error)
    return checks.check_first_tokens(seen.first_tokens)


#: Each check's judge, in the report's order (1 to 10).
_JUDGES: tuple[tuple[str, Callable[[_Seen], CheckResult]], ...] = (
    (checks.LOSSLESS, _lossless),
    (checks.AUX_LAYERS, _aux_layers),
    (checks.DRAFTER_WINDOWS, _drafter_windows),
    (checks.PREFIX_CACHE, _prefix_cache),
    (checks.FIDELITY, _fidelity),
    (checks.ACCEPTANCE, _acceptance),
    (checks.WARM_CACHE, _warm_cache),
    (checks.SLOT_AUDIT, _slot_audit),
    (checks.LOAD, _load),
    (checks.FIRST_TOKENS, _first_tokens),
)


def evaluate(
    *,
    config: SmokeConfig,
    planned: dict[str, str],
    info: DrafterInfo | None,
    info_error: str,
    spec: ServerObservations | None,
    plain: ServerObservations | None,
    engine_result: dict[str, Any] | None,
    engine_error: str,
    fidelity: dict[str, Any] | None,
    fidelity_error: str,
    warm: dict[str, dict[str, Any] | None] | None = None,
    first_tokens: Report | None = None,
    first_tokens_error: str = "",
    block_size: int | None = 16,
) -> list[CheckResult]:
    """The verdicts from whatever the steps observed (pure: no I/O). ``planned`` is the
    plan's check id -> ``run`` or why it is skipped.

    ``block_size``: the configured one; None (a hybrid target) takes each engine's
    from its log, or judges prefix reuse against the server without speculation.
    ``first_tokens`` also gives checks 1 and 5 the plain noise it measured: their tie
    tolerances grow to twice it where that is past their floors.
    """
    seen = _Seen(
        config,
        info,
        info_error,
        spec,
        plain,
        engine_result,
        engine_error,
        fidelity,
        fidelity_error,
        warm,
        first_tokens,
        first_tokens_error,
        block_size,
    )
    results = []
    for check, judge in _JUDGES:
        why = planned.get(check, "run")
        results.append(judge(seen) if why == "run" else checks.skipped(check, why))
    return results
