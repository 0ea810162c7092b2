"""Checks 1 to 3: the greedy completions with and without the drafter, the drafter's
auxiliary layers, and each drafter layer's attention window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..client import Completion
from ..distribution import NOISE_HEADROOM, SLACK
from .base import (
    AUX_LAYERS,
    DRAFTER_WINDOWS,
    FAIL,
    LOSSLESS,
    PASS,
    CheckResult,
    completion_tokens,
    error,
    first_differences,
    named,
)


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
    tokens = len(completion_tokens(speculative[0])) if speculative else 0
    if not differing:
        return CheckResult(
            LOSSLESS,
            PASS,
            f"{len(prompts)}/{len(prompts)} greedy completions identical with and without the "
            f"drafter ({tokens} tokens each)",
        )
    where = named(differing[:3])
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
        verdict = f"{len(lost)} where the drafter's token is past the tie ({named(lost)})"
    elif plain_off:
        verdict = (
            f"the drafter's token at a tie of the target's logits at each, and "
            f"{len(plain_off)} where the plain run's is the one past it ({named(plain_off)})"
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
