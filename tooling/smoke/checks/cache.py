"""Checks 4 and 7: the prefix cache across requests, and a warm compile cache shared with
another build."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...errors import SmokeError
from ..config import PREFIX_MAX_TOKENS, PREFIX_PROMPT_TOKENS, PREFIX_TAIL_TOKENS
from .base import (
    ERROR,
    FAIL,
    PASS,
    PREFIX_CACHE,
    WARM_CACHE,
    CheckResult,
    error,
)
from .engine import (
    fidelity_passes,
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
