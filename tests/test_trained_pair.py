"""The trained hybrid pair's GPU verdicts, judged here on results of the engine's own shape.

The engine side (``tooling.trained.serving.trained_run``) needs a GPU; these tests give the
judge the JSON that side writes and check that each verdict can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.trained import hybrid as tp
from tooling.trained import hybrid_plan as hp
from tooling.trained import hybrid_verdicts as hv

from .helpers import run_gpu_script

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


def test_plan_writes_one_request_per_engine_with_the_recipes_prompts(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    chosen = hp.plan(pair, tmp_path / "work")
    names = [v.name for v in chosen]
    assert names[0] == "plain" and f"stock-k{K}" in names
    assert {f"no-{p}-k{K}" for p in hp.ABLATED} <= set(names)
    # The fixed wheel with the drafter on full graphs of its own, and under a budget whose
    # 16 at once verify fewer drafts: in the first call only.
    (graphs,) = [v for v in chosen if v.drafter_graphs]
    assert graphs.call == 1 and graphs.site == "patched" and graphs.k == K
    sent = json.loads((tmp_path / "work" / f"{graphs.name}.in.json").read_text())["engine"]
    assert sent["speculative_args"] == hp.DRAFTER_GRAPHS
    # The budget's 16 at once verify no drafts, on the fixed wheel and, as its control, on
    # the wheel without the fix of the state such a step reads.
    budgets = [v for v in chosen if v.budget]
    assert [v.site for v in budgets] == ["patched", f"no-{hp.STATE_FIX}"]
    for budget in budgets:
        assert budget.call == 1 and budget.k == K
        sent = json.loads((tmp_path / "work" / f"{budget.name}.in.json").read_text())["engine"]
        ranges = sent["speculative_args"]["num_speculative_tokens_per_batch_size"]
        assert ranges[0][2] == K and ranges[1][2] == hp.LOAD_BUDGET_K == 0
        assert ranges[1][0] <= hp.LOAD_CONCURRENCY
    # Patch 32's option beside them, with prefix caching off, which it needs.
    (replay,) = [v for v in chosen if v.replay]
    assert replay.call == 1 and replay.site == "patched" and replay.k == K
    sent = json.loads((tmp_path / "work" / f"{replay.name}.in.json").read_text())["engine"]
    assert sent["speculative_args"] == hp.REPLAY
    assert sent["engine_args"]["enable_prefix_caching"] is False
    assert {v.site for v in chosen} == set(hp.SITES)
    request = json.loads((tmp_path / "work" / f"patched-k{K}.in.json").read_text())
    assert request["engine"]["num_speculative_tokens"] == K
    assert request["engine"]["drafter"].endswith("drafter")
    assert [p["name"] for p in request["lossless"]] == LOSSLESS
    assert request["speed"] is None
    assert request["barrier_count"] == len([v for v in chosen if v.call == 1])
    plain = json.loads((tmp_path / "work" / "plain.in.json").read_text())
    assert plain["engine"]["drafter"] is None and plain["speed"] is None
    # vLLM keeps K - 1 slots per sequence for the drafter out of max_num_batched_tokens:
    # every engine schedules the recipe's 32 tokens per step.
    assert plain["engine"]["max_num_batched_tokens"] == 32
    assert request["engine"]["max_num_batched_tokens"] == 32 + 64 * (K - 1)
    assert "enable_prefix_caching" not in request["engine"]["engine_args"]


def test_speed_has_a_call_of_its_own_at_vllms_default_tokens_per_step(tmp_path: Path) -> None:
    # The recipe's budget holds 64 requests at K = 15 to fewer at once: the speed pair
    # leaves vLLM its default, measures nothing else, and takes turns on the GPU.
    chosen = hp.plan(_pair(tmp_path), tmp_path / "work")
    speed = [v for v in chosen if v.speed]
    assert [(v.name, v.k) for v in speed] == [(hp.PLAIN_SPEED, 0), (f"patched-k{K}-speed", K)]
    assert {v.call for v in speed} == {max(v.call for v in chosen)}
    assert all(v.call < speed[0].call for v in chosen if not v.speed)
    for v in speed:
        request = json.loads((tmp_path / "work" / f"{v.name}.in.json").read_text())
        assert request["engine"]["max_num_batched_tokens"] is None
        assert request["lossless"] == [] and request["acceptance_concurrency"] == []
        assert request["speed"]["concurrency"] == list(hp.SPEED_CONCURRENCY)
        assert request["barrier_count"] == 2


def test_fix_12s_pair_serves_the_drafter_with_every_layer_full_attention(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    chosen = hp.plan(pair, tmp_path / "work")
    full = [v for v in chosen if v.full_drafter]
    assert [(v.site, v.k) for v in full] == [("patched", K), (f"no-{hp.FULL_DRAFTER_FIX}", K)]
    folder = tmp_path / "work" / hp.FULL_DRAFTER
    for v in full:
        request = json.loads((tmp_path / "work" / f"{v.name}.in.json").read_text())
        assert request["engine"]["drafter"] == str(folder)
        assert request["acceptance_concurrency"] == list(hp.ACCEPTANCE_CONCURRENCY)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] * 3
    # The weights are the pair's own; the pair's folder is not written.
    assert (folder / "model.safetensors").resolve() == (pair / "drafter" / "model.safetensors")
    assert json.loads((pair / "drafter" / "config.json").read_text())["layer_types"][0] == (
        "sliding_attention"
    )


def test_without_fix_12_lossless_under_load_means_the_check_cannot_see_its_fault(
    tmp_path: Path,
) -> None:
    text, ok = _run(tmp_path / "a")
    assert ok, text
    assert f"| no-{hp.FULL_DRAFTER_FIX}-k{K}-full-drafter | FAIL |" in text
    # Its acceptance is not the pair's: no acceptance row for either engine.
    assert "full-drafter" not in text.split("## Strict")[0].split("## Acceptance")[1]
    text, ok = _run(tmp_path / "b", unfixed_at_once=OUTPUTS)
    assert not ok
    assert "without fa3-schedule-per-group, so the check does not show the fault" in text


def test_each_call_is_served_on_one_h200_in_one_turn() -> None:
    from tooling.trained.gpu_fit import turns

    chosen = hp.variants((15, 7))
    for call in {v.call for v in chosen}:
        engines = [v for v in chosen if v.call == call]
        # nvidia-smi's memory.total of one H200, GiB.
        assert turns(engines, 143771 / 1024, f"call {call}") == [engines], call


def test_the_prefix_cache_pair_serves_only_the_prompts_that_share_a_prefix(
    tmp_path: Path,
) -> None:
    chosen = hp.plan(_pair(tmp_path), tmp_path / "work")
    prefixed = [v for v in chosen if v.prefix_caching]
    assert [(v.name, v.k) for v in prefixed] == [(hp.PLAIN_PREFIX, 0), (f"patched-k{K}-prefix", K)]
    for v in prefixed:
        request = json.loads((tmp_path / "work" / f"{v.name}.in.json").read_text())
        assert request["engine"]["engine_args"]["enable_prefix_caching"] is True
        assert [p["name"] for p in request["lossless"]] == PREFIX
        assert request["acceptance_concurrency"] == [] and request["speed"] is None


def test_a_prefix_prompt_that_found_nothing_in_the_cache_proves_nothing(tmp_path: Path) -> None:
    text, ok = _run(tmp_path, cached=0)
    assert not ok
    assert f"patched-k{K}-prefix: prefix-b found no tokens in the prefix cache" in text
    assert f"{hp.PLAIN_PREFIX}: prefix-b found no tokens in the prefix cache" in text


def test_figures_at_a_concurrency_the_engine_did_not_reach_are_refused(tmp_path: Path) -> None:
    text, ok = _run(tmp_path, patched_running=7)
    assert not ok
    assert f"patched-k{K}: at most 7 of 16 requests ran at once" in text
    assert f"speed at 64 concurrent: at most patched-k{K}-speed 7 ran at once" in text
    assert "| 64 | 2133 | 6400 | 3.00 |" in text and "| 64 / 7 |" in text


def test_report_passes_when_fixed_is_lossless_and_stock_fails_on_k_plus_1(tmp_path: Path) -> None:
    text, ok = _run(tmp_path)
    assert ok, text
    assert f"| stock-k{K} | FAIL |" in text and f"k{K}-len{K + 1} @ 0: 3.0000" in text
    assert f"| patched-k{K} | pass |" in text
    # Speed: 100 tokens/s per request plain (3 s passes), 300 with the drafter (1 s).
    assert "| 16 | 533 | 1600 | 3.00 |" in text


def test_a_difference_at_a_near_tie_is_excused_and_listed_a_larger_one_fails(
    tmp_path: Path,
) -> None:
    def differing(margin: float) -> dict:
        out = {n: _completion([10, 11, 12, 13]) for n in LOSSLESS}
        out["prefix-a"] = _completion([10, 11, 99, 98])
        return out

    tie = hp.TIE_MARGIN
    plain = {n: _completion([10, 11, 12, 13], margin=tie) for n in LOSSLESS}
    verdict = hv.lossless(
        "x", {"ok": True, "lossless": plain}, {"ok": True, "lossless": differing(tie)}
    )
    assert verdict.ok and [p.prompt for p in verdict.ties] == ["prefix-a"]
    plain = {n: _completion([10, 11, 12, 13], margin=2 * tie) for n in LOSSLESS}
    verdict = hv.lossless(
        "x", {"ok": True, "lossless": plain}, {"ok": True, "lossless": differing(tie)}
    )
    assert not verdict.ok and verdict.failures[0].first_difference == 2


def test_a_failure_within_one_bf16_step_still_fails_and_is_named() -> None:
    clean = {n: _completion([10, 11, 12, 13]) for n in LOSSLESS}
    broken = dict(clean)
    broken["to-max-model-len"] = _completion([10, 11, 12, 50])
    plain = {n: _completion([10, 11, 12, 13], margin=hp.BF16_STEP) for n in LOSSLESS}
    lines, problems = tp.lossless_section(
        [hp.Variant("plain", "patched", 0, 1), hp.Variant(f"patched-k{K}", "patched", K, 1)],
        {
            "plain": {"ok": True, "lossless": plain},
            f"patched-k{K}": {"ok": True, "lossless": broken},
        },
    )
    assert problems == [f"patched-k{K}: strict lossless check not passed"]
    assert any(
        "to-max-model-len @ 3: 0.0312: the plain margin is at most one bf16" in x for x in lines
    )


def test_stock_passing_or_fixed_failing_is_a_failed_run(tmp_path: Path) -> None:
    clean = {n: _completion([10, 11, 12, 13]) for n in LOSSLESS}
    text, ok = _run(tmp_path / "a", stock_lossless=clean)
    assert not ok and "stock passed the strict lossless check" in text
    broken = dict(clean)
    broken["to-max-model-len"] = _completion([10, 11, 12, 50])
    text, ok = _run(tmp_path / "b", patched_lossless=broken)
    assert not ok and f"patched-k{K}: strict lossless check not passed" in text


def test_fixed_acceptance_off_the_reference_by_more_than_2_percent_fails(tmp_path: Path) -> None:
    # Against the reference's 5.0: 1 + 39/10 = 4.9 and 1 + 41/10 = 5.1 are within 2%;
    # 4.7 and 5.3 are not.
    assert _run(tmp_path / "a", patched_accepted=39)[1]
    assert _run(tmp_path / "b", patched_accepted=41)[1]
    for accepted in (37, 43):
        text, ok = _run(tmp_path / f"c{accepted}", patched_accepted=accepted)
        assert not ok and "not within 2% of the reference" in text


def test_acceptance_is_set_beside_the_reference_on_the_outputs_they_share(tmp_path: Path) -> None:
    # The second prompt's output left the reference's at a near-tie and accepted more there:
    # 1 + 60/10 = 7.0 in all, 40% above the reference, but 5.0 = 5.0 on the shared prompt.
    other = [OUTPUTS[0], [5, 6, 7, 9]]
    text, ok = _run(
        tmp_path / "a",
        patched_accepted=60,
        patched_outputs=other,
        patched_per_prompt=[(5, 20), (5, 40)],
        plain_ties={3: hp.BF16_STEP},
    )
    assert ok, text
    assert "| 7.000 | " in text and "| 5.000 / 5.000 (1 of 2) |" in text
    # The same prompt, accepting less than the reference did: a difference in the drafting.
    text, ok = _run(
        tmp_path / "b",
        patched_accepted=55,
        patched_outputs=other,
        patched_per_prompt=[(5, 15), (5, 40)],
    )
    assert not ok
    assert "acceptance length 4.000 is not within 2% of the reference's 5.000 on the 1" in text
    # No output shared: nothing to set beside the reference.
    text, ok = _run(tmp_path / "c", patched_outputs=[[9], [9]])
    assert not ok and "patched-k15: 0 of 2 outputs equal the reference's" in text


def test_fixed_output_under_load_leaving_plains_at_a_decisive_position_fails(
    tmp_path: Path,
) -> None:
    # Served alone every prompt matches; with 16 at once the second leaves the plain
    # engine's output where the plain run's top-2 margin is 3.0.
    text, ok = _run(tmp_path, patched_at_once=[OUTPUTS[0], [5, 6, 99, 8]])
    assert not ok
    assert f"patched-k{K}: not lossless with 16 requests at once" in text
    assert f"| patched-k{K} | FAIL | 2 | prompt 1 @ 2: 3.0000 | - |" in text
    assert "own noise between one at a time and at once 0.0000" in text


def test_under_load_the_plain_engines_own_noise_excuses_a_difference(tmp_path: Path) -> None:
    # The plain engine's two batch shapes part at prompt 1, token 3, where each run's top-2
    # margin is 0.0625: the gap moved by 0.125, so a difference at a margin of 0.0625 (over
    # one bf16 step) is a tie.
    text, ok = _run(
        tmp_path / "a",
        plain_at_once=[OUTPUTS[0], [5, 6, 7, 77]],
        plain_ties={3: 0.0625},
        patched_at_once=[[1, 2, 3, 40], [5, 6, 7, 8]],
    )
    assert ok, text
    assert "noise between one at a time and at once 0.1250" in text
    assert f"| patched-k{K} | pass | 2 | - | prompt 0 @ 3: 0.0625 |" in text
    # An output the plain engine gave one at a time is its own: no excuse needed.
    text, ok = _run(
        tmp_path / "b", plain_at_once=[OUTPUTS[0], [5, 6, 7, 77]], plain_ties={3: 0.0625}
    )
    assert ok and f"| patched-k{K} | pass | 2 | - | - |" in text


def test_under_load_a_margin_of_one_bf16_step_read_in_fp32_is_within_that_noise() -> None:
    # The trained pair on an H200: the plain engine's two batch shapes part where alone its
    # margin is one bf16 step (0.0625) and at once 0, so the noise is 0.0625; the fixed wheel
    # with a full-attention drafter leaves plain's output at once where plain's margin, in
    # the fp32 logprobs vLLM returns, reads 0.0625000596. One bf16 step either way: a tie.
    def completion(tokens: list[int], at: int, lead: dict[str, float]) -> dict:
        rest = [{str(t): -0.1, "999": -3.1} for t in tokens]
        rest[at] = lead
        return {"tokens": tokens, "logprobs": rest}

    alone = [
        completion([1, 22, 3], 1, {"22": -1.5598620176315308, "21": -1.6223620176315308}),
        completion([4, 24, 6], 1, {"24": -0.9749574661254883, "22": -1.0374574661254883}),
    ]
    at_once = [
        completion([1, 21, 3], 1, {"21": -1.6095068454742432, "22": -1.6095068454742432}),
        completion([4, 24, 6], 1, {"24": -0.9753608107566833, "22": -1.0378608703613281}),
    ]
    drafted = [
        at_once[0],
        completion([4, 22, 6], 1, {"22": -1.0143451690673828, "24": -1.0143451690673828}),
    ]
    plain = {
        "ok": True,
        "acceptance": {"1": {"completions": alone}, "16": {"completions": at_once}},
    }
    fixed = {"ok": True, "acceptance": {"16": {"completions": drafted}}}
    chosen = [hp.Variant(hp.PLAIN, "patched", 0, 1), hp.Variant("patched-k15", "patched", 15, 1)]
    lines, problems = tp.load_section(chosen, {hp.PLAIN: plain, "patched-k15": fixed})
    assert problems == [], lines
    assert "| patched-k15 | pass | 2 | - | prompt 1 @ 1: 0.0625 |" in lines
    assert "one at a time and at once 0.0625" in lines[1]
    # A step more than the noise still fails.
    drafted[1] = completion([4, 22, 6], 1, {"22": -0.9, "24": -1.0})
    at_once[1] = completion([4, 24, 6], 1, {"24": -0.9, "22": -1.0})
    lines, problems = tp.load_section(chosen, {hp.PLAIN: plain, "patched-k15": fixed})
    assert problems == ["patched-k15: not lossless with 16 requests at once"]


def test_under_load_a_plain_engine_that_moves_too_far_on_its_own_gives_no_verdict(
    tmp_path: Path,
) -> None:
    # Its two batch shapes part where each run's margin is 0.5: an excuse of 1.0 would pass
    # almost any difference, so there is no verdict, and the run fails.
    text, ok = _run(tmp_path, plain_at_once=[OUTPUTS[0], [5, 6, 7, 77]], plain_ties={3: 0.5})
    assert not ok
    assert "part at a margin of 1.0000, over 0.2500: no verdict" in text


def test_under_load_without_the_plain_engines_logprobs_there_is_no_verdict() -> None:
    plain = {"ok": True, "acceptance": {"1": {"outputs": OUTPUTS}, "16": {"outputs": OUTPUTS}}}
    lines, problems = tp.load_section([hp.Variant(hp.PLAIN, "patched", 0, 1)], {hp.PLAIN: plain})
    assert problems == ["lossless under load: no plain outputs with logprobs to compare with"]
    assert problems[0] in lines


def test_an_engine_that_did_not_run_is_no_pass(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    work = tmp_path / "work"
    hp.plan(pair, work)
    text, ok = tp.report(pair, work)
    assert not ok and "error: no result" in text


def test_trained_hybrid_names_the_installs_it_lacks_before_training(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tooling.cli import main
    from tooling.errors import SmokeError

    patched = tmp_path / "patched"
    (patched / "vllm").mkdir(parents=True)
    (patched / "vllm" / "__init__.py").write_text("")
    result = CliRunner().invoke(
        main,
        [
            "smoke",
            "--trained-hybrid",
            "--engine",
            f"patched={patched}",
            "--workdir",
            str(tmp_path / "work"),
        ],
    )
    assert result.exit_code == SmokeError.exit_code
    missing = ", ".join(sorted(s for s in hp.SITES if s != "patched"))
    assert result.stderr == f"error: --trained-hybrid needs --engine NAME=DIR for {missing}\n"
    # Refused before any training: nothing was written but the work folder.
    assert [p.name for p in (tmp_path / "work").iterdir()] == []


def test_a_call_on_a_host_names_the_installs_its_engines_folder_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tooling.errors import SmokeError
    from tooling.trained import measure as trained

    root = tmp_path / "engines"
    for site in ("patched", "stock", f"no-{hp.ABLATED[0]}"):
        (root / site).mkdir(parents=True)
    pair = _pair(tmp_path)
    work = tmp_path / "work"
    code = trained.main(["run-call", str(pair), str(work), "1", "--engines-root", str(root)])
    assert code == SmokeError.exit_code
    # Only the installs call 1's engines serve are named (the pair has one K here, so
    # call 1 also serves the ablations).
    have = {"patched", "stock", f"no-{hp.ABLATED[0]}"}
    served = {v.site for v in hp.chosen_variants(pair) if v.call == 1}
    lacking = ", ".join(sorted(served - have))
    assert f"no-{hp.STATE_FIX}" in lacking
    assert capsys.readouterr().err == f"error: {root} lacks {lacking}\n"
    assert not work.exists()
    # A call of only the engines the folder has runs: its plan is written.
    only = ["--only", f"plain,patched-k{K},patched-k{K}-replay", "--time-limit", "1"]
    trained.main(["run-call", str(pair), str(work), "1", "--engines-root", str(root), *only])
    assert "error" not in capsys.readouterr().err.split("\n")[0]
    assert (work / f"patched-k{K}-replay.in.json").is_file()


def test_the_host_chain_fails_when_a_call_fails(tmp_path: Path) -> None:
    # ci/gpu/trained-hybrid.sh chain, as a GPU session runs it, on a pair whose calls cannot
    # run here (no engine installs): each call's report fails, so the chain does too.
    work = tmp_path / "work"
    work.mkdir()
    _pair(tmp_path).rename(work / "hybrid-pair")
    done = run_gpu_script("trained-hybrid.sh", "chain", work=work)
    assert done.returncode != 0, done.stdout
    # No engines folder at all: each call names the installs its own engines serve, in one
    # line, and the calls together name every install.
    prefix = f"error: {work / 'engines'} lacks "
    lines = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == done.stdout.count(": done in ") >= 2
    named = {site for line in lines for site in line.removeprefix(prefix).split(", ")}
    assert named == set(hp.SITES)
    assert "Traceback" not in done.stderr


def test_the_steady_speed_is_the_median_pass_so_a_pass_still_compiling_does_not_move_it() -> None:
    # At one request on the trained pair the DFlash engine's second pass (0.317 s) still
    # compiled for shapes of its own; the passes after it took 0.205 s.
    def passes(first: float, *steady: float) -> list[dict]:
        return [{"seconds": s, "tokens": 128, "most_running": 1} for s in (first, *steady)]

    plain = {"speed": {"1": passes(3.89, 0.527, 0.522, 0.524, 0.530, 0.525)}}
    drafted = {"speed": {"1": passes(4.64, 0.317, 0.205, 0.206, 0.204, 0.205)}}
    (row,) = hv.speed_rows(plain, drafted)
    assert (row.plain_steady_s, row.drafted_steady_s) == (0.525, 0.205)
    assert row.ratio == pytest.approx(0.525 / 0.205)
    assert (row.plain_first_s, row.drafted_first_s) == (3.89, 4.64)
    # Two steady passes (an earlier run's) give their mean, as before.
    (row,) = hv.speed_rows(plain, {"speed": {"1": passes(4.64, 0.317, 0.205)}})
    assert row.drafted_steady_s == pytest.approx(0.261)


def test_a_plan_of_some_engines_writes_only_them_and_refuses_a_name_it_lacks(
    tmp_path: Path,
) -> None:
    from tooling.errors import SmokeError

    only = ("plain", f"patched-k{K}")
    pair = _pair(tmp_path)
    chosen = hp.plan(pair, tmp_path / "work", only)
    assert tuple(v.name for v in chosen) == only
    assert [v.name for v in hp.load_variants(tmp_path / "work")] == list(only)
    assert sorted(p.name for p in (tmp_path / "work").glob("*.in.json")) == sorted(
        f"{n}.in.json" for n in only
    )
    with pytest.raises(SmokeError, match="no engine nowhere in the plan"):
        hp.plan(pair, tmp_path / "again", ("plain", "nowhere"))
