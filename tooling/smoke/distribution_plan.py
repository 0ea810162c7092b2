"""The plan of check 10's engine runs (``distribution``): the prompts, the engines and the
requests ``serving/distribution.py`` serves.

Prompt lengths surround a spec-decode step's shape (K, K+1, K+2, 3(K+1)); a prompt runs to
``max_model_len``; staggered waves join requests that verify drafts; and 64 concurrent
requests. The plain engine serves its prompts alone, then together, then scores them in one
pass (the noise references); each DFlash engine serves them alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Positions compared after a prompt: the first token and seven more.
FIRST_POSITIONS = 8
#: Top-k logprobs per position: vLLM's default ``max_logprobs``. On random weights the
#: distribution is near flat (at width 5120 the top 5 within 0.3 of each other), so a
#: greedy swap at a later position can name a token past a top 5, whose margin is then
#: unknown.
LOGPROBS = 20
MAX_MODEL_LEN = 1024
TO_MAX_LEN = "E-maxlen"
TO_MAX_LEN_TOKENS = 40


def lengths_for(k: int) -> dict[str, int]:
    """The prompt lengths that surround a spec-decode step's shape: K, K+1, K+2, 3(K+1)."""
    return {"K": k, "K+1": k + 1, "K+2": k + 2, "3(K+1)": 3 * (k + 1)}


def first_token_prompts(k: int, per_length: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "name": f"A{k}-{label}-{i}",
            "length": n,
            "max_tokens": FIRST_POSITIONS,
            "seed": 1000 * k + 10 * n + i,
        }
        for label, n in lengths_for(k).items()
        for i in range(per_length)
    ]


def to_max_len_prompt() -> dict[str, Any]:
    return {
        "name": TO_MAX_LEN,
        "length": MAX_MODEL_LEN - TO_MAX_LEN_TOKENS,
        "max_tokens": TO_MAX_LEN_TOKENS,
        "seed": 7,
    }


def staggered_waves() -> list[dict[str, Any]]:
    """Four requests decode; once the two short ones finish, two short prompts join the
    two still verifying drafts: steps that mix spec and non-spec requests.

    The persistent batch stays dense (it moves its last rows into freed ones), so the
    new prompts sit after the requests verifying drafts. That is not the order the GDN
    gate defect needs (a non-spec query before a spec one); the gdn_gate_gather probe
    drives that order on the CPU. No prompt is a single token: vLLM 0.20.1 without
    speculation serves a one-token prompt that joins running requests from a stale
    recurrent state on a hybrid target, so the plain engine is no reference for it.
    """

    def prompt(name: str, length: int, max_tokens: int, seed: int) -> dict[str, Any]:
        return {"name": name, "length": length, "max_tokens": max_tokens, "seed": seed}

    return [
        {
            "prompts": [
                prompt("B-short-0", 40, 2, 21),
                prompt("B-short-1", 40, 2, 22),
                prompt("B-long-0", 40, 40, 23),
                prompt("B-long-1", 40, 40, 24),
            ]
        },
        {
            "after": ["B-short-0", "B-short-1"],
            "prompts": [prompt("B-new-0", 5, 24, 25), prompt("B-new-1", 12, 24, 26)],
        },
    ]


def concurrent_prompts(count: int = 64) -> list[dict[str, Any]]:
    return [
        {"name": f"C-{i}", "length": 16 + (37 * i) % 185, "max_tokens": 64, "seed": 5000 + i}
        for i in range(count)
    ]


@dataclass
class Variant:
    name: str
    site: str
    """Which install serves it: ``patched``, ``stock`` or an ablation's folder name."""
    num_speculative_tokens: int
    kv_cache_gib: float
    workloads: list[str]
    cudagraph_mode: str | None = None
    max_num_seqs: int = 8
    expect: str = "fixed"
    """``fixed`` (must pass), ``stock`` (must fail on K+1 where it runs that workload),
    ``plain`` (the reference), or ``report`` (figures only)."""
    call: int = 1
    """Which GPU call runs it (the engines of one call share the GPU)."""


def smoke_variants(k: int, plain_kv_gib: float, dflash_kv_gib: float) -> list[Variant]:
    """The smoke's first-token check: the plain engine (its prompts alone, then together:
    the noise) and the DFlash engine at the smoke's K."""
    return [
        Variant("plain", "patched", 0, plain_kv_gib, [f"A{k}", "together", "scored"]),
        Variant(f"dflash-k{k}", "patched", k, dflash_kv_gib, [f"A{k}"]),
    ]


def request_for(
    v: Variant, target: str, drafter: str, per_length: int = 3, **engine: Any
) -> dict[str, Any]:
    """The engine request of ``v``; ``engine`` overrides the request's engine fields
    (``max_model_len``, ``vocab_size``, ``engine_args``, ...)."""
    alone: list[dict[str, Any]] = []
    for workload in v.workloads:
        if workload.startswith("A"):
            alone += first_token_prompts(int(workload[1:]), per_length)
    if "E" in v.workloads:
        alone.append(to_max_len_prompt())
    return {
        "target": target,
        "drafter": drafter if v.num_speculative_tokens else None,
        "num_speculative_tokens": v.num_speculative_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": v.max_num_seqs,
        "kv_cache_memory_bytes": int(v.kv_cache_gib * 2**30),
        "gpu_memory_utilization": 0.05,
        "cudagraph_mode": v.cudagraph_mode,
        "logprobs": LOGPROBS,
        "alone": alone,
        "together": "together" in v.workloads,
        "scored": "scored" in v.workloads,
        "staggered": staggered_waves() if "B" in v.workloads else [],
        "concurrent": concurrent_prompts() if "C" in v.workloads else [],
        **engine,
    }
