"""A probe's verdict from cases served by the scheduler fuzzer's engine (``_schedstep``)."""

from __future__ import annotations

from ._schedsim import OUTCOME_PASS, Outcome
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult


def served_verdict(
    name: str, lead: str, results: list[tuple[str, Outcome]], defects: tuple[str, ...]
) -> ProbeResult:
    """Present when every case was served; absent when the failures are all the fix's
    ``defects``; unknown otherwise (a refusal, a crash: no answer about the fix)."""
    rows = []
    for label, o in results:
        shape = f"{o.facts.get('block_size', '?')}-token blocks, {o.facts.get('num_blocks', '?')}"
        said = (
            f"served in {o.steps} steps"
            if o.outcome == OUTCOME_PASS
            else (f"{o.outcome}: {o.detail}")
        )
        rows.append(f"{label} ({shape} blocks): {said}")
    kinds = {o.outcome for _, o in results}
    if kinds == {OUTCOME_PASS}:
        status = PRESENT
    elif kinds & set(defects) and kinds <= {OUTCOME_PASS, *defects}:
        status = ABSENT
    else:
        status = UNKNOWN
    details = [
        {
            "case": label,
            "outcome": o.outcome,
            "detail": o.detail,
            "steps": o.steps,
            "facts": o.facts,
        }
        for label, o in results
    ]
    return ProbeResult(
        probe=name,
        status=status,
        evidence=f"{lead}: " + "; ".join(rows),
        details={"outcomes": details},
    )
