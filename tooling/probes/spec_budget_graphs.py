"""Fix 20: a speculation budget's verify steps replay full CUDA graphs.

Patch 17's budget (``num_speculative_tokens_per_batch_size``) lowers the drafts a step
verifies as more requests run. vLLM captured full graphs only for steps of 1 + K tokens a
request, so a step of 1 + K' ran PIECEWISE, whose launch at many requests took back more
than the smaller K saved on the GPU (docs/notebook/2026-12-04-trained-speed.md).

The probe asks the V1 model runner's own dispatch (as ``spec_prefill_dispatch`` does: vLLM's
real Scheduler schedules each step, ``CPUModelRunner`` takes it into its batch and
dispatches it under FULL_AND_PIECEWISE) for a hybrid target with a DFlash drafter at K = 15
and the budget [[1, 1, 15], [2, 1024, 3]]:

- control: one request verifying 15 drafts (the FULL graph on every tree);
- three requests verifying the budget's 3 drafts each;
- three prompts of 4 tokens (K' + 1) in their first step: a prefill, never a uniform verify
  step (fix 7's question at the budget's K).

Fixed: the budget's step replays a FULL graph of its own (3 requests of 4 tokens) while
the prefills stay mixed. Absent: it runs PIECEWISE, or the tree has no budget (the
scheduler verifies 15 drafts at three requests).

A release without the V1 runner (0.34.0) serves DFlash on the V2 runner: there the probe
builds the config ``vllm serve`` builds for the seed's pair with the same budget on an H200,
and asks the V2 runner's own CUDA-graph manager (``CudaGraphManager``, made as the runner
makes it, from ``get_decode_cudagraph_query_lens``) which graphs it captures and which it
dispatches a step to. Whether a prompt of K' + 1 tokens counts as a uniform step there is
fix 7's question, asked of the V2 runner's batch state, not here.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import (
    CannotDispatch,
    _dispatch,
    _request,
    _runner_and_scheduler,
    option_config,
)

NAME = "spec_budget_graphs"
K = 15
BUDGET_K = 3
BUDGET = [[1, 1, K], [2, 1024, BUDGET_K]]
REQUESTS = 3


def _decoding(config: Any, requests: int) -> tuple[tuple[str, bool], int]:
    """The dispatch of the first verify step of ``requests`` requests past their prompts,
    and the drafts each verifies there."""
    from vllm.v1.outputs import DraftTokenIds

    runner, sched = _runner_and_scheduler(config)
    rids = [f"r{i}" for i in range(requests)]
    for i, rid in enumerate(rids):
        sched.add_request(_request(rid, 20, 1 + 100 * i))
    out = sched.schedule()
    _dispatch(runner, out)
    sched.update_from_output(out, _harness.model_outputs({rid: [7] for rid in rids}))
    sched.update_draft_token_ids(DraftTokenIds(rids, [[8] * K for _ in rids]))
    out = sched.schedule()
    drafts = {len(out.scheduled_spec_decode_tokens.get(r, ())) for r in rids}
    if len(drafts) != 1:
        raise CannotDispatch(f"the requests verify unequal drafts: {sorted(drafts)}")
    return _dispatch(runner, out), drafts.pop()


def _prefills(config: Any) -> tuple[str, bool]:
    runner, sched = _runner_and_scheduler(config)
    for i in range(REQUESTS):
        sched.add_request(_request(f"p{i}", BUDGET_K + 1, 1 + 100 * i))
    out = sched.schedule()
    if sorted(out.num_scheduled_tokens.values()) != [BUDGET_K + 1] * REQUESTS:
        raise CannotDispatch("the prompts were not prefilled in one step")
    return _dispatch(runner, out)


def _v2() -> ProbeResult:
    """The V2 runner's graph manager for the seed's pair with the budget (see the module)."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.gpu.cudagraph_utils") is None:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence="no V1 runner and no V2 one")
    from vllm.config import CUDAGraphMode

    from ._schedsim import Settings
    from ._v2_runner import graph_manager

    budget = tuple((first, last, k) for first, last, k in BUDGET)
    settings = Settings(k=K, max_num_seqs=64, spec_tokens_by_batch=budget)
    _, manager = graph_manager(settings, "FULL_AND_PIECEWISE")
    full = {
        (d.num_reqs, d.uniform_token_count)
        for d in manager._capture_descs.get(CUDAGraphMode.FULL, [])
    }

    def mode(reqs: int, per_request: int, uniform: bool) -> str:
        desc = manager.dispatch(
            num_reqs=reqs,
            num_tokens=reqs * per_request,
            uniform_token_count=per_request if uniform else None,
            num_active_loras=0,
            max_query_len=per_request,
        )
        return str(desc.cg_mode.name)

    seen = {
        f"1 request, {K} drafts": mode(1, K + 1, True),
        f"{REQUESTS} requests, {BUDGET_K} drafts": mode(REQUESTS, BUDGET_K + 1, True),
        f"{REQUESTS} prompts of {BUDGET_K + 1} tokens (not uniform)": mode(
            REQUESTS, BUDGET_K + 1, False
        ),
    }
    captured = (REQUESTS, BUDGET_K + 1) in full
    evidence = (
        f"seed's pair, K = {K}, budget {BUDGET}, FULL_AND_PIECEWISE, the V2 runner's graph "
        f"manager: FULL graphs of {BUDGET_K + 1} tokens a request for "
        f"{sorted(n for n, q in full if q == BUDGET_K + 1)[:6]}... requests; dispatch: "
        + "; ".join(f"{case}: {m}" for case, m in seen.items())
    )
    modes = list(seen.values())
    if modes[0] != "FULL":
        status = UNKNOWN
    elif captured and modes[1] == "FULL" and modes[2] != "FULL":
        status = PRESENT
    else:
        status = ABSENT
    return ProbeResult(probe=NAME, status=status, evidence=evidence, details={"dispatch": seen})


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    if not _harness.has_v1_runner():
        return _v2()
    pair = _harness.hybrid_pair()
    option = {"num_speculative_tokens_per_batch_size": BUDGET}
    config = option_config(NAME, "no speculation budget here", pair, K, option, BUDGET)
    if isinstance(config, ProbeResult):
        return config
    try:
        control, control_drafts = _decoding(config, 1)
        budget, budget_drafts = _decoding(config, REQUESTS)
        prefills = _prefills(config)
    except CannotDispatch as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run a case: {e}")
    seen = {
        f"1 request, {control_drafts} drafts": control,
        f"{REQUESTS} requests, {budget_drafts} drafts": budget,
        f"{REQUESTS} prompts of {BUDGET_K + 1} tokens": prefills,
    }
    evidence = (
        f"hybrid target, K = {K}, budget {BUDGET}, FULL_AND_PIECEWISE, the V1 runner's "
        "dispatch: "
        + "; ".join(
            f"{case}: {mode}{' uniform' if uniform else ''}"
            for case, (mode, uniform) in seen.items()
        )
    )
    if control != ("FULL", True) or control_drafts != K:
        status = UNKNOWN
        evidence = "a verify step of K drafts does not replay its FULL graph: " + evidence
    elif budget_drafts != BUDGET_K:
        status = ABSENT
        evidence = "no speculation budget here: " + evidence
    elif prefills[1]:
        status = ABSENT
        evidence = (
            "prompts of the budget's K + 1 tokens are dispatched as a verify step: " + evidence
        )
    else:
        status = PRESENT if budget == ("FULL", True) else ABSENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={case: {"mode": m, "uniform": u} for case, (m, u) in seen.items()},
    )
