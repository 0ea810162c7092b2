"""The smoke checks as pure functions: observations in, a verdict with evidence out.

Nothing here runs a process or touches the network, so each verdict can be
tested on captured observations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from ..client import Completion


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


def completion_tokens(c: Completion) -> tuple[Any, ...]:
    return c.token_ids if c.token_ids is not None else (c.text,)


def named(differing: list[dict[str, Any]]) -> str:
    return ", ".join(f"prompt {d['prompt']} at token {d['first_difference']}" for d in differing)


def first_differences(
    speculative: list[Completion], plain: list[Completion]
) -> list[dict[str, Any]]:
    """Per prompt whose completions differ: where first, and both token lists."""
    differing = []
    for i, (a, b) in enumerate(zip(speculative, plain, strict=True)):
        ta, tb = completion_tokens(a), completion_tokens(b)
        if ta != tb:
            first = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
            differing.append({"prompt": i, "first_difference": first, "spec": ta, "plain": tb})
    return differing
