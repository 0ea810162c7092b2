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

The second draws (``JOINING``) have the traffic users send: requests arriving while others
verify drafts, prompts of every length (1, K + 1, block multiples) chunked by a lowered token
budget beside decodes, aborts and trimmed drafts, at K = 3 or 7. There each prompt chunk
must also start from its first slot, no row may read a state block outside its own, and the
GDN layer must load the state of every row with context and of none that starts its request:
without patch 31 a one-token first step (a one-token prompt, a first chunk cut to one) took the
decode kernels, which load its recycled slot.
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
    from tooling.probes._v1 import NOT_AS_WRITTEN, draw_fault
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
        except (CannotStep, AssertionError, *NOT_AS_WRITTEN) as e:
            out["errors"].append(draw_fault(seed, e))
    json.dump(out, open(sys.argv[2], "w"))
    """
)


#: The second draws: prompts joining, chunked, aborted and passed over among the verify steps.
SEEDS_JOINING = list(range(16))
JOINING = textwrap.dedent(
    """
    import json, random, sys
    from tooling.probes import _harness
    from tooling.probes._v1 import NOT_AS_WRITTEN, draw_fault
    _harness.install_cpu_platform()
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import RequestStatus
    from tooling.probes import accepted_state
    from tooling.probes.accepted_state import CannotStep
    from tooling.probes.async_drift_skip import _asynchronous
    from tooling.probes.async_kept_accepted import _empty_step
    from tooling.probes.spec_prefill_dispatch import _request

    PROMPTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20, 31, 32, 33)

    def slots(served, metadata):
        # Each row's starting slot among its own state blocks, its GDN path, and whether
        # the layer loads that slot: the speculative and the decode kernels always do, the
        # prefill path (taken by every non-speculative row once one is a prefill) where
        # has_initial_state says so.
        runner = served.runner
        rows = runner.input_batch.req_ids
        spec = int(metadata.num_spec_decodes)
        masks = getattr(metadata, "spec_sequence_masks_cpu", None)
        marked = [i for i in range(len(rows)) if spec and masks is not None and bool(masks[i])]
        if spec and not marked:
            marked = list(range(spec))
        found = {}
        for i, rid in enumerate(rows):
            if i in marked:
                j = marked.index(i)
                count = int(metadata.num_accepted_tokens[j])
                index = int(metadata.spec_state_indices_tensor[j, count - 1])
                path, loads = "speculative", True
            else:
                j = i - sum(1 for m in marked if m < i)
                index = int(metadata.non_spec_state_indices_tensor[j])
                if int(metadata.num_prefills) > 0:
                    path, loads = "prefill", bool(metadata.has_initial_state[j])
                else:
                    path, loads = "decode", True
            blocks = list(runner.requests[rid].block_ids[0])
            if index in blocks:
                found[rid] = (blocks.index(index), path, loads, "")
            else:
                found[rid] = (None, path, loads, f"state block {index}, not one of {blocks}")
        return found

    seeds = json.loads(sys.argv[1])
    out = {"steps": 0, "empty": 0, "joined": 0, "aborted": 0, "chunks": 0, "checked_rows": 0}
    out.update(mismatches=[], computed=[], errors=[], ks=[], loads=[], one_token_starts=0)
    out["drained"] = 0
    for seed in seeds:
        rng = random.Random(seed)
        k = rng.choice([3, 7])
        accepted_state.K = k  # read by the harness's config and its sampled tokens
        asynchronous = seed % 2 == 0
        out["ks"].append(k)
        served = accepted_state._Served()
        sched = served.scheduler
        full = sched.max_num_scheduled_tokens
        kept = {}

        def join():
            rid = f"r{len(kept)}"
            sched.add_request(_request(rid, rng.choice(PROMPTS), 1 + 100 * len(kept)))
            kept[rid] = 1

        for _ in range(rng.randint(1, 3)):
            join()
        try:
            for n in range(16):
                live = [r for r in sched.requests if not sched.requests[r].is_finished()]
                # A request arriving at an idle engine is its step's only row.
                if (rng.random() < 0.3 or not live) and len(live) < 5:
                    join()
                    out["joined"] += 1
                running = [r.request_id for r in sched.running]
                if running and rng.random() < 0.08:
                    sched.finish_requests(rng.choice(running), RequestStatus.FINISHED_ABORTED)
                    out["aborted"] += 1
                elif running and rng.random() < 0.06:
                    # Every client leaves at once: the engine drains.
                    sched.finish_requests(running, RequestStatus.FINISHED_ABORTED)
                    out["drained"] += 1
                if asynchronous and rng.random() < 0.1:
                    _empty_step(served)
                    out["empty"] += 1
                    continue
                if rng.random() < 0.3:
                    # One token as often as any other budget: a step of one-token pieces.
                    budget = rng.choice([1, rng.randint(1, 3 * (k + 1))])
                    sched.max_num_scheduled_tokens = budget
                step = sched.schedule()
                sched.max_num_scheduled_tokens = full
                if not step.total_num_scheduled_tokens:
                    continue
                scheduled = step.num_scheduled_tokens
                before = {
                    r: sched.requests[r].num_computed_tokens - c for r, c in scheduled.items()
                }
                read = slots(served, served.execute(step))
                runner = served.runner
                for i, rid in enumerate(runner.input_batch.req_ids):
                    if int(runner.num_computed_tokens[i]) != before[rid]:
                        out["computed"].append(
                            f"seed {seed} step {n} (K {k}, async {asynchronous}): {rid} at "
                            f"{int(runner.num_computed_tokens[i])} on the device, "
                            f"{before[rid]} computed"
                        )
                accepted, discarded = {}, set()
                for rid, count in scheduled.items():
                    request = sched.requests[rid]
                    drafts = len(step.scheduled_spec_decode_tokens.get(rid, ()))
                    decoding = before[rid] + 1 >= request.num_tokens
                    slot, path, loads, fault = read[rid]
                    out["checked_rows"] += 1
                    want = kept[rid] - 1 if decoding else 0
                    out["one_token_starts"] += before[rid] == 0 and count == 1
                    if loads != (before[rid] > 0):
                        out["loads"].append(
                            f"seed {seed} step {n} (K {k}, async {asynchronous}): {rid} "
                            f"({count} tokens, {before[rid]} computed, {path}) "
                            + ("loads its recycled slot" if loads else "loads no state")
                        )
                    if fault or slot != want:
                        kind = "decode" if decoding else "prompt chunk"
                        out["mismatches"].append(
                            f"seed {seed} step {n} (K {k}, async {asynchronous}): {rid} ({kind}, "
                            f"{count} tokens, {drafts} drafts, {path}) read slot {slot}, "
                            f"wanted {want} {fault}"
                        )
                    accepted[rid] = rng.randint(1, 1 + drafts) if decoding else 1
                    if not decoding:
                        out["chunks"] += 1
                        if request.num_computed_tokens < request.num_tokens:
                            discarded.add(rid)
                served.sampled(step, accepted, discarded)
                kept.update(accepted)
                if asynchronous:
                    _asynchronous(served, accepted, discarded)
                running = [r.request_id for r in sched.running]
                if running and rng.random() < 0.7:
                    cut = [rng.choice([k, k, k, rng.randint(0, k)]) for _ in running]
                    sched.update_draft_token_ids(DraftTokenIds(running, [[8] * c for c in cut]))
                out["steps"] += 1
        except (CannotStep, AssertionError, *NOT_AS_WRITTEN) as e:
            out["errors"].append(draw_fault(seed, e))
    json.dump(out, open(sys.argv[2], "w"))
    """
)


def _no_stale_reads(out: dict) -> None:
    assert out["mismatches"] == []
    assert out["computed"] == []
    assert out.get("loads", []) == []


def test_every_decode_row_reads_its_last_accepted_slot(probe_python, patched_0201, tmp_path):
    out = run_draws(probe_python, patched_0201, tmp_path, SCRIPT, SEEDS)
    _no_stale_reads(out)
    # The draws reach what the check is for: rows read, requests passed over, empty steps.
    assert out["checked_rows"] > 8 * len(SEEDS)
    assert out["passed_over"] > 0 and out["empty"] > 0


def test_every_row_reads_its_slot_with_prompts_joining(probe_python, patched_0201, tmp_path):
    out = run_draws(probe_python, patched_0201, tmp_path, JOINING, SEEDS_JOINING)
    _no_stale_reads(out)
    # The draws reach what the check is for: both K, prompts joining and chunked beside
    # decodes, aborts, steps that schedule nothing.
    assert set(out["ks"]) == {3, 7}
    assert out["joined"] > len(SEEDS_JOINING) and out["chunks"] > 2 * len(SEEDS_JOINING)
    assert out["aborted"] > 0 and out["empty"] > 0
    assert out["checked_rows"] > 20 * len(SEEDS_JOINING)
    # One-token first steps: one-token prompts, and first chunks the lowered budget cut to one.
    assert out["one_token_starts"] > 4 and out["drained"] > 0
