"""Fix 30: with asynchronous scheduling a request passed over keeps its last step's accepted count.

On a hybrid target each request's next step reads its recurrent state from the slot of the
last token its last step accepted (fix 24). Fix 24 kept that count per request while the
request was out of the batch, but with asynchronous scheduling (vLLM's default) it took the
count at the next step's preparation, from the batch before it. A step that schedules no
request at all (with asynchronous scheduling, the scheduler passes over a request whose
tokens in flight already reach max_model_len) prepares nothing: a request coming back after
it read the count of the step before its last one, and went on from a state that misses or
repeats tokens, with no error. On the trained pair (one H100, K = 15, vLLM's defaults) the
completion that runs to max_model_len came back wrong 7 tokens before its end.

The probe drives the V1 model runner (``CPUModelRunner``) for a hybrid target with a DFlash
drafter at K = 3 through its own ``execute_model`` up to the model's forward, with vLLM's real
Scheduler (``accepted_state``'s harness) and the runner's asynchronous state as its
asynchronous path leaves it after each step (``async_drift_skip``'s). Two requests prefill
their prompts, then verify 3 drafts, accepting ``ACCEPTED`` tokens; the next step schedules
no request (a token budget of 0), as its asynchronous path runs one; the step after brings
both back, with no drafts. Which slot each starts from is read off the GDN metadata.

Present: each starts from the slot its verify step accepted into (``ACCEPTED - 1``).
Absent: either starts from another. Unknown: the steps do not run as written, or the V2
runner serves (it keeps the counts by request, on the device).
"""

from __future__ import annotations

from ._v1 import CannotStep, v1_steps
from .accepted_state import K, _Served
from .async_drift_skip import _asynchronous
from .result import ABSENT, PRESENT, ProbeResult

NAME = "async_kept_accepted"
#: Tokens each request's verify step accepts (the bonus token included).
ACCEPTED = {"r0": 3, "r1": 2}


def _empty_step(served: _Served) -> None:
    """A step that schedules no request, run by the runner and the scheduler as served."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    sched = served.scheduler
    budget = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = 0
    try:
        out = sched.schedule()
    finally:
        sched.max_num_scheduled_tokens = budget
    if out.total_num_scheduled_tokens:
        raise CannotStep(f"the empty step scheduled {out.num_scheduled_tokens}")
    with set_current_vllm_config(served.config):
        served.runner.execute_model(out)
    sched.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT)


def _slots() -> dict[str, int]:
    """Each request's starting slot in the step after the empty one."""
    served = _Served()
    sched = served.scheduler
    rids = list(ACCEPTED)
    out = served.drafted(rids)
    if [len(out.scheduled_spec_decode_tokens.get(r, ())) for r in rids] != [K] * len(rids):
        raise CannotStep("the second step does not verify K drafts a request")
    _asynchronous(served)
    served.execute(out)
    served.sampled(out, ACCEPTED)
    _asynchronous(served, ACCEPTED)
    _empty_step(served)
    out = sched.schedule()
    if out.num_scheduled_tokens != dict.fromkeys(rids, 1):
        raise CannotStep(f"the step after the empty one scheduled {out.num_scheduled_tokens}")
    return served.read(served.execute(out)).slots


def run() -> ProbeResult:
    why = "the V2 runner keeps each request's accepted count on the device, by request"
    slots = v1_steps(NAME, why, _slots)
    if isinstance(slots, ProbeResult):
        return slots
    expected = {rid: n - 1 for rid, n in ACCEPTED.items()}
    evidence = (
        f"hybrid target, DFlash K={K}, asynchronous scheduling: after a verify step accepting "
        f"{ACCEPTED} and a step that scheduled no request, the requests start from slots "
        f"{slots} (their accepted tokens' slots: {expected})"
    )
    return ProbeResult(
        probe=NAME,
        status=PRESENT if slots == expected else ABSENT,
        evidence=evidence,
        details={"slots": slots, "expected": expected},
    )
