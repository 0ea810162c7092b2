"""Fix 38: a verify step of the last step's layout reuses its speculative metadata.

Each verify step, vLLM 0.20.1's V1 runner computes the speculative metadata the rejection
sampler reads (draft counts and their running sums, the logits, target and bonus indices)
from the step's draft counts and scheduled tokens, with numpy (two running sums, two repeats
and their aranges), and uploads it (fix 34 packs it into one copy). In a steady run of verify
steps every request verifies the same K drafts, so every step computes and uploads the same
arrays again: host time at each step, at one request a part of a step that is host time.

The probe drives the V1 model runner for a hybrid target with a DFlash drafter at K = 3
through its own ``execute_model`` up to the model's forward, with vLLM's real Scheduler and
the runner's asynchronous state (``spec_inputs_upload``'s harness), over four verify steps:
every request verifies all K drafts; again (the same layout); then uneven drafts (K, K,
K - 1 and 1: another layout); then all K again. For each it reads what the forward gets,
each value against what the step's layout and drafts make it (``spec_inputs_upload``), and
counts, inside ``_calc_spec_decode_metadata``, the layouts computed (calls of the runner's
running sum and arange) and the uploads of fix 34's packed copy.

Present: every step's values right; the second step computes no layout and uploads nothing,
and the last computes its layout again (the uneven step's was another). Absent: right, but
the second step computes or uploads. Unknown: a value wrong (another defect, or a layout
reused where it is not the step's), no V1 runner (0.34.0's V2 runner computes a step's
logits indices in a kernel on the device), or steps that do not run as written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from . import _harness
from ._v1 import CannotStep, v1_steps
from .accepted_state import K, _Served
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_inputs_upload import RIDS, UNEVEN, Count, Seen, _handed_on, _read

NAME = "spec_metadata_reuse"
#: The drafts each request hands on before each step after the first.
HANDED_ON = {
    "again": dict.fromkeys(RIDS, K),
    "uneven": UNEVEN,
    "uniform again": dict.fromkeys(RIDS, K),
}


@dataclass
class Work:
    """What ``_calc_spec_decode_metadata`` did in one step."""

    layouts: int = 0
    """Calls of the runner's running sum and arange: two for each layout computed."""
    uploads: int = 0
    """Fix 34's packed copies of the metadata to the device (without fix 34 the layout's
    computation alone says the step did the work again)."""


@contextmanager
def _watching(runner: Any, work: Work) -> Iterator[None]:
    """Count into ``work``, for the ``with`` body, what the metadata's computation does."""
    inside = [False]
    calc = runner._calc_spec_decode_metadata
    cumsum = runner._get_cumsum_and_arange
    upload = getattr(runner, "_spec_decode_upload", None)

    def calc_counted(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return calc(*args, **kwargs)
        finally:
            inside[0] = False

    def cumsum_counted(*args: Any, **kwargs: Any) -> Any:
        work.layouts += inside[0]
        return cumsum(*args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(
            _harness.replaced(
                runner,
                _calc_spec_decode_metadata=calc_counted,
                _get_cumsum_and_arange=cumsum_counted,
            )
        )
        if upload is not None:
            copy = upload.copy_to_gpu

            def copied(*args: Any, **kwargs: Any) -> Any:
                work.uploads += inside[0]
                return copy(*args, **kwargs)

            stack.enter_context(_harness.replaced(upload, copy_to_gpu=copied))
        yield


def _step(served: _Served, out: Any, salt: int) -> tuple[Seen, Work]:
    """Run ``out``'s step with new sampled tokens and drafts (each a value of its own)."""
    sampled = [salt + i for i in range(len(RIDS))]
    drafts = [[salt + 100 + 10 * i + j for j in range(K)] for i in range(len(RIDS))]
    _handed_on(served, sampled, drafts)
    work = Work()
    with _watching(served.runner, work):
        seen = _read(served, out, sampled, drafts, Count())
    return seen, work


def _steps() -> dict[str, tuple[Seen, Work]]:
    from vllm.v1.outputs import DraftTokenIds

    served = _Served()
    sched = served.scheduler
    out = served.drafted(RIDS)
    if dict(out.num_scheduled_tokens) != dict.fromkeys(RIDS, K + 1):
        raise CannotStep(f"the verify step scheduled {dict(out.num_scheduled_tokens)}")
    steps = {"uniform": _step(served, out, 500)}
    for n, (name, drafted) in enumerate(HANDED_ON.items(), start=1):
        served.sampled(out, dict.fromkeys(RIDS, 2))
        sched.update_draft_token_ids(DraftTokenIds(RIDS, [[8] * drafted[r] for r in RIDS]))
        out = sched.schedule()
        steps[name] = _step(served, out, 500 + 1000 * n)
    return steps


def run() -> ProbeResult:
    why = "the V2 runner computes a step's logits indices in a kernel on the device"
    steps = v1_steps(NAME, why, _steps)
    if isinstance(steps, ProbeResult):
        return steps
    work = {name: (w.layouts, w.uploads) for name, (_, w) in steps.items()}
    details = {"layouts_and_uploads": work}
    wrong = {name: seen.wrong for name, (seen, _) in steps.items() if seen.wrong}
    if wrong:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"a verify step's inputs are wrong: {wrong}",
            details=details,
        )
    said = "; ".join(f"{name}: {n} layout calls, {u} uploads" for name, (n, u) in work.items())
    evidence = (
        f"hybrid target, DFlash K={K}, asynchronous scheduling, four verify steps, every "
        f"step's input ids and speculative metadata right; {said}"
    )
    if work["uniform again"][0] == 0:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="a step after another layout computed none of its own: " + evidence,
            details=details,
        )
    reused = work["again"] == (0, 0)
    return ProbeResult(
        probe=NAME, status=PRESENT if reused else ABSENT, evidence=evidence, details=details
    )
