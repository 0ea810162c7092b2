"""Fix 17: the draft tokens a step verifies follow how many requests run, as configured.

``num_speculative_tokens_per_batch_size`` maps [first, last, K] ranges of running requests
to the K a step verifies (the drafter still drafts ``num_speculative_tokens``): verifying
fewer drafts when many requests run keeps a step's verify work, which grows with
requests x (1 + K), below what plain decoding of the same requests would gain
(docs/notebook/2026-12-04-speed.md).

The probe serves a workload on vLLM's own scheduler for the seed's pair (the scheduler
fuzzer's engine, ``_schedsim``/``_schedstep``, with its oracles: no stall, livelock, slot
written outside a request's blocks) with DFlash at K = 15 and the schedule
``[[1, 4, 15], [5, 1024, 3]]``: eight requests decode together, then finish at different
lengths. Fixed means the workload passes the oracles, no request verifies more than 3 drafts
in a step where more than four requests run, and steps with four or fewer verify 15; and a
schedule that cannot be served (a K above ``num_speculative_tokens``) is refused while the
config is built, or, as vLLM's own option does, served with no step verifying more than K.
Stock 0.20.1 has no such option and refuses it. From 0.24.0 vLLM takes the option (#32374):
its scheduler looks up each step's K by how many requests it schedules and clamps a range's
K to ``num_speculative_tokens``, which this stand-in sees.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._schedsim import Case, Req, Settings, engine_config, h200_platform
from ._schedstep import run_case
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "spec_tokens_by_batch"
K = 15
SCHEDULE = ((1, 4, K), (5, 1024, 3))
#: Eight requests at once, each finishing at its own length.
REQUESTS = tuple(Req(arrival=0, prompt_len=40, max_tokens=24 + 16 * i) for i in range(8))


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    settings = Settings(k=K, max_num_seqs=64, spec_tokens_by_batch=SCHEDULE)
    seen: list[tuple[int, int]] = []

    def observe(scheduler: Any, out: Any) -> None:
        drafts = [len(v) for v in out.scheduled_spec_decode_tokens.values()]
        if drafts:
            seen.append((len(scheduler.running), max(drafts)))

    with h200_platform():
        try:
            outcome = run_case(Case(settings, REQUESTS, seed=3), root, observe=observe)
        except Exception as e:  # a release that cannot build the engine asked for
            return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot ask: {e}"[:300])
        too_many = Settings(k=K, max_num_seqs=64, spec_tokens_by_batch=((1, 8, K + 1),))
        try:
            engine_config(too_many, root)
            refused = ""
        except Exception as e:  # the refusal asked for
            refused = " ".join(str(e).split())
        over: list[int] = []
        if not refused:
            # Served instead: no step may verify more drafts than the drafter makes.
            def drafts(scheduler: Any, out: Any) -> None:
                over.extend(len(v) for v in out.scheduled_spec_decode_tokens.values())

            run_case(Case(too_many, REQUESTS[:4], seed=3), root, observe=drafts)
    crowded = max((d for n, d in seen if n > 4), default=None)
    few = {d for n, d in seen if n <= 4}
    evidence = (
        f"outcome {outcome.outcome} {outcome.detail}".strip()
        + f"; most drafts verified a step with more than 4 running: {crowded}, with 4 or fewer: "
        f"{sorted(few)}; K = {K + 1} in a range: "
        + (
            f"refused ({refused[:160]})"
            if refused
            else f"served, at most {max(over, default=0)} drafts verified a step"
        )
    )
    unservable_handled = (
        "num_speculative_tokens_per_batch_size" in refused
        if refused
        else bool(over) and max(over) <= K
    )
    fixed = (
        outcome.outcome == "pass"
        and crowded is not None
        and crowded <= 3
        and K in few
        and unservable_handled
    )
    return ProbeResult(
        probe=NAME,
        status=PRESENT if fixed else ABSENT,
        evidence=evidence,
        details={"steps": seen[:200], "outcome": outcome.outcome},
    )
