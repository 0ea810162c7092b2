"""A hybrid target's decode rows read the state slot their last step accepted into, over
drawn schedules (slow).

In the probe interpreter with the patched 0.20.1 tree first on the path, vLLM's V1 model runner
(``CPUModelRunner``) for a hybrid target with a DFlash drafter at K = 3 runs drawn steps of four
requests through its own ``execute_model`` up to the model's forward, with vLLM's real
Scheduler (``accepted_state``'s harness): every request scheduled, some passed over by a lowered
token budget (their drafts cut or left out), or none (a step that schedules no request, which
asynchronous scheduling runs near ``max_model_len``), each verify step accepting a drawn count,
drafts handed on or not. Half the draws run the runner's asynchronous path, its state set as
``sample_tokens`` leaves it (the previous batch's rows, the valid sampled counts). In every step
each scheduled row must start from the slot of the last token its last step accepted, read off
the Gated DeltaNet metadata, and its computed tokens on the device must be the scheduler's (the
asynchronous path corrects them from the valid counts). Without patch 30 the asynchronous draws
read stale slots after a step that scheduled no request.
"""

from __future__ import annotations

import textwrap

import pytest

from .helpers import run_draws

pytestmark = pytest.mark.slow

SEEDS = list(range(12))
SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    from tooling.probes import _harness
    _harness.install_cpu_platform()
    from vllm.v1.outputs import DraftTokenIds
    from tooling.probes.accepted_state import _Served, K, CannotStep
    from tooling.probes.async_drift_skip import _asynchronous
    from tooling.probes.async_kept_accepted import _empty_step

    seeds = json.loads(sys.argv[1])
    out = {"steps": 0, "empty": 0, "passed_over": 0, "checked_rows": 0}
    out.update(mismatches=[], computed=[], errors=[])
    for seed in seeds:
        rng = random.Random(seed)
        asynchronous = seed % 2 == 0
        served = _Served()
        sched = served.scheduler
        rids = [f"r{i}" for i in range(4)]
        step = served.drafted(rids)
        kept = dict.fromkeys(rids, 1)
        if asynchronous:
            _asynchronous(served)
        full = sched.max_num_scheduled_tokens
        try:
            for n in range(10):
                kind = "all" if step is not None else rng.choice(["all", "all", "some", "empty"])
                if kind == "empty":
                    _empty_step(served)
                    out["empty"] += 1
                    step = None
                    continue
                if step is None:
                    if kind == "some":
                        sched.max_num_scheduled_tokens = rng.randint(1, 3 * (K + 1))
                    step = sched.schedule()
                    sched.max_num_scheduled_tokens = full
                scheduled = list(step.num_scheduled_tokens)
                out["passed_over"] += len(rids) - len(scheduled)
                read = served.read(served.execute(step))
                runner = served.runner
                for i, rid in enumerate(runner.input_batch.req_ids):
                    request = sched.requests[rid]
                    before = request.num_computed_tokens - step.num_scheduled_tokens[rid]
                    if int(runner.num_computed_tokens[i]) != before:
                        out["computed"].append(
                            f"seed {seed} step {n} ({kind}, async {asynchronous}): {rid} at "
                            f"{int(runner.num_computed_tokens[i])} on the device, {before} computed"
                        )
                for rid in scheduled:
                    out["checked_rows"] += 1
                    if read.slots[rid] != kept[rid] - 1:
                        out["mismatches"].append(
                            f"seed {seed} step {n} ({kind}, async {asynchronous}): {rid} read "
                            f"slot {read.slots[rid]}, its last step accepted {kept[rid]}"
                        )
                drafts = {r: len(step.scheduled_spec_decode_tokens.get(r, ())) for r in scheduled}
                accepted = {r: rng.randint(1, 1 + drafts[r]) for r in scheduled}
                served.sampled(step, accepted)
                kept.update(accepted)
                if asynchronous:
                    _asynchronous(served, accepted)
                running = [r.request_id for r in sched.running]
                if rng.random() < 0.7:
                    sched.update_draft_token_ids(DraftTokenIds(running, [[8] * K for _ in running]))
                step = None
                out["steps"] += 1
        except (CannotStep, ValueError, TypeError, AttributeError, KeyError, AssertionError) as e:
            said = " ".join(str(e).split())[:200]
            out["errors"].append(f"seed {seed}: {type(e).__name__}: {said}")
    json.dump(out, open(sys.argv[2], "w"))
    """
)


def test_every_decode_row_reads_its_last_accepted_slot(probe_python, patched_0201, tmp_path):
    out = run_draws(probe_python, patched_0201, tmp_path, SCRIPT, SEEDS)
    assert out["mismatches"] == []
    assert out["computed"] == []
    # The draws reach what the check is for: rows read, requests passed over, empty steps.
    assert out["checked_rows"] > 8 * len(SEEDS)
    assert out["passed_over"] > 0 and out["empty"] > 0
