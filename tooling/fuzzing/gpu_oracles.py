"""The GPU fuzzer's oracles: pure functions over what the DFlash and the plain engine
recorded of one workload (``serving.gpu_run`` writes it; ``WorkloadRun`` reads it).

Each failure is a ``Verdict`` named by its kind (``gpu_case.KINDS``):

- ``crash``: an engine raised in a step (an illegal memory access, an assertion): it is dead;
- ``hang``: an engine step did not return before the engine's time ran out (the campaign
  names it: the process was stopped mid-workload). A workload the engine itself ended at
  its time (``WorkloadRun.cut``, its steps still returning) is no hang: it is counted, and
  judged only on what both engines finished in it;
- ``stall``: ``STALL_STEPS`` engine steps in a row scheduled nothing and produced nothing
  while a request was unfinished;
- ``livelock``: a request neither finished nor was aborted within the workload's step bound,
  or took more steps than the bound from its arrival to its end;
- ``lossless`` (mode "lossless", a trained pair): a greedy DFlash output differs from the
  plain engine's, at a position where plain's top-2 margin is over ``MARGIN``, or ends
  otherwise (length, finish reason), or one engine refused a request the other took; a
  difference at a near tie is excused, and listed. Each token difference, flagged or
  excused, keeps its ``Evidence``: what ``tooling fuzz referee`` recomputes in float32;
- ``logprobs`` (mode "noise", a random-weight pair, whose near ties are everywhere): a
  logprob of a token both engines list differs by more than the given noise, at a
  position where both outputs still agree; a token difference is excused where plain's
  top-2 margin is within twice that noise;
- ``slot``: DFlash's first drafter pass wrote a KV slot outside its request's blocks
  (``smoke.serving.slotaudit``'s count);
- ``acceptance``: the DFlash engine's mean acceptance length over an engine pair's
  workloads fell under ``Mode.floor`` of the reference figure given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

#: Plain's top-2 logprob margin at or under which greedy may pick either token: two engines
#: that batch differently round differently there.
MARGIN = 2.0**-7
#: Steps in a row that schedule nothing and produce nothing, with work unfinished, after which
#: the engine is stuck (one such step is the batch queue waiting on a batch in flight).
STALL_STEPS = 8
MODES = ("lossless", "noise")


@dataclass(frozen=True)
class Mode:
    """How the outputs are compared: "lossless" (greedy equality, near ties excused) or
    "noise" (top-k logprobs within ``noise``); the acceptance oracle when a reference is
    given."""

    kind: str = "lossless"
    noise: float = 0.0
    """The plain engine's own logprob noise between batches (mode "noise")."""
    reference_acceptance: float | None = None
    """The mean acceptance length the drafter reaches on these prompts elsewhere."""
    floor: float = 0.5
    """The fraction of the reference under which acceptance has collapsed."""


@dataclass
class RequestRun:
    """One request as an engine served it."""

    tokens: list[int]
    logprobs: list[dict[str, float]] = field(default_factory=list)
    """Per position, token id (a string) -> logprob: the top-k and the chosen token."""
    finish_reason: str | None = None
    added: int = 0
    """The engine step at which it was added."""
    finished: int | None = None
    """The engine step whose output finished it; None if it never finished."""
    aborted: bool = False
    refused: str | None = None
    """Why ``add_request`` refused it (a prompt too long): it never ran."""
    prompt: list[int] = field(default_factory=list)
    """Its prompt's token ids; empty where unknown (the engines do not record them: the
    campaign recomputes them from the workload's requests, ``gpu_pair.judge_pair``)."""


@dataclass
class WorkloadRun:
    """One workload as one engine served it, step by step."""

    index: int
    bound: int
    results: dict[str, RequestRun]
    """By request name, ``r<i>`` for the workload's request i."""
    scheduled: list[int] = field(default_factory=list)
    """Per engine step, the tokens the scheduler scheduled in it."""
    produced: list[int] = field(default_factory=list)
    """Per engine step, the output tokens it gave."""
    unfinished: list[int] = field(default_factory=list)
    """Per engine step, the requests left unfinished after it."""
    error: str | None = None
    slot_audit: dict[str, Any] | None = None
    spec: dict[str, int] | None = None
    """The DFlash engine's drafts and accepted tokens over the workload."""
    seconds: float = 0.0
    cut: int | None = None
    """The step at which the engine's time ran out and it ended the workload (its requests
    aborted); None when the workload ran to its end."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadRun:
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["results"] = {k: RequestRun(**v) for k, v in data.get("results", {}).items()}
        return cls(**values)


@dataclass(frozen=True)
class Evidence:
    """A token difference the lossless oracle flagged or excused, with what a referee needs
    to settle it apart from the engines: the context both engines agreed on, the two tokens,
    and plain's top logprobs at the difference."""

    request: str
    """The request's name in its workload, ``r<i>``."""
    prompt: tuple[int, ...]
    agreed: tuple[int, ...]
    """The output tokens both engines gave before the difference."""
    dflash: int
    plain: int
    plain_top: tuple[tuple[int, float], ...]
    """Plain's logprobs at the difference (its top-k and its chosen token), best first."""
    excused: bool = False
    """The oracle excused it: plain's top-2 margin there is within the tie bound."""

    @property
    def position(self) -> int:
        """The difference's place in the output."""
        return len(self.agreed)

    @property
    def plain_margin(self) -> float | None:
        """Plain's top-2 logprob margin at the difference; None where it listed fewer."""
        return top2_margin({str(token): lp for token, lp in self.plain_top})

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "prompt": list(self.prompt),
            "agreed": list(self.agreed),
            "dflash": self.dflash,
            "plain": self.plain,
            "plain_top": {str(token): lp for token, lp in self.plain_top},
            "excused": self.excused,
        }


@dataclass(frozen=True)
class Verdict:
    kind: str
    detail: str
    engine: str
    """"dflash", "plain" or "pair" (a comparison of both)."""
    workload: int | None = None
    excused: tuple[str, ...] = ()
    evidence: tuple[Evidence, ...] = ()
    """Each token difference of the workload, flagged or excused (mode "lossless", where the
    prompts are known)."""


def crash(run: WorkloadRun, engine: str) -> list[Verdict]:
    if run.error is None:
        return []
    return [Verdict("crash", f"{engine}: {run.error}", engine, run.index)]


def liveness(run: WorkloadRun, engine: str) -> list[Verdict]:
    """``stall`` and ``livelock`` of one engine's run (none of a run that crashed)."""
    if run.error is not None:
        return []
    found: list[Verdict] = []
    streak = 0
    for step, (sched, made, left) in enumerate(
        zip(run.scheduled, run.produced, run.unfinished, strict=False)
    ):
        streak = streak + 1 if sched == 0 and made == 0 and left > 0 else 0
        if streak == STALL_STEPS:
            found.append(
                Verdict(
                    "stall",
                    f"{engine}: steps {step - STALL_STEPS + 1}..{step} scheduled nothing "
                    f"and produced nothing with {left} request(s) unfinished",
                    engine,
                    run.index,
                )
            )
            break
    for name, req in sorted(run.results.items()):
        if req.aborted or req.refused is not None:
            continue
        if req.finished is None:
            found.append(
                Verdict(
                    "livelock",
                    f"{engine}: {name} unfinished after {len(run.scheduled)} steps "
                    f"(bound {run.bound}), {len(req.tokens)} tokens out",
                    engine,
                    run.index,
                )
            )
        elif req.finished - req.added > run.bound:
            found.append(
                Verdict(
                    "livelock",
                    f"{engine}: {name} took {req.finished - req.added} steps (bound {run.bound})",
                    engine,
                    run.index,
                )
            )
    return found


def slot(run: WorkloadRun) -> list[Verdict]:
    audit = run.slot_audit or {}
    outside, misplaced = int(audit.get("outside", 0)), int(audit.get("misplaced", 0))
    if not outside and not misplaced:
        return []
    return [
        Verdict(
            "slot",
            f"dflash: {outside} of {audit.get('slots', 0)} first-pass query slots outside "
            f"the request's blocks, {misplaced} in another of its own; first: "
            f"{(audit.get('examples') or [None])[0]}",
            "dflash",
            run.index,
        )
    ]


def top2_margin(position: dict[str, float]) -> float | None:
    """The gap between the two highest logprobs at a position; None with fewer than two."""
    values = sorted(position.values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def ranked(position: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """A position's logprobs as (token id, logprob) pairs, best first."""
    pairs = ((int(token), float(lp)) for token, lp in position.items())
    return tuple(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))


def _first_difference(d: RequestRun, p: RequestRun) -> int | None:
    for i, (a, b) in enumerate(zip(d.tokens, p.tokens, strict=False)):
        if a != b:
            return i
    return None


class Compared(NamedTuple):
    """One request's two outputs compared: the failure and the excused difference, each a
    line or None, and the evidence of a token difference (either kind) or None."""

    failure: str | None
    excused: str | None
    evidence: Evidence | None = None


def _evidence(name: str, d: RequestRun, p: RequestRun, at: int, excused: bool) -> Evidence | None:
    """The evidence of the difference at ``at``; None where plain's prompt is unknown."""
    if not p.prompt:
        return None
    top = p.logprobs[at] if at < len(p.logprobs) else {}
    return Evidence(
        name,
        tuple(p.prompt),
        tuple(p.tokens[:at]),
        d.tokens[at],
        p.tokens[at],
        ranked(top),
        excused,
    )


def compare_request(name: str, d: RequestRun, p: RequestRun, mode: Mode) -> Compared:
    """(the failure, the excused difference, the evidence) of one request's two outputs.
    Past a first difference nothing is compared: the two continue different texts."""
    if d.refused is not None or p.refused is not None:
        if d.refused is not None and p.refused is not None:
            return Compared(None, None)
        return Compared(f"{name}: refused by one engine only ({d.refused or p.refused})", None)
    at = _first_difference(d, p)
    if mode.kind == "noise":
        common = len(d.tokens) if at is None else at
        for i in range(min(common, len(d.logprobs), len(p.logprobs))):
            for token, lp in p.logprobs[i].items():
                other = d.logprobs[i].get(token)
                if other is not None and abs(other - lp) > mode.noise:
                    return Compared(
                        f"{name} position {i}: token {token}'s logprob {other:.5f} (dflash) "
                        f"against {lp:.5f} (plain), more than the noise {mode.noise}",
                        None,
                    )
    tie = MARGIN if mode.kind == "lossless" else max(MARGIN, 2 * mode.noise)
    if at is not None:
        margin = top2_margin(p.logprobs[at]) if at < len(p.logprobs) else None
        what = (
            f"{name} position {at}: dflash {d.tokens[at]}, plain {p.tokens[at]}, plain's "
            f"top-2 margin {'unknown' if margin is None else f'{margin:.6f}'}"
        )
        excused = margin is not None and margin <= tie
        evidence = _evidence(name, d, p, at, excused) if mode.kind == "lossless" else None
        if excused:
            return Compared(None, what, evidence)
        return Compared(what, None, evidence)
    if d.aborted or p.aborted:
        return Compared(None, None)  # aborted at the same step, after different numbers of tokens
    if len(d.tokens) != len(p.tokens) or d.finish_reason != p.finish_reason:
        return Compared(
            f"{name}: the same tokens, but dflash ends after {len(d.tokens)} "
            f"({d.finish_reason}) and plain after {len(p.tokens)} ({p.finish_reason})",
            None,
        )
    return Compared(None, None)


def outputs(d: WorkloadRun, p: WorkloadRun, mode: Mode) -> list[Verdict]:
    """``lossless`` or ``logprobs`` over every request both engines served; one verdict
    holding the first failure, or a passing one (kind "pass") listing what was excused,
    either with the evidence of every token difference."""
    failures: list[str] = []
    excused: list[str] = []
    evidence: list[Evidence] = []
    for name in sorted(set(d.results) & set(p.results), key=_request_order):
        compared = compare_request(name, d.results[name], p.results[name], mode)
        failures += [compared.failure] if compared.failure else []
        excused += [compared.excused] if compared.excused else []
        evidence += [compared.evidence] if compared.evidence else []
    kind = "lossless" if mode.kind == "lossless" else "logprobs"
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        detail = failures[0] + more
        return [Verdict(kind, detail, "pair", d.index, tuple(excused), tuple(evidence))]
    if excused:
        return [Verdict("pass", "", "pair", d.index, tuple(excused), tuple(evidence))]
    return []


def _request_order(name: str) -> tuple[int, str]:
    digits = name.lstrip("r")
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


def finished_in_both(d: WorkloadRun, p: WorkloadRun) -> tuple[WorkloadRun, WorkloadRun]:
    """``d`` and ``p`` with only the requests both engines finished: what a cut workload
    can still be compared on."""
    names = {
        name
        for name, req in d.results.items()
        if req.finished is not None and name in p.results and p.results[name].finished is not None
    }
    return (
        replace(d, results={n: d.results[n] for n in names}),
        replace(p, results={n: p.results[n] for n in names}),
    )


def judge_workload(d: WorkloadRun, p: WorkloadRun, mode: Mode) -> list[Verdict]:
    """Every oracle of one workload: each engine's crash and liveness, DFlash's slots, and the
    outputs compared (when neither engine crashed). A workload either engine cut at its
    time has no liveness verdict (its requests were ended by the clock, not the engine), and
    only the requests both engines finished are compared. A verdict of kind "pass" carries
    only the differences excused."""
    found = crash(d, "dflash") + crash(p, "plain") + slot(d)
    if d.cut is None and p.cut is None:
        found += liveness(d, "dflash") + liveness(p, "plain")
    else:
        d, p = finished_in_both(d, p)
    if d.error is None and p.error is None:
        found += outputs(d, p, mode)
    return found


def mean_acceptance_length(runs: list[WorkloadRun]) -> float | None:
    """1 + accepted / drafts over ``runs`` (the tokens a step gives per draft); None when
    nothing was drafted."""
    drafts = sum((r.spec or {}).get("drafts", 0) for r in runs)
    accepted = sum((r.spec or {}).get("accepted", 0) for r in runs)
    return 1 + accepted / drafts if drafts else None


def acceptance(runs: list[WorkloadRun], mode: Mode) -> list[Verdict]:
    """``acceptance`` over one engine pair's DFlash runs, when a reference figure is given."""
    mean = mean_acceptance_length(runs)
    if mode.reference_acceptance is None or mean is None:
        return []
    least = mode.floor * mode.reference_acceptance
    if mean >= least:
        return []
    return [
        Verdict(
            "acceptance",
            f"dflash: mean acceptance length {mean:.3f} under {least:.3f} "
            f"({mode.floor} of the reference {mode.reference_acceptance})",
            "dflash",
        )
    ]
