"""Fix 14: DFlash's step budget is checked at start-up, and vLLM's defaults fit K.

Builds the engine config ``vllm serve`` builds (``EngineArgs`` on a platform answering as
an H200: vLLM's defaults there are 8192 tokens a step and 1024 sequences) for the seed's
pair with DFlash at K = 15:

- as README's serving line gives it (neither --max-num-seqs nor --max-num-batched-tokens):
  fixed means it builds, with a step budget in which every sequence verifies its K + 1
  tokens, and the scheduler keeps the default's 8192 tokens a step, as it does without a
  drafter (the drafter's slots are not taken out of the prompts' share); 0.20.1 refuses it
  (1024 sequences take 14336 drafting slots of 8192);
- with --max-num-seqs 1024 alone: fixed means it builds, every sequence verifying its K + 1
  in a step;
- with --max-num-batched-tokens 8192 --max-num-seqs 1024 and with
  --max-num-batched-tokens 100 --max-num-seqs 8, which leave less than one request's K + 1:
  fixed means each is refused, before any weights load, naming values, and the values it
  names build; or, as from 0.34.0, it builds with the sequences let in to run at once
  (``max_num_active_seqs``) capped so that each of them verifies its K + 1 in a step.

"Every sequence" is every sequence the scheduler lets run at once: ``max_num_seqs``, or
0.34.0's ``max_num_active_seqs`` where set (its scheduler admits no more into RUNNING).
"""

from __future__ import annotations

import re
from pathlib import Path

from . import _harness
from ._schedsim import Settings, engine_config, h200_platform
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "dflash_step_budget"
K = 15
README = Settings(k=K)
#: A max_num_seqs the user set, with the default tokens a step.
SEQS_ONLY = Settings(k=K, max_num_seqs=1024)
TOO_SMALL = (
    Settings(k=K, max_num_batched_tokens=8192, max_num_seqs=1024),
    Settings(k=K, max_num_batched_tokens=100, max_num_seqs=8),
)
#: ``vllm serve``'s tokens a step on an H200, the scheduler's budget without a drafter.
DEFAULT_BUDGET = 8192


def _build(settings: Settings, root: Path) -> tuple[object | None, str]:
    try:
        return engine_config(settings, root), ""
    except Exception as e:  # the start-up refusal is the answer asked for
        return None, " ".join(str(e).split())


def _named_values(message: str, settings: Settings) -> list[Settings]:
    """The settings a refusal's message offers instead, as the user would set them."""
    out = []
    tokens = re.search(r"--max-num-batched-tokens to at least (\d+)", message)
    if tokens:
        out.append(
            Settings(
                k=K, max_num_batched_tokens=int(tokens.group(1)), max_num_seqs=settings.max_num_seqs
            )
        )
    seqs = re.search(r"--max-num-seqs to at most (\d+)", message)
    if seqs:
        out.append(
            Settings(
                k=K,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=int(seqs.group(1)),
            )
        )
    return out


def _running_at_once(config: object) -> int:
    """The sequences the scheduler lets run at once (``max_num_active_seqs`` where the release
    has it and sets it, else ``max_num_seqs``)."""
    sched = config.scheduler_config  # type: ignore[attr-defined]
    return getattr(sched, "max_num_active_seqs", None) or sched.max_num_seqs


def _fits(config: object) -> bool:
    """Every sequence that runs at once verifies its K + 1 tokens in one step's budget."""
    budget = config.scheduler_config.max_num_scheduled_tokens  # type: ignore[attr-defined]
    return budget >= _running_at_once(config) * (K + 1)


def _seqs_only_said(config: object | None, refusal: str) -> str:
    if config is None:
        return f"is refused ({refusal[:120]})"
    sched = config.scheduler_config  # type: ignore[attr-defined]
    verifies = "every" if _fits(config) else "not every"
    return (
        f"starts with max_num_batched_tokens={sched.max_num_batched_tokens}, "
        f"{sched.max_num_scheduled_tokens} tokens a step ({verifies} sequence verifies)"
    )


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    with h200_platform():
        config, refusal = _build(README, root)
        seqs_only, seqs_refusal = _build(SEQS_ONLY, root)
        refusals = [(s, *_build(s, root)) for s in TOO_SMALL]
        offered = [
            (s, alt, _build(alt, root)[0] is not None)
            for s, built, message in refusals
            if built is None
            for alt in _named_values(message, s)
        ]
    if config is None:
        return ProbeResult(
            probe=NAME,
            status=ABSENT,
            evidence=f"README's serving line at K={K} on an H200's defaults is refused: "
            f"{refusal[:240]}",
        )
    sched = config.scheduler_config  # type: ignore[attr-defined]
    budget = sched.max_num_scheduled_tokens
    full = _fits(config)
    kept = budget >= DEFAULT_BUDGET
    seqs_fit = seqs_only is not None and _fits(seqs_only)
    # A small budget built is safe only with the sequences run at once capped to it.
    accepted = [s for s, built, _ in refusals if built is not None and not _fits(built)]
    capped = [s for s, built, _ in refusals if built is not None and _fits(built)]
    named = all(any(o[0] is s for o in offered) for s, built, _ in refusals if built is None)
    works = all(ok for _, _, ok in offered)
    refused = len(refusals) - len(accepted) - len(capped)
    evidence = (
        f"README's serving line at K={K} on an H200's defaults starts with "
        f"max_num_batched_tokens={sched.max_num_batched_tokens}, "
        f"max_num_seqs={sched.max_num_seqs} ({_running_at_once(config)} run at once): "
        f"{budget} tokens a step ({'every' if full else 'not every'} sequence verifies its "
        f"{K + 1}; {'the' if kept else 'less than the'} {DEFAULT_BUDGET} without a drafter); "
        f"with --max-num-seqs {SEQS_ONLY.max_num_seqs} alone it "
        f"{_seqs_only_said(seqs_only, seqs_refusal)}; "
        f"of {len(refusals)} budgets below one request's {K + 1}, {refused} refused "
        f"({len(offered)} values named, {sum(ok for _, _, ok in offered)} of them start), "
        f"{len(capped)} capped to what runs at once, {len(accepted)} served unsafely"
    )
    if full and kept and seqs_fit and not accepted and named and works:
        status = PRESENT
    elif accepted or not full or not kept or not seqs_fit:
        status = ABSENT
    else:
        status = UNKNOWN
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={
            "refusals": [m for _, _, m in refusals],
            "offered": [[vars(alt), ok] for _, alt, ok in offered],
        },
    )
