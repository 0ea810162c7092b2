"""Fix 33: prompts can wait a few verify steps to join one step together (join_hold_steps).

A step in which a prompt joins requests that verify drafts runs the target's prefill path,
whose host cost on a hybrid target hardly depends on how many prompts join. With
``"join_hold_steps": N`` a prompt that arrives while every running request only decodes
waits up to N steps, so that prompts arriving a few steps apart join together.

The probe serves the seed's geometry at K = 15 with vLLM's real Scheduler (``_schedsim``,
``_schedstep``: its starvation, stall and slot checks stay on) and reads, from each
``schedule()``, the step at which each prompt arrived and the step that first scheduled it:

- ``held``: N = 3, four requests decoding, prompts arriving at steps 8 and 9: the first
  waits 3 steps, the second 2, and both join the same step;
- ``at once``: the same traffic with N = 0 (not set): each joins the step it arrives;
- ``nothing running``: N = 3 and one prompt alone: it is scheduled the step it arrives;
- ``prefilling``: N = 3 with prompts cut into 256-token chunks: a 4000-token prompt arriving
  beside the decodes waits 3 steps, and a prompt arriving while its chunks still run joins at
  once;
- ``full batch``: N = 3 with 4 sequence slots and three decoding: a prompt that would take
  the last slot still waits 3 steps (slots freed meanwhile fill in the same step);
- N = -1 is refused when the config is built, naming the option.

Present: every case serves and waits as above. Absent: no such option in
``SpeculativeConfig``, the option refused, or any wait other than the above.

A release without the option but with vLLM's own prefill cadence (``SchedulerConfig``'s
``prefill_schedule_interval``, applied by the scheduler of a single engine in 0.34.0) is
read by that cadence's behaviour instead, with an interval of N + 1 steps, on the same
traffic:

- ``held``: prompts arriving at steps 1 and 2, after the decodes' prefill at step 0: they
  wait 3 and 2 steps and join one step, as with the option;
- ``at once``: no cadence: each joins the step it arrives;
- ``nothing running``: one prompt alone is scheduled the step it arrives;
- ``spaced``: prompts arriving at steps 8 and 9, long after the last prefill: the first
  joins at once, the second waits out the interval (the cadence spaces the steps that
  prefill; it does not hold a prompt that arrives after a quiet stretch).

Present (the base's own form) when each waits so; absent when a cadence is set and no
prompt waits (a release that applies it only under data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _harness
from ._schedfuzz import has_join_hold
from ._schedsim import OUTCOME_PASS, Case, Outcome, Req, Settings, build_engine, h200_platform
from ._schedstep import run_case
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "join_hold"
K = 15
HOLD = 3
DECODES = tuple(Req(arrival=0, prompt_len=40 + i, max_tokens=300) for i in range(4))
PROMPTS = (
    Req(arrival=8, prompt_len=100, max_tokens=4),
    Req(arrival=9, prompt_len=120, max_tokens=4),
)
#: (label, settings, requests, the steps each of the requests after DECODES (else all) waits,
#: whether those share one step)
CASES = (
    ("held", Settings(k=K, join_hold_steps=HOLD), (*DECODES, *PROMPTS), (HOLD, HOLD - 1), True),
    ("at once", Settings(k=K), (*DECODES, *PROMPTS), (0, 0), False),
    ("nothing running", Settings(k=K, join_hold_steps=HOLD), (PROMPTS[0],), (0,), None),
    (
        "prefilling",
        Settings(k=K, join_hold_steps=HOLD, max_num_seqs=16, long_prefill_token_threshold=256),
        (
            *DECODES,
            Req(arrival=5, prompt_len=4000, max_tokens=4),
            Req(arrival=9, prompt_len=100, max_tokens=4),
        ),
        (HOLD, 0),
        False,
    ),
    (
        "full batch",
        Settings(k=K, join_hold_steps=HOLD, max_num_seqs=4),
        (*DECODES[:3], Req(arrival=0, prompt_len=40, max_tokens=8), PROMPTS[0]),
        (HOLD,),
        None,
    ),
)


#: The same traffic for a release's own prefill cadence, an interval of HOLD + 1 steps: the
#: prompts arrive right after the decodes' prefill, and (``spaced``) long after it.
CADENCE = HOLD + 1
SOON = (Req(arrival=1, prompt_len=100, max_tokens=4), Req(arrival=2, prompt_len=120, max_tokens=4))
CADENCE_CASES = (
    (
        "held",
        Settings(k=K, prefill_schedule_interval=CADENCE),
        (*DECODES, *SOON),
        (HOLD, HOLD - 1),
        True,
    ),
    ("at once", Settings(k=K), (*DECODES, *SOON), (0, 0), False),
    ("nothing running", Settings(k=K, prefill_schedule_interval=CADENCE), (SOON[0],), (0,), None),
    (
        "spaced",
        Settings(k=K, prefill_schedule_interval=CADENCE),
        (*DECODES, *PROMPTS),
        (0, HOLD),
        False,
    ),
)


def has_prefill_cadence() -> bool:
    """Whether the vLLM under test has its own prefill cadence (``prefill_schedule_interval``)."""
    from vllm.config import SchedulerConfig

    return "prefill_schedule_interval" in getattr(SchedulerConfig, "__dataclass_fields__", {})


class _Waits:
    """Each request's first ``schedule()`` call as known and as scheduled."""

    def __init__(self) -> None:
        self.calls = 0
        self.known: dict[str, int] = {}
        self.first: dict[str, int] = {}

    def __call__(self, scheduler: Any, out: Any) -> None:
        for rid in scheduler.requests:
            self.known.setdefault(rid, self.calls)
        for new in out.scheduled_new_reqs:
            self.first.setdefault(new.req_id, self.calls)
        self.calls += 1

    def waited(self, rid: str) -> int | None:
        if rid not in self.first:
            return None
        return self.first[rid] - self.known[rid]


def _case(root: Any, settings: Settings, requests: tuple[Req, ...]) -> tuple[str, _Waits]:
    """The case's outcome line and what it waited."""
    waits = _Waits()
    engine = build_engine(settings, root)
    if isinstance(engine, Outcome):
        return f"refused: {engine.outcome}: {engine.detail}", waits
    outcome = run_case(Case(settings, requests), root, engine, waits)
    if outcome.outcome != OUTCOME_PASS:
        return f"{outcome.outcome}: {outcome.detail}", waits
    return OUTCOME_PASS, waits


@dataclass
class _Served:
    """The cases served: a line each, the labels that waited otherwise, those that did not
    serve, and each case's details."""

    rows: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)

    def verdict(self, form: str) -> ProbeResult:
        status = UNKNOWN if self.broken else ABSENT if self.wrong else PRESENT
        why = f"; wrong: {', '.join(self.wrong)}" if self.wrong else ""
        return ProbeResult(
            probe=NAME,
            status=status,
            evidence=f"K = {K}, the seed's geometry, {form}: " + "; ".join(self.rows) + why,
            details={"cases": self.details},
        )


def _serve(root: Any, cases: tuple[Any, ...]) -> _Served:
    """Each case served, and how it waited against what it should."""
    served = _Served()
    for label, settings, requests, expected, together in cases:
        said, waits = _case(root, settings, requests)
        tail = list(range(len(requests) - len(expected), len(requests)))
        got = tuple(waits.waited(f"r{i}") for i in tail)
        steps = {waits.first.get(f"r{i}") for i in tail}
        shared = len(steps) == 1
        served.details[label] = {
            "outcome": said,
            "waited": got,
            "first_steps": sorted(map(str, steps)),
        }
        served.rows.append(
            f"{label}: {said}, waited {got} steps, {'one step' if shared else 'apart'}"
        )
        if said.startswith("refused") or said == "crash":
            served.broken.append(label)
        elif (
            said != OUTCOME_PASS or got != expected or (together is not None and shared != together)
        ):
            served.wrong.append(label)
    return served


def run() -> ProbeResult:
    with h200_platform():
        if not has_join_hold():
            if not has_prefill_cadence():
                return ProbeResult(
                    probe=NAME,
                    status=ABSENT,
                    evidence="SpeculativeConfig has no join_hold_steps, SchedulerConfig no "
                    "prefill_schedule_interval",
                )
            served = _serve(_harness.scratch_dir(), CADENCE_CASES)
            return served.verdict(f"vLLM's prefill cadence ({CADENCE} steps)")
        root = _harness.scratch_dir()
        served = _serve(root, CASES)
        negative = build_engine(Settings(k=K, join_hold_steps=-1), root)
        refused = isinstance(negative, Outcome) and "join_hold_steps" in negative.detail
        served.details["negative"] = {"refused": refused}
        served.rows.append("a negative count: " + ("refused" if refused else "accepted"))
        if not refused:
            served.wrong.append("a negative count")
        return served.verdict(f"join_hold_steps = {HOLD}")
