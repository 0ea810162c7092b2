"""The engines a speed run (``tooling.trained.speed``) can serve, by name: plain vLLM on stock
and on the fixed wheel, DFlash as shipped, DFlash with one setting changed, and the
seed-scale engines, each with the KV cache its levels need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLAIN = "plain"
STOCK = "plain-stock"
DRAFTED = "dflash"
#: KV cache per engine, GiB: at K = 15 each request holds 1 + K Gated DeltaNet states (64
#: requests of the trained pair's shapes; 32 of the seed's).
KV_GIB_PLAIN = 6
KV_GIB_DRAFTED = 40
KV_GIB_DRAFTED_16 = 12
KV_GIB_SEED_PLAIN = 8
KV_GIB_SEED_DRAFTED = 56
BUDGET = [[1, 16, 15], [17, 1024, 7]]
GRAPHS_1024 = {"compilation_config": {"max_cudagraph_capture_size": 1024}}
BUDGETED = {"num_speculative_tokens_per_batch_size": BUDGET}
OFF_ABOVE_8 = {"num_speculative_tokens_per_batch_size": [[1, 8, 15], [9, 1024, 0]]}


@dataclass(frozen=True)
class SpeedEngine:
    name: str
    site: str
    drafted: bool
    kv_cache_gib: int
    engine_args: dict[str, Any] = field(default_factory=dict)
    constant_logits: bool = False
    k: int | None = None
    """None: the run's K."""
    speculative_args: dict[str, Any] = field(default_factory=dict)


#: Every engine a run can ask for by name: plain on stock and on the fixed wheel, DFlash as
#: shipped, DFlash with one setting changed (a candidate fix measured beside it), and the
#: seed-scale engines (the DFlash one measured again with every draft accepted).
ENGINES = {
    e.name: e
    for e in (
        SpeedEngine(STOCK, "stock", False, KV_GIB_PLAIN),
        SpeedEngine(PLAIN, "patched", False, KV_GIB_PLAIN),
        SpeedEngine(DRAFTED, "patched", True, KV_GIB_DRAFTED),
        # CUDA graphs for verify steps of 64 requests at K = 15 (vLLM captures up to 512).
        SpeedEngine("dflash-graphs-1024", "patched", True, KV_GIB_DRAFTED, GRAPHS_1024),
        # Fewer tokens drafted: what a speculation budget that lowers K would serve.
        *(
            SpeedEngine(f"dflash-k{k}", "patched", True, kv, GRAPHS_1024, k=k)
            for k, kv in ((7, 24), (3, 12), (1, 8))
        ),
        # Patch 17's budget: K = 15 up to 16 running requests, 7 above.
        SpeedEngine("dflash-budget", "patched", True, KV_GIB_DRAFTED, speculative_args=BUDGETED),
        # Patch 22's full drafter graphs (on by default) turned off: what they save where a
        # step is CPU time (up to 16 requests: a fifth engine of 64 would not fit one H200).
        SpeedEngine(
            "dflash-no-drafter-graphs",
            "patched",
            True,
            KV_GIB_DRAFTED_16,
            speculative_args={"dflash_full_cudagraphs": False},
        ),
        # Patch 23's budget: drafting off above 8 running requests (their steps verify none,
        # and on this hybrid target read the state the drafts before them left, patch 24).
        SpeedEngine(
            "dflash-off-above-8", "patched", True, KV_GIB_DRAFTED, speculative_args=OFF_ABOVE_8
        ),
        # Prefix caching off, so the Gated DeltaNet states are kept per request, not aligned to
        # blocks: whether the cost of a step with a prompt joining is the aligned states'.
        SpeedEngine(
            "dflash-no-prefix-caching",
            "patched",
            True,
            KV_GIB_DRAFTED,
            {"enable_prefix_caching": False},
        ),
        # Patch 32's option: a verify step writes one Gated DeltaNet state a request, not K + 1
        # (prefix caching off, which the option needs; beside it, dflash-no-prefix-caching).
        SpeedEngine(
            "dflash-replay",
            "patched",
            True,
            KV_GIB_DRAFTED,
            {"enable_prefix_caching": False},
            speculative_args={"gdn_spec_replay": True},
        ),
        # Patch 33's option: a prompt arriving while every request verifies drafts waits up
        # to four steps, so that prompts a few steps apart share one step with a prefill.
        SpeedEngine(
            "dflash-hold",
            "patched",
            True,
            KV_GIB_DRAFTED,
            speculative_args={"join_hold_steps": 4},
        ),
        # Patch 34 left out: a verify step's inputs uploaded array by array, as vLLM 0.20.1
        # does (up to 16 requests, beside DFlash sized the same).
        SpeedEngine("dflash-16", "patched", True, KV_GIB_DRAFTED_16),
        SpeedEngine("dflash-no-inputs-upload", "no-spec-inputs-upload", True, KV_GIB_DRAFTED_16),
        # Patch 35 left out: an all-greedy verify step through the full sampler, two float32
        # copies and a second argmax, as vLLM 0.20.1 does.
        SpeedEngine("dflash-no-greedy-verify", "no-greedy-verify-direct", True, KV_GIB_DRAFTED_16),
        # Patch 37 left out: the drafter's context K/V written with two of vLLM's kernels a
        # layer, as vLLM 0.20.1 does.
        SpeedEngine("dflash-no-context-kv", "no-context-kv-one-launch", True, KV_GIB_DRAFTED_16),
        # Patch 36 left out: a verify step's computed tokens corrected by vLLM 0.20.1's
        # compiled function of twelve tensor operations.
        SpeedEngine("dflash-no-correction", "no-correction-one-launch", True, KV_GIB_DRAFTED_16),
        # Patch 38 left out: every verify step's speculative metadata computed with numpy and
        # uploaded, as vLLM 0.20.1 does (in patch 34's one copy).
        SpeedEngine("dflash-no-metadata-reuse", "no-spec-metadata-reuse", True, KV_GIB_DRAFTED_16),
        # Patch 39 left out: with prefix caching, every verify step's accepted counts read back
        # with a wait before the drafter launches, as vLLM 0.20.1 does.
        SpeedEngine(
            "dflash-no-align-deferred", "no-align-counts-deferred", True, KV_GIB_DRAFTED_16
        ),
        # Patch 40's option (off by default): a decode step's drafter replays one graph of
        # its whole step.
        SpeedEngine(
            "dflash-step-graphs",
            "patched",
            True,
            KV_GIB_DRAFTED_16,
            speculative_args={"dflash_step_graphs": True},
        ),
        # Patch 18 left out: the KV-cache groups vLLM 0.20.1 sizes by the drafter's layers.
        SpeedEngine("dflash-no-kv-groups", "no-drafter-kv-groups", True, KV_GIB_DRAFTED),
        # Patch 19 left out: every Gated DeltaNet group's metadata built in full each step.
        SpeedEngine("dflash-no-gdn-groups", "no-gdn-metadata-groups", True, KV_GIB_DRAFTED),
        SpeedEngine("seed-plain", "patched", False, KV_GIB_SEED_PLAIN),
        SpeedEngine("seed-dflash", "patched", True, KV_GIB_SEED_DRAFTED, constant_logits=True),
    )
}
