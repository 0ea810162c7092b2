"""Probes on real upstream releases: each reads absent where the release has the bug and
present where upstream fixed it its own way (0.20.1, stock and patched: test_apply)."""

from __future__ import annotations

import pytest

from tooling.probing import (
    ABSENT,
    PRESENT,
    UNKNOWN,
    ProbeHost,
    ProbeResult,
    ProbeTarget,
    run_probes,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe_release(catalog, fetch_release, probe_python, cache):
    """Probe a release's tree; the module's runs are forked from one probe interpreter, as
    the runs of one release are in ``tooling patch`` (each answers as a fresh run would:
    tests/test_probe_host.py)."""
    pycache = cache.root / "pycache"
    with ProbeHost(probe_python, pycache) as host:

        def run(version: str, *names: str) -> dict[str, ProbeResult]:
            upstream = fetch_release(catalog.get(version), with_wheel=False)
            target = ProbeTarget(python=probe_python, root=upstream.source_dir, pycache=pycache)
            return run_probes(target, names, host=host)

        yield run


def test_lookahead_slots_absent_on_0220(probe_release):
    (result,) = probe_release("0.22.0", "lookahead_slots").values()
    assert result.status == ABSENT, result.evidence
    assert result.details["outside"] == {
        "first prefill K=3": 4,
        "first prefill K=15": 16,
        "decode all-accepted K=3": 1,
    }


def test_lookahead_slots_present_on_0230(probe_release):
    (result,) = probe_release("0.23.0", "lookahead_slots").values()
    assert result.status == PRESENT, result.evidence
    assert set(result.details["outside"].values()) == {0}


def test_0330_keeps_every_block_and_reserves_every_slot(probe_release):
    results = probe_release("0.33.0", "eagle_cache_drop", "lookahead_slots")
    cache_drop = results["eagle_cache_drop"]
    assert cache_drop.status == PRESENT, cache_drop.evidence
    assert cache_drop.form == "needs_eagle_block_drop() -> False"
    assert cache_drop.details["hybrid_cached_dflash"] == cache_drop.details["hybrid_cached_no_spec"]
    assert cache_drop.details["hybrid_cached_dflash"] == 192
    assert results["lookahead_slots"].status == PRESENT, results["lookahead_slots"].evidence


def test_swa_windows_absent_on_0240_whose_v2_runner_gives_every_layer_one_causality(
    probe_release,
):
    """0.24's V2 runner has no per-layer causality (``get_draft_attn_causal`` came in 0.26):
    every drafter layer gets the config's one flag, and no window reaches FlashAttention."""
    (result,) = probe_release("0.24.0", "swa_windows").values()
    assert result.status == ABSENT, result.evidence
    assert result.details["runner"] == "v2 runner"
    assert result.details["masks"] == [[-1, -1]] * 3


def test_0340_the_scheduler_probes_answer_after_the_engine_cores_planning(probe_release):
    """From 0.29 the engine core resolves a KV-cache layout before it groups the layers, and
    0.34.0's start-up check holds the null block back: the probes plan the cache as the core
    does, so they answer on 0.34.0 instead of crashing, fix by fix."""
    results = probe_release("0.34.0", "drafter_kv_groups", "kv_null_block", "mamba_chunk_liveness")
    groups = results["drafter_kv_groups"]
    # Still grouped by the drafter's five layers: patch 18's defect is on 0.34.0.
    assert groups.status == ABSENT, groups.evidence
    assert groups.details == {"drafted": 15, "group_size": 5, "padding": 6, "plain": 4}
    # Upstream's own fix: the check reserves the null block, and the least cache it starts
    # with serves a request that needs every block.
    assert results["kv_null_block"].status == PRESENT, results["kv_null_block"].evidence
    # 64-token blocks: the budgets below 0.20.1's 480-token block serve, but a chunk of
    # less than a block beside long prefills is still rounded to none (the fuzzer's case).
    liveness = results["mamba_chunk_liveness"]
    assert liveness.status == ABSENT, liveness.evidence
    outcomes = [d["outcome"] for d in liveness.details["outcomes"]]
    assert outcomes == ["pass", "pass", "pass", "pass", "starve"], liveness.evidence
    assert "64-token blocks" in liveness.evidence


def test_0340_caps_what_runs_at_once_to_the_step_budget(probe_release):
    """0.34.0 takes no drafting slots out of the step budget; it caps the sequences it lets
    run at once at the budget over K + 1 (``max_num_active_seqs``): README's line starts,
    and every sequence running verifies its drafts in a step. Fix 14 is superseded there."""
    (budget,) = probe_release("0.34.0", "dflash_step_budget").values()
    assert budget.status == PRESENT, budget.evidence
    assert "max_num_seqs=1024 (512 run at once): 8192 tokens a step (every sequence" in (
        budget.evidence
    )
    assert "2 capped to what runs at once, 0 served unsafely" in budget.evidence


def test_0340_resolves_dflash_layers_on_its_v2_runner_alone(probe_release):
    """0.34.0 has no V1 model runner: the probe asks the V2 runner's resolver alone, which
    adds the one (fix 1 superseded), instead of failing on the V1 import."""
    (offset,) = probe_release("0.34.0", "layer_offset").values()
    assert offset.status == PRESENT, offset.evidence
    assert set(offset.details) == {"v2 runner"}
    assert offset.details["v2 runner"]["dflash"] == [2, 17, 32, 47, 62]


def test_0340_keys_the_compile_cache_by_the_drafters_layers(probe_release):
    """0.34.0 has no VllmConfig.compute_hash: the probe asks the config hash the compile
    backend folds into its cache folder's name, which covers target_layer_ids."""
    (key,) = probe_release("0.34.0", "compile_key").values()
    assert key.status == PRESENT, key.evidence
    assert key.details["first"] == key.details["again"] != key.details["other"]


def test_0340_reserves_every_dflash_slot_inside_the_requests_blocks(probe_release):
    """0.34.0's ModelRunnerOutput takes no req_id_to_index: the harness builds what each
    release takes, and the probe answers there (fix 4 superseded)."""
    (slots,) = probe_release("0.34.0", "lookahead_slots").values()
    assert slots.status == PRESENT, slots.evidence
    assert set(slots.details["outside"].values()) == {0}


def test_0340_schedules_each_steps_drafts_by_how_many_run(probe_release):
    """0.34.0's scheduler takes the per-batch-size schedule itself (the stand-in sees it) and
    serves a range above K clamped to K, where the fixed 0.20.1 refuses it: both are fixed."""
    (by_batch,) = probe_release("0.34.0", "spec_tokens_by_batch").values()
    assert by_batch.status == PRESENT, by_batch.evidence
    assert "K = 16 in a range: served, at most 15 drafts verified a step" in by_batch.evidence


def test_0340_replays_full_graphs_for_each_budget_tier(probe_release):
    """0.34.0 has no V1 runner: the probe asks the V2 runner's own graph manager, which
    captures full graphs for every K' a budget names and dispatches the budget's step to
    one (fix 20 superseded)."""
    (graphs,) = probe_release("0.34.0", "spec_budget_graphs").values()
    assert graphs.status == PRESENT, graphs.evidence
    assert graphs.details["dispatch"] == {
        "1 request, 15 drafts": "FULL",
        "3 requests, 3 drafts": "FULL",
        "3 prompts of 4 tokens (not uniform)": "PIECEWISE",
    }


def test_0340_drafter_windows_and_fp8_cache_on_the_v2_runner(probe_release):
    """0.34.0 has no V1 proposer: the probes ask the V2 path (each group's causality from
    the drafter, the query pass's metadata per group), and both read present there (fixes
    2 and 5 superseded)."""
    results = probe_release("0.34.0", "swa_windows", "fp8_kv")
    windows = results["swa_windows"]
    assert windows.status == PRESENT, windows.evidence
    assert windows.details["runner"] == "v2 runner"
    assert windows.details["masks"] == [[15, 0], [15, 0], [-1, -1]]
    assert results["fp8_kv"].status == PRESENT, results["fp8_kv"].evidence


def test_0340_drafts_past_max_model_len_write_over_the_requests_own_kv(probe_release):
    """0.34.0's V2 runner drafts at every step; its DFlash input kernel (run in Triton's
    interpreter) clamps a query past max_model_len into the request's last block, over the
    slot of a valid earlier position: fix 10's defect, which its port removes."""
    (max_len,) = probe_release("0.34.0", "drafter_max_len").values()
    assert max_len.status == ABSENT, max_len.evidence
    assert max_len.details["overwritten"] == [[64, 208, 48], [65, 209, 49], [66, 210, 50]]


def test_0340_classifies_a_k_plus_1_prompt_as_a_prefill_on_its_v2_runner(probe_release):
    """0.34.0 has no V1 runner: the probe asks the V2 runner's own batch classification
    (``gather_batch_req_state``), which counts a step as a uniform decode only when nothing
    in it is prefilling (fix 7 superseded)."""
    (dispatch,) = probe_release("0.34.0", "spec_prefill_dispatch").values()
    assert dispatch.status == PRESENT, dispatch.evidence
    assert "the V2 runner's dispatch" in dispatch.evidence
    uniform = {case: d["uniform"] for case, d in dispatch.details["dispatch"].items()}
    assert uniform == {
        f"K={k} {case}": case.startswith("decode")
        for k in (3, 15)
        for case in ("one prefill", "decode (control)", "two prefills")
    }


def test_0340_groups_share_one_gdn_build_read_as_their_graphs_were_captured(probe_release):
    """0.34.0's GDN builder takes another group's metadata only on a CUDA device (the probe
    hands it one whose tensors live on the CPU), and its V2 runner's own
    ``build_attn_metadata`` shares at capture as at each step: every group's metadata equals
    its own build and its graphs read this step's values (fix 19 superseded)."""
    (groups,) = probe_release("0.34.0", "gdn_metadata_groups").values()
    assert groups.status == PRESENT, groups.evidence
    assert groups.details["differences"] == {
        "DFlash at K=3": {
            "verifying drafts": [],
            "drafts beside a prefill": [],
            "decodes without drafts": [],
        },
        "plain": {"decodes": [], "decodes beside a prefill": []},
    }


def test_0340_pads_verify_steps_on_its_piecewise_token_grid(probe_release):
    """0.34.0's V2 runner keys PIECEWISE graphs by token count for every batch: at a K + 1
    that is a power of two every verify step lands on a multiple of it, at K = 5 some do
    not. Whether that faults is a GPU's question, so fix 9's probe reads unknown there."""
    (sizes,) = probe_release("0.34.0", "piecewise_spec_sizes").values()
    assert sizes.status == UNKNOWN, sizes.evidence
    assert sizes.details["K=3"] == sizes.details["K=7"] == sizes.details["K=15"] == {}
    assert sizes.details["K=5"]["5"] == 32 and sizes.details["K=5"]["6"] == 40


def test_0340_serves_pipelines_and_reasoning_its_own_way_but_keeps_the_custom_all_reduce(
    probe_release,
):
    """0.34.0 relays the drafter's hidden states between pipeline stages for an attention
    target and refuses a hybrid one at load by name, and its structured-output manager
    constrains the answer from the token after a reasoning end inside the drafts. Of fix 11
    it lacks only NCCL's all-reduce for a hybrid target at TP 2: what its port brings."""
    (guards,) = probe_release("0.34.0", "dflash_serving_guards").values()
    assert guards.status == ABSENT, guards.evidence
    assert guards.details == {
        "pipeline_refused_or_relayed": True,
        "hybrid_tp2_custom_all_reduce": True,
        "attention_tp2_custom_all_reduce": True,
        "structured_output_after_reasoning_in_drafts": "constrained",
    }
    assert "Qwen3NextForCausalLM does not support dflash with pipeline parallelism" in (
        guards.evidence
    )


def test_0340_builds_each_flashattention_groups_own_fa3_schedule(probe_release):
    """0.34.0's V2 runner hands metadata on only between Mamba groups: through its own
    ``build_attn_metadata``, each FlashAttention group's graph reads the step's schedule
    (fix 12 superseded)."""
    (schedule,) = probe_release("0.34.0", "fa3_schedule_per_group").values()
    assert schedule.status == PRESENT, schedule.evidence
    assert "the V2 runner's build_attn_metadata" in schedule.evidence
    assert schedule.details["second group's graph reads its own buffer"] is True


def test_0280_starts_a_decode_without_drafts_from_slot_0_and_0340_cannot_be_asked(probe_release):
    """Fix 24 on the last release whose config chooses the V1 runner for the hybrid pair:
    decodes without drafts after a verify step take the non-speculative path from each
    request's first state slot, and a request passed over comes back with its count reset.
    0.34.0 has only the V2 runner: unknown, never absent for an API it does not have."""
    (v1,) = probe_release("0.28.0", "accepted_state").values()
    assert v1.status == ABSENT, v1.evidence
    assert v1.details["no_drafts"]["slots"] == {"r0": 0, "r1": 0, "r2": 0}
    assert v1.details["kept_count"] == 1
    (v2,) = probe_release("0.34.0", "accepted_state").values()
    assert v2.status == UNKNOWN, v2.evidence
    assert v2.evidence.startswith("no V1 model runner"), v2.evidence
