"""The trained hybrid pair's recipe folder and engine results, shaped as the GPU side writes
them, so the plan and the verdicts can be judged without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

from tooling.trained import hybrid as tp
from tooling.trained import hybrid_plan as hp

K = 15
LOSSLESS = [
    f"k{K}-len{K}",
    f"k{K}-len{K + 1}",
    f"k{K}-len{K + 2}",
    "prefix-a",
    "prefix-b",
    "to-max-model-len",
]
PREFIX = ["prefix-a", "prefix-b"]
#: The greedy outputs of the acceptance prompts, the reference's and (unless a test says
#: otherwise) every engine's.
OUTPUTS = [[1, 2, 3, 4], [5, 6, 7, 8]]


def _pair(tmp: Path, reference_length: float = 5.0) -> Path:
    pair = tmp / "pair"
    drafter = pair / "drafter"
    drafter.mkdir(parents=True)
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    config = {"num_hidden_layers": 3, "layer_types": layers, "sliding_window": 64}
    (drafter / "config.json").write_text(json.dumps(config))
    (drafter / "model.safetensors").write_bytes(b"weights")
    prompts = {
        "prompts": [{"token_ids": [5, 6, 7]}, {"token_ids": [8, 9, 10]}],
        "max_new_tokens": 4,
        "speculative_tokens": [K],
        "engine": {"max_model_len": 64, "max_num_batched_tokens": 32, "max_num_seqs": 64},
        "lossless": [{"name": n, "token_ids": [1, 2], "max_new_tokens": 4} for n in LOSSLESS],
    }
    (pair / "prompts.json").write_text(json.dumps(prompts))
    summary = {
        "reference": {
            "by_speculative_tokens": {
                str(K): {"mean_acceptance_length": reference_length, "acceptance_per_position": []}
            }
        }
    }
    (pair / "summary.json").write_text(json.dumps(summary))
    # Per prompt, five drafting steps of which each accepts ``reference_length - 1`` tokens.
    per_step = int(reference_length - 1)
    runs = [
        {"output_ids": out, "drafted_per_step": [K] * 5, "accepted_per_step": [per_step] * 5}
        for out in OUTPUTS
    ]
    (pair / "reference.json").write_text(json.dumps({"by_speculative_tokens": {str(K): runs}}))
    return pair


def _completion(
    tokens: list[int], margin: float = 3.0, cached: int = 0, ties: dict[int, float] | None = None
) -> dict:
    # The chosen token leads the next best by ``margin`` at every position, but by
    # ``ties[i]`` at position i.
    gaps = [(ties or {}).get(i, margin) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "logprobs": [
            {str(t): -0.1, "999": -0.1 - gap} for t, gap in zip(tokens, gaps, strict=True)
        ],
        "finish_reason": "length",
        "num_cached_tokens": cached,
    }


def _result(
    name: str,
    k: int,
    lossless: dict,
    accepted: int = 40,
    drafts: int = 10,
    running: int = 0,
    outputs: list[list[int]] | None = None,
    per_prompt: list[tuple[int, int]] | None = None,
    at_once: list[list[int]] | None = None,
    ties: dict[int, float] | None = None,
) -> dict:
    """An engine's results; ``per_prompt``: (drafts, accepted) of each prompt served alone
    (default: ``drafts`` and ``accepted`` split evenly); ``at_once``: the outputs with 16
    at once (default: ``outputs``), each position's top-2 3.0 apart but ``ties``."""
    spec = {
        f"{hp.SPEC}num_drafts": drafts,
        f"{hp.SPEC}num_draft_tokens": drafts * k,
        f"{hp.SPEC}num_accepted_tokens": accepted,
        f"{hp.SPEC}num_accepted_tokens_per_pos": [drafts] * 4 + [0] * (k - 4),
    }
    outputs = outputs or OUTPUTS
    by_level = {c: (at_once or outputs) if c > 1 else outputs for c in hp.ACCEPTANCE_CONCURRENCY}
    if per_prompt is None:
        half = accepted // 2
        per_prompt = [(drafts // 2, half), (drafts - drafts // 2, accepted - half)]
    counters = [
        {f"{hp.SPEC}num_drafts": d, f"{hp.SPEC}num_accepted_tokens": a} for d, a in per_prompt
    ]
    # ``running``: the most requests the engine ran at once (0: as many as asked).
    speed = {
        str(c): [{"seconds": 2.0, "tokens": 100 * c, "most_running": running or c}]
        + [{"seconds": 1.0 if k else 3.0, "tokens": 100 * c, "most_running": running or c}] * 2
        for c in hp.SPEED_CONCURRENCY
    }
    return {
        "ok": True,
        "name": name,
        "startup_s": 100.0,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "num_speculative_tokens": k,
        "lossless": lossless,
        "acceptance": {
            str(c): {
                "outputs": by_level[c],
                "completions": [_completion(o, ties=ties) for o in by_level[c]],
                "spec": spec if k else {},
                "most_running": running or c,
                **({"per_prompt": counters} if c == 1 and k else {}),
            }
            for c in hp.ACCEPTANCE_CONCURRENCY
        },
        "speed": speed if name in (hp.PLAIN_SPEED, f"patched-k{K}-speed") else {},
    }


def _run(
    tmp: Path,
    stock_lossless: dict | None = None,
    patched_lossless: dict | None = None,
    patched_accepted: int = 40,
    patched_running: int = 0,
    cached: int = 1024,
    patched_outputs: list[list[int]] | None = None,
    patched_per_prompt: list[tuple[int, int]] | None = None,
    patched_at_once: list[list[int]] | None = None,
    plain_at_once: list[list[int]] | None = None,
    plain_ties: dict[int, float] | None = None,
    unfixed_at_once: list[list[int]] | None = None,
) -> tuple[str, bool]:
    """A run's report; ``unfixed_at_once``: the outputs with 16 at once of the wheel without
    ``FULL_DRAFTER_FIX`` on the full-attention drafter (default: changed, as on a GPU)."""
    pair = _pair(tmp)
    work = tmp / "work"
    chosen = hp.plan(pair, work)
    clean = {n: _completion([10, 11, 12, 13]) for n in LOSSLESS}
    garbage = dict(clean)
    garbage[f"k{K}-len{K + 1}"] = _completion([77, 78, 79, 80])
    # With prefix caching, the prompt after the first finds the shared prefix in the cache.
    prefixed = {"prefix-a": _completion([10, 11]), "prefix-b": _completion([12, 13], cached=cached)}
    for v in chosen:
        if v.prefix_caching:
            result = _result(v.name, v.k, prefixed)
        elif v.name == hp.PLAIN:
            result = _result(v.name, 0, clean, at_once=plain_at_once, ties=plain_ties)
        elif v.speed:
            result = _result(v.name, v.k, {}, running=patched_running if v.drafted else 0)
        elif v.full_drafter and v.site != "patched":
            changed = [[1, 2, 90, 91], [5, 6, 92, 93]]
            result = _result(v.name, v.k, clean, at_once=unfixed_at_once or changed)
        elif v.site == "stock":
            result = _result(v.name, v.k, stock_lossless if stock_lossless is not None else garbage)
        elif v.site == "patched":
            result = _result(
                v.name,
                v.k,
                patched_lossless or clean,
                accepted=patched_accepted,
                running=patched_running,
                outputs=patched_outputs,
                per_prompt=patched_per_prompt,
                at_once=patched_at_once,
            )
        else:
            result = _result(v.name, v.k, clean)
        (work / f"{v.name}.out.json").write_text(json.dumps(result))
    return tp.report(pair, work)
