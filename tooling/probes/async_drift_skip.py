"""Fix 28: with asynchronous spec decode, a step after one of no drafts runs no drift correction.

With asynchronous scheduling and a drafter, vLLM's V1 runner keeps each request's computed
tokens on the CPU optimistically (every draft accepted) and corrects them on the GPU each step
(``update_num_computed_tokens_for_batch_change``: three host-to-device copies and a dozen
device operations), and on a target with M-RoPE (Qwen3.5 and 3.6) corrects the positions by
the same drift, with a copy from pageable memory. Where no request of the batch had drafts in
the previous step (a speculation budget's K = 0, a step of prompts alone) the CPU values are
exact and the correction changes nothing, but it ran every step: CPU a plain engine does not
spend, in the step that drafting off is for.

The probe drives the V1 model runner (``CPUModelRunner``) for a hybrid target with a DFlash
drafter at K = 3 through its own ``execute_model`` up to the model's forward, with vLLM's real
Scheduler (``accepted_state``'s harness), and the runner's asynchronous spec-decode state
as the asynchronous path leaves it: ``use_async_scheduling`` on, the previous batch's rows
and each request's valid sampled count. Four requests prefill their prompts; the step after
decodes one token each, with no drafts before it; then a step verifies drafts, and the step
after that follows one that had drafts. The correction is recorded (and run) each time.

Present: the step after the prefill runs no correction and its computed tokens on the device
are the CPU's; the step after the verify step runs it. Absent: the correction runs after the
step without drafts. Unknown: the steps do not run as written, or the computed tokens differ.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ._v1 import CannotStep, v1_steps
from .accepted_state import PROMPT, K, _Served
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import _request

NAME = "async_drift_skip"
RIDS = ["r0", "r1", "r2", "r3"]


def _asynchronous(
    served: _Served, valid: dict[str, int] | None = None, discarded: Collection[str] = ()
) -> None:
    """The runner's spec-decode state as its asynchronous path leaves it after a step: each
    request of the batch at its row but the ``discarded`` (chunks short of their prompt's
    end, whose sampled tokens the runner drops), and its valid sampled tokens,
    ``valid[request]`` (one each where not given). The runner's drift correction takes a
    row's accepted count from them, so a step that accepted more than one hands on its own."""
    import torch

    runner = served.runner
    runner.use_async_scheduling = True
    runner.use_async_spec_decode = True
    batch = runner.input_batch
    batch.prev_req_id_to_index = {
        rid: i for i, rid in enumerate(batch.req_ids) if rid not in discarded
    }
    counts = [1 if valid is None else valid[rid] for rid in batch.req_ids]
    runner.valid_sampled_token_count_gpu = torch.tensor(counts, dtype=torch.int32)


def _step(served: _Served, out: Any, corrections: list[bool]) -> tuple[bool, bool]:
    """(whether ``out``'s step ran the correction, whether its computed tokens on the device
    are the CPU's after it)."""
    corrections.clear()
    served.execute(out)
    runner = served.runner
    n = len(runner.input_batch.req_ids)
    device = [int(c) for c in runner.num_computed_tokens[:n].tolist()]
    host = [int(c) for c in runner.input_batch.num_computed_tokens_cpu[:n]]
    return bool(corrections), device == host


def _steps() -> dict[str, tuple[bool, bool]]:
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.worker import gpu_model_runner

    served = _Served()
    sched = served.scheduler
    for i, rid in enumerate(RIDS):
        sched.add_request(_request(rid, PROMPT, 1 + 100 * i))
    corrections: list[bool] = []
    real = gpu_model_runner.update_num_computed_tokens_for_batch_change

    def recorded(*args: Any, **kwargs: Any) -> Any:
        corrections.append(True)
        return real(*args, **kwargs)

    gpu_model_runner.update_num_computed_tokens_for_batch_change = recorded
    try:
        out = sched.schedule()
        served.execute(out)
        served.sampled(out, dict.fromkeys(RIDS, 1))
        _asynchronous(served)
        out = sched.schedule()
        if any(out.scheduled_spec_decode_tokens.values()):
            raise CannotStep("the step after the prompts verifies drafts")
        seen = {"after no drafts": _step(served, out, corrections)}
        served.sampled(out, dict.fromkeys(RIDS, 1))
        sched.update_draft_token_ids(DraftTokenIds(RIDS, [[8] * K for _ in RIDS]))
        out = sched.schedule()
        _asynchronous(served)
        served.execute(out)
        served.sampled(out, dict.fromkeys(RIDS, 2))
        _asynchronous(served)
        seen["after drafts"] = _step(served, sched.schedule(), corrections)
    finally:
        gpu_model_runner.update_num_computed_tokens_for_batch_change = real
    return seen


def run() -> ProbeResult:
    why = "the V2 runner keeps computed tokens on the device (the ledger's reading)"
    seen = v1_steps(NAME, why, _steps)
    if isinstance(seen, ProbeResult):
        return seen
    ran_without, same_without = seen["after no drafts"]
    evidence = (
        "hybrid target, DFlash K=3, asynchronous spec decode: the step after no drafts "
        + ("runs" if ran_without else "runs no")
        + " drift correction"
        + ("" if same_without else ", and its computed tokens on the device differ from the CPU's")
        + "; the step after drafts "
        + ("runs it" if seen["after drafts"][0] else "runs none")
    )
    if not same_without or not seen["after drafts"][0]:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=evidence)
    return ProbeResult(
        probe=NAME,
        status=ABSENT if ran_without else PRESENT,
        evidence=evidence,
        details={when: {"corrected": ran, "equal": same} for when, (ran, same) in seen.items()},
    )
