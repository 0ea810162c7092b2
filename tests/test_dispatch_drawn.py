"""A step dispatched to a uniform FULL CUDA graph holds decodes alone, each verifying the
graph's drafts, over drawn schedules (slow).

A uniform FULL graph of q tokens a request is captured on a hybrid target's speculative
Gated DeltaNet path; a row of another kind replayed in it reads and writes the wrong state
slots. Patch 7 found one such row by name (a (K+1)-token prefill) and patch 29 another (a
prompt's one-token piece under a budget's K = 0). Here vLLM's real Scheduler schedules drawn
steps for a hybrid target with a DFlash drafter at K = 15, with no budget or one of three,
requests of drawn prompt lengths arriving along the way, drawn token budgets (one of them
leaving a waiting prompt's last token for a later step), drawn accepted counts and drafts
handed on or not; the V1 model runner (``CPUModelRunner`` under FULL_AND_PIECEWISE, as
``spec_prefill_dispatch`` asks it) dispatches each. Every step it dispatches to a uniform
FULL graph must hold, by the scheduler's own account, q tokens a request, no prompt piece and
q - 1 drafts a request.
"""

from __future__ import annotations

import textwrap

import pytest

from .helpers import run_draws

pytestmark = pytest.mark.slow

SEEDS = list(range(32))
SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    from tooling.probes import _harness
    from tooling.probes._v1 import draw_fault
    _harness.install_cpu_platform()
    from vllm.v1.outputs import DraftTokenIds, EMPTY_MODEL_RUNNER_OUTPUT
    from tooling.probes.spec_prefill_dispatch import _dispatch, _request, _runner_and_scheduler

    K = 15
    BUDGETS = [None, [[1, 1, K], [2, 1024, 0]], [[1, 2, K], [3, 1024, 3]], [[1, 1024, 0]]]
    LENGTHS = [1, 2, 3, 4, K, K + 1, K + 2, 20, 21, 33]
    seeds = json.loads(sys.argv[1])
    out = {"steps": 0, "full_uniform": 0, "pieces_in_uniform_shape": 0}
    out.update(violations=[], errors=[])
    pair = _harness.hybrid_pair()
    for seed in seeds:
        rng = random.Random(seed)
        budget = BUDGETS[seed % len(BUDGETS)]
        extra = {"num_speculative_tokens_per_batch_size": budget} if budget else {}
        config = _harness.vllm_config(
            pair, num_speculative_tokens=K, speculative_args=extra, max_num_seqs=K + 1
        )
        runner, sched = _runner_and_scheduler(config)
        rids = [f"r{i}" for i in range(rng.randint(1, 4))]
        for i, rid in enumerate(rids):
            sched.add_request(_request(rid, rng.choice(LENGTHS), 1 + 100 * i))
        full = sched.max_num_scheduled_tokens
        try:
            for n in range(8):
                if rng.random() < 0.3:
                    rid = f"r{len(rids)}"
                    rids.append(rid)
                    sched.add_request(_request(rid, rng.choice(LENGTHS), 1 + 100 * len(rids)))
                # A budget that leaves the first waiting prompt's last token for a later step.
                waiting = [r.num_prompt_tokens for r in sched.waiting]
                one_short = len(sched.running) + waiting[0] - 1 if waiting else full
                sched.max_num_scheduled_tokens = max(
                    1, rng.choice([full, full, rng.randint(1, 40), one_short])
                )
                step = sched.schedule()
                sched.max_num_scheduled_tokens = full
                if not step.total_num_scheduled_tokens:
                    sched.update_from_output(step, EMPTY_MODEL_RUNNER_OUTPUT)
                    continue
                mode, uniform = _dispatch(runner, step)
                rows = {}
                for rid, tokens in step.num_scheduled_tokens.items():
                    request = sched.requests[rid]
                    before = request.num_computed_tokens - tokens
                    drafts = len(step.scheduled_spec_decode_tokens.get(rid, ()))
                    rows[rid] = (tokens, before < request.num_prompt_tokens, drafts, before)
                q = max(t for t, _, _, _ in rows.values())
                shaped = all(t == q for t, _, _, _ in rows.values())
                out["pieces_in_uniform_shape"] += shaped and any(p for _, p, _, _ in rows.values())
                if mode == "FULL" and uniform:
                    out["full_uniform"] += 1
                    wrong = {r: v for r, v in rows.items() if v[0] != q or v[1] or v[2] != q - 1}
                    if wrong:
                        out["violations"].append(
                            f"seed {seed} budget {budget} step {n}: FULL uniform of {q} tokens a "
                            f"request with rows (tokens, prompt piece, drafts, computed) {wrong}"
                        )
                sampled = {}
                for rid, (tokens, piece, drafts, before) in rows.items():
                    done = before + tokens >= sched.requests[rid].num_prompt_tokens
                    sampled[rid] = [9] * rng.randint(1, 1 + drafts) if done else []
                sched.update_from_output(step, _harness.model_outputs(sampled))
                decoding = [
                    r.request_id
                    for r in sched.running
                    if r.num_computed_tokens >= r.num_prompt_tokens
                ]
                if decoding and rng.random() < 0.6:
                    drafts = [[8] * K for _ in decoding]
                    sched.update_draft_token_ids(DraftTokenIds(decoding, drafts))
                out["steps"] += 1
        except Exception as e:  # any fault of a draw is reported, with its seed
            out["errors"].append(draw_fault(seed, e))
    json.dump(out, open(sys.argv[2], "w"))
    """
)


def test_uniform_full_steps_hold_decodes_alone(probe_python, patched_0201, tmp_path):
    out = run_draws(probe_python, patched_0201, tmp_path, SCRIPT, SEEDS)
    assert out["violations"] == []
    # The draws reach what the check is for: uniform FULL steps, and steps shaped like one
    # that hold a prompt's piece.
    assert out["full_uniform"] > len(SEEDS)
    assert out["pieces_in_uniform_shape"] > 0
