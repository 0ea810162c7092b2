"""The verdicts of a run from what its steps observed (pure: no I/O)."""

from __future__ import annotations

from dataclasses import replace
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
    results: list[CheckResult] = []
    noise = first_tokens.noise if first_tokens else None

    def skip(check: str) -> CheckResult | None:
        why = planned.get(check, "run")
        return None if why == "run" else checks.skipped(check, why)

    # 1. lossless
    if skipped := skip(checks.LOSSLESS):
        results.append(skipped)
    elif spec is None or plain is None or "lossless" in spec.errors or "lossless" in plain.errors:
        why = _why(spec, "lossless") or _why(plain, "lossless")
        results.append(checks.error(checks.LOSSLESS, f"completions missing: {why}"))
    else:
        results.append(
            checks.check_lossless(
                spec.completions,
                plain.completions,
                list(LOSSLESS_PROMPTS),
                margins=(fidelity or {}).get("divergences"),
                tolerance=config.lossless_tie_tolerance,
                noise=noise,
            )
        )

    # 2. aux layers: the server log; the in-process run's record when the log has none
    if skipped := skip(checks.AUX_LAYERS):
        results.append(skipped)
    elif info is None:
        results.append(checks.error(checks.AUX_LAYERS, info_error))
    else:
        observed = spec.aux_layers if spec else None
        source = f"the server log {spec.log}" if spec else "the server log"
        if observed is None and engine_result and engine_result.get("aux_layers"):
            observed = tuple(engine_result["aux_layers"])
            source = "the in-process model runner"
        layers = (fidelity or {}).get("feature_layers") or {}
        captured = tuple(layers["nearest"]) if layers.get("nearest") else None
        results.append(
            checks.check_aux_layers(observed, info.expected_aux_layers(), source, captured)
        )

    # 3. drafter windows
    if skipped := skip(checks.DRAFTER_WINDOWS):
        results.append(skipped)
    elif info is None:
        results.append(checks.error(checks.DRAFTER_WINDOWS, info_error))
    elif engine_result is None:
        results.append(checks.error(checks.DRAFTER_WINDOWS, engine_error))
    else:
        results.append(checks.check_windows(engine_result["windows"], info.expected_windows()))

    # 4. prefix cache
    if skipped := skip(checks.PREFIX_CACHE):
        results.append(skipped)
    elif spec is None or spec.prefix is None:
        why = _why(spec, "prefix")
        results.append(checks.error(checks.PREFIX_CACHE, f"no prefix-cache observation: {why}"))
    else:
        control = plain.prefix if plain else None
        results.append(checks.check_prefix_cache(spec.prefix, control, block_size))

    # 5. fidelity
    fidelity_tie = checks.TieTolerance(config.fidelity_tie_tolerance, noise)
    if skipped := skip(checks.FIDELITY):
        results.append(skipped)
    elif fidelity is None:
        results.append(checks.error(checks.FIDELITY, fidelity_error))
    else:
        gated = with_tolerance(fidelity, fidelity_tie.value)
        verdict = checks.check_fidelity(gated, config.fidelity_gate, fidelity_tie)
        if config.engine.kv_cache_dtype != "auto":
            # A quantized KV cache is not the bf16 reference's arithmetic: the
            # figure is reported, not gated.
            verdict = replace(verdict, status=checks.INFO)
        results.append(verdict)

    # 6. acceptance
    if skipped := skip(checks.ACCEPTANCE):
        results.append(skipped)
    elif spec is None or "metrics" in spec.errors:
        why = _why(spec, "metrics")
        results.append(checks.error(checks.ACCEPTANCE, f"no /metrics: {why}"))
    else:
        results.append(checks.check_acceptance(spec.spec_stats, config.min_acceptance_length))

    # 7. warm compile cache
    if skipped := skip(checks.WARM_CACHE):
        results.append(skipped)
    else:
        expected = info.expected_aux_layers() if info else None
        runs = {
            name: with_tolerance(run, fidelity_tie.value) if run else run
            for name, run in (warm or {}).items()
        }
        results.append(checks.check_warm_cache(runs, config.fidelity_gate, expected))

    # 8. lookahead-slot audit (the in-process concurrent batch)
    if skipped := skip(checks.SLOT_AUDIT):
        results.append(skipped)
    elif engine_result is None or engine_result.get("slot_audit") is None:
        results.append(checks.error(checks.SLOT_AUDIT, f"no in-process run: {engine_error}"))
    else:
        audit, boundary = engine_result["slot_audit"], engine_result.get("boundary_prompt")
        results.append(checks.check_slot_audit(audit, boundary))

    # 9. concurrent load through both servers
    if skipped := skip(checks.LOAD):
        results.append(skipped)
    elif spec is None or plain is None or spec.load is None or plain.load is None:
        why = _why(spec, "load") or _why(plain, "load") or "no bursts ran"
        results.append(checks.error(checks.LOAD, f"no concurrent load: {why}"))
    else:
        results.append(checks.check_load(spec.load, plain.load))

    # 10. first tokens of K, K+1 and K+2-token prompts, each alone
    if skipped := skip(checks.FIRST_TOKENS):
        results.append(skipped)
    elif first_tokens is None:
        results.append(checks.error(checks.FIRST_TOKENS, first_tokens_error))
    else:
        results.append(checks.check_first_tokens(first_tokens))
    return results
