"""The smoke's verdicts on stock-like and fixed-like observations, and the report around them.

The observations are the ones measured on an H200 (upstream-notes section 7):
stock 0.20.1 captures (1, 3, 5), runs every drafter layer full, serves 176 of
200 tokens from the cache and agrees with the reference on 49% of drafts; the
fixed build (2, 4, 6), windows 16/16/full, 192 tokens, 99.8%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import SmokeError
from tooling.paths import REPO_DIR
from tooling.smoke import checks
from tooling.smoke.checks import PrefixObservation
from tooling.smoke.client import Completion, parse_completion
from tooling.smoke.config import LOSSLESS_PROMPTS, SmokeConfig, drafter_info_from_config
from tooling.smoke.distribution import FLOOR, Report, build_report
from tooling.smoke.distribution_plan import smoke_variants
from tooling.smoke.metrics import SpecDecodeStats
from tooling.smoke.observe import ServerObservations
from tooling.smoke.report import SmokeReport, StepRecord, format_table
from tooling.smoke.serving.agreement import Tally
from tooling.smoke.verdicts import evaluate

TINY_DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 16,
    "use_sliding_window": True,
    "max_window_layers": 3,
    "num_target_layers": 8,
    "block_size": 4,
    "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 2047, "block_size": 4},
}
STOCK_WINDOWS = [
    {"layer": f"model.layers.{i}.self_attn.attn", "window": [-1, -1]} for i in range(3)
]
FIXED_WINDOWS = [
    {"layer": "model.layers.0.self_attn.attn", "window": [15, 0]},
    {"layer": "model.layers.1.self_attn.attn", "window": [15, 0]},
    {"layer": "model.layers.2.self_attn.attn", "window": [-1, -1]},
]


def test_drafter_expectations_from_its_config() -> None:
    info = drafter_info_from_config(TINY_DRAFTER_CONFIG)
    assert info.expected_aux_layers() == (2, 4, 6)
    assert info.expected_windows() == [(15, 0), (15, 0), (-1, -1)]
    assert info.mask_token_id == 2047
    assert info.has_sliding_layers()


def test_window_dropped_without_use_sliding_window_as_transformers_does() -> None:
    info = drafter_info_from_config({**TINY_DRAFTER_CONFIG, "use_sliding_window": False})
    assert info.sliding_window is None
    assert info.expected_windows() == [(-1, -1)] * 3
    assert not info.has_sliding_layers()


def test_drafter_without_target_layer_ids() -> None:
    config = {k: v for k, v in TINY_DRAFTER_CONFIG.items() if k != "dflash_config"}
    info = drafter_info_from_config(config)
    assert info.expected_aux_layers() is None
    assert checks.check_aux_layers((1, 3, 5), None, "log").status == checks.ERROR


def test_aux_layers_verdicts() -> None:
    expected = (2, 4, 6)
    stock = checks.check_aux_layers((1, 3, 5), expected, "serve.log")
    assert stock.status == checks.FAIL
    assert "fix 1 absent" in stock.evidence
    fixed = checks.check_aux_layers((2, 4, 6), expected, "serve.log")
    assert fixed.status == checks.PASS
    missing = checks.check_aux_layers(None, expected, "serve.log")
    assert missing.status == checks.ERROR
    assert "serve.log" in missing.evidence


def test_window_verdicts() -> None:
    expected = drafter_info_from_config(TINY_DRAFTER_CONFIG).expected_windows()
    assert checks.check_windows(STOCK_WINDOWS, expected).status == checks.FAIL
    fixed = checks.check_windows(FIXED_WINDOWS, expected)
    assert fixed.status == checks.PASS
    assert "(15, 0), (15, 0), (-1, -1)" in fixed.evidence
    assert checks.check_windows(FIXED_WINDOWS[:2], expected).status == checks.FAIL


def test_full_block_tokens() -> None:
    assert checks.full_block_tokens(200, 16) == 192
    assert checks.full_block_tokens(193, 16) == 192
    assert checks.full_block_tokens(192, 16) == 176  # the last token is always computed
    assert checks.full_block_tokens(16, 16) == 0


def test_prefix_cache_verdicts() -> None:
    plain = PrefixObservation(prompt_tokens=200, hits=192, queries=200, cached_tokens=192)
    stock = PrefixObservation(prompt_tokens=200, hits=176, queries=200, cached_tokens=176)
    fixed = PrefixObservation(prompt_tokens=200, hits=192, queries=200, cached_tokens=192)
    failed = checks.check_prefix_cache(stock, plain, block_size=16)
    assert failed.status == checks.FAIL
    assert "176 tokens from the cache" in failed.evidence
    assert "fix 3 absent" in failed.evidence
    assert checks.check_prefix_cache(fixed, plain, block_size=16).status == checks.PASS
    # Without the control the expectation still comes from the block arithmetic.
    assert checks.check_prefix_cache(fixed, None, block_size=16).status == checks.PASS
    # A control that does not cache fully means the setup, not the fix, is broken.
    broken = checks.check_prefix_cache(fixed, stock, block_size=16)
    assert broken.status == checks.ERROR


def test_prefix_prompt_fills_two_of_the_engines_blocks() -> None:
    # Configured 16-token blocks (the engine states none): the 200-token prompt as ever.
    assert checks.prefix_prompt_tokens(None, 1024) == 200
    assert checks.prefix_prompt_tokens(16, 1024) == 200
    # The seed-shaped pair's engines: 400-token blocks without the drafter, 480 with it.
    assert checks.prefix_prompt_tokens(400, 1024) == 816
    assert checks.prefix_prompt_tokens(480, 1024) == 976
    assert checks.full_block_tokens(976, 480) == 960
    assert checks.full_block_tokens(816, 400) == 800
    # A max_model_len that cannot hold the prompt and its answer says so with the figures.
    with pytest.raises(SmokeError) as caught:
        checks.prefix_prompt_tokens(480, 512)
    assert str(caught.value) == (
        "the repeated prompt needs two 480-token blocks and a 16-token tail (976 tokens) and "
        "8 to generate: more than max_model_len 512"
    )
    with pytest.raises(SmokeError, match="1040 tokens"):
        checks.prefix_prompt_tokens(512, 1024)


def _hybrid_prefix(tokens: int, hits: int, block: int) -> PrefixObservation:
    return PrefixObservation(
        prompt_tokens=tokens, hits=hits, queries=tokens, cached_tokens=hits, block_size=block
    )


def test_prefix_cache_on_a_hybrid_target_uses_each_engines_blocks() -> None:
    plain = _hybrid_prefix(816, 800, 400)
    fixed = checks.check_prefix_cache(_hybrid_prefix(976, 960, 480), plain, block_size=None)
    assert fixed.status == checks.PASS
    assert fixed.evidence == (
        "repeated 976-token prompt: 960 tokens from the cache with DFlash (full 480-token "
        "blocks: 960); 800 of a 816-token prompt without speculation (full 400-token blocks: "
        "800)"
    )
    dropped = checks.check_prefix_cache(_hybrid_prefix(976, 480, 480), plain, block_size=None)
    assert dropped.status == checks.FAIL
    assert "one block dropped: fix 3 absent" in dropped.evidence
    nothing = checks.check_prefix_cache(_hybrid_prefix(976, 0, 480), plain, block_size=None)
    assert nothing.status == checks.FAIL
    # A control that reuses less than its full blocks: the setup is at fault, not the fix.
    broken = checks.check_prefix_cache(
        _hybrid_prefix(976, 960, 480), _hybrid_prefix(816, 400, 400), block_size=None
    )
    assert broken.status == checks.ERROR
    assert "cached 400 of 816 tokens, expected 800" in broken.evidence
    # The 200-token prompt on 480-token blocks (the run before the prompt was sized):
    # no block to reuse, so no verdict either way.
    short = checks.check_prefix_cache(
        _hybrid_prefix(200, 0, 480), _hybrid_prefix(200, 0, 400), block_size=None
    )
    assert short.status == checks.ERROR
    assert short.evidence == "the repeated 200-token prompt fills no 480-token block: cannot judge"
    # Neither engine stated its blocks: the control's reuse is the expectation.
    unknown = PrefixObservation(prompt_tokens=200, hits=192, queries=200, cached_tokens=192)
    assert checks.check_prefix_cache(unknown, unknown, block_size=None).status == checks.PASS
    none = PrefixObservation(prompt_tokens=200, hits=0, queries=200, cached_tokens=0)
    assert checks.check_prefix_cache(unknown, none, block_size=None).evidence == (
        "no control reuse to compare with (hybrid target)"
    )


def _completion(ids: list[int]) -> Completion:
    return Completion(
        text="x", token_ids=tuple(ids), prompt_tokens=5, cached_tokens=0, finish_reason="length"
    )


def test_lossless_verdicts() -> None:
    prompts = ["a", "b"]
    same = [_completion([1, 2, 3]), _completion([4, 5, 6])]
    assert checks.check_lossless(same, list(same), prompts).status == checks.PASS
    other = [_completion([1, 2, 3]), _completion([4, 9, 6])]
    result = checks.check_lossless(same, other, prompts)
    assert result.status == checks.FAIL
    assert "prompt 1 at token 1" in result.evidence
    assert checks.check_lossless(same[:1], other, prompts).status == checks.ERROR


def test_lossless_differences_at_the_targets_ties_are_not_lost_tokens() -> None:
    prompts = ["a", "b", "c"]
    same = [_completion([1, 2, 3]), _completion([4, 5, 6]), _completion([7, 8, 9])]
    other = [_completion([1, 2, 3]), _completion([4, 9, 6]), _completion([7, 8, 1])]
    assert [d["first_difference"] for d in checks.first_differences(same, other)] == [1, 2]
    ties = [
        {"spec_gap": 0.0, "plain_gap": 0.0, "argmax": 5, "spread": 0.9},
        {"spec_gap": 0.0039, "plain_gap": 0.0, "argmax": 1, "spread": 0.7},
    ]
    result = checks.check_lossless(same, other, prompts, margins=ties, tolerance=2**-7)
    assert result.status == checks.PASS
    assert result.evidence.startswith(
        "2/3 greedy completions differ with the drafter, each at a tie"
    )
    assert (
        "the drafter's tokens within 0.0000, 0.0039, the plain run's within 0.0000, 0.0000 "
        "of its best"
    ) in result.evidence
    assert "the logits' spread there 0.70 or more" in result.evidence
    # The default tolerance: the first differences measured on an H200 pass it.
    measured = [{"spec_gap": 0.0, "plain_gap": g, "argmax": 1} for g in (0.0156, 0.0234)]
    default = SmokeConfig(workdir=Path("w"), tiny=True).lossless_tie_tolerance
    assert checks.check_lossless(same, other, prompts, measured, default).status == checks.PASS
    # The drafter's run emitting a token the target would not: a lost token.
    lost = [ties[0], {"spec_gap": 0.5, "plain_gap": 0.0, "argmax": 9}]
    untied = checks.check_lossless(same, other, prompts, lost, 2**-7)
    assert untied.status == checks.FAIL
    assert untied.evidence.startswith(
        "2/3 greedy completions differ with the drafter, 1 where the drafter's token is past "
        "the tie (prompt 2 at token 2)"
    )
    assert untied.details["lost"] == [2]
    # The plain run off the target's best where the drafter's is on it: named, no loss.
    plain_off = [ties[0], {"spec_gap": 0.0, "plain_gap": 0.5, "argmax": 9}]
    named = checks.check_lossless(same, other, prompts, plain_off, 2**-7)
    assert named.status == checks.PASS
    assert named.evidence.startswith(
        "2/3 greedy completions differ with the drafter, the drafter's token at a tie of the "
        "target's logits at each, and 1 where the plain run's is the one past it "
        "(prompt 2 at token 2)"
    )
    assert named.details["plain_past_tie"] == [2]
    # Without the reference's margins a difference stays a failure, and says why.
    unknown = checks.check_lossless(same, other, prompts, None, 2**-7)
    assert unknown.status == checks.FAIL
    assert "margins there unknown" in unknown.evidence


# The seed-shaped pair on an H200 (64 hybrid layers, K = 15): the six first differences'
# margins the reference measured, and the noise check 10 measured between two plain runs.
SEED_MARGINS = [
    {"spec_gap": 0.0, "plain_gap": 0.015625, "argmax": 161203, "spread": 0.45205777883529663},
    {"spec_gap": 0.015625, "plain_gap": 0.0, "argmax": 151206, "spread": 0.45193544030189514},
    {"spec_gap": 0.046875, "plain_gap": 0.0, "argmax": 61146, "spread": 0.45284631848335266},
    {"spec_gap": 0.0, "plain_gap": 0.0234375, "argmax": 48362, "spread": 0.45125842094421387},
    {"spec_gap": 0.0390625, "plain_gap": 0.0234375, "argmax": 20705, "spread": 0.4524983167},
    {"spec_gap": 0.0390625, "plain_gap": 0.0, "argmax": 164, "spread": 0.4529608488082886},
]
SEED_NOISE = 0.04682159423828125


def _seed_like() -> tuple[list[Completion], list[Completion], list[str]]:
    spec = [_completion([p, 1, 2, 3]) for p in range(6)]
    plain = [_completion([p, 1, 9, 3]) for p in range(6)]
    return spec, plain, [str(p) for p in range(6)]


def test_lossless_tie_tolerance_is_over_the_measured_plain_noise_where_larger() -> None:
    spec, plain, prompts = _seed_like()
    floor = SmokeConfig(workdir=Path("w"), tiny=True).lossless_tie_tolerance
    # With the fixed floor alone the seed-shaped pair failed: 0.0469 and 0.0391 > 2^-5.
    alone = checks.check_lossless(spec, plain, prompts, SEED_MARGINS, floor)
    assert alone.status == checks.FAIL
    assert "(tie tolerance 0.0312 = the floor, plain noise not measured;" in alone.evidence
    # Two plain runs differ by up to 0.0468 there: every margin is within that, and
    # check 10's headroom over it.
    measured = checks.check_lossless(spec, plain, prompts, SEED_MARGINS, floor, SEED_NOISE)
    assert measured.status == checks.PASS
    assert (
        "the drafter's tokens within 0.0000, 0.0156, 0.0469, 0.0000, 0.0391, 0.0391, the "
        "plain run's within 0.0156, 0.0000, 0.0000, 0.0234, 0.0234, 0.0000 of its best "
        "(tie tolerance 0.0946 = 2 x the measured plain noise 0.0468 + 0.0010 rounding, "
        "floor 0.0312; the logits' spread there 0.45 or more)"
    ) in measured.evidence
    assert measured.details["tie_tolerance"]["source"] == "measured plain noise"
    assert measured.details["tie_tolerance"]["noise"] == SEED_NOISE
    # A lost token is a draw from the logits' spread: far above the noise, it fails.
    lost = [*SEED_MARGINS[:5], {"spec_gap": 0.3125, "plain_gap": 0.0, "argmax": 7, "spread": 0.45}]
    assert checks.check_lossless(spec, plain, prompts, lost, floor, SEED_NOISE).status == (
        checks.FAIL
    )
    # One bf16 step past the headroom over the noise is not a tie either.
    past = [{**m, "spec_gap": 2 * SEED_NOISE + 2**-6} for m in SEED_MARGINS]
    assert checks.check_lossless(spec, plain, prompts, past, floor, SEED_NOISE).status == (
        checks.FAIL
    )
    # Noise under half the floor (the 8-layer tiny pair's) leaves the floor.
    quiet = checks.check_lossless(spec, plain, prompts, SEED_MARGINS, floor, 2**-7)
    assert quiet.status == checks.FAIL
    assert "tie tolerance 0.0312 = the floor, measured plain noise 0.0078" in quiet.evidence
    assert quiet.details["tie_tolerance"]["source"] == "floor"
    # A plain first-token run that failed reports NaN noise: not measured.
    failed = checks.check_lossless(spec, plain, prompts, SEED_MARGINS, floor, float("nan"))
    assert failed.status == checks.FAIL
    assert failed.details["tie_tolerance"]["noise"] is None


# The seed-shaped pair at the seed's width (5120) on an H200: the reference's margins at
# the six first differences, and the first-token noise check 10 measured in that run.
WIDE_MARGINS = [
    {"spec_gap": 0.0, "plain_gap": 0.15625, "argmax": 5973, "spread": 1.4301},
    {"spec_gap": 0.125, "plain_gap": 0.15625, "argmax": 185638, "spread": 1.4321},
    {"spec_gap": 0.25, "plain_gap": 0.0, "argmax": 103907, "spread": 1.4266},
    {"spec_gap": 0.21875, "plain_gap": 0.0, "argmax": 100680, "spread": 1.4323},
    {"spec_gap": 0.0, "plain_gap": 0.53125, "argmax": 8226, "spread": 1.4327},
    {"spec_gap": 0.0, "plain_gap": 0.21875, "argmax": 24202, "spread": 1.4289},
]
WIDE_NOISE = 0.18705511093139648


def test_lossless_at_the_seeds_width_judges_the_drafters_token() -> None:
    # The first differences where that run's were: prompt 4 at token 5.
    spec = [_completion([p] + [1] * 10) for p in range(6)]
    plain = [
        _completion([p] + [1] * (at - 1) + [9] * (11 - at))
        for p, at in enumerate((2, 2, 3, 8, 5, 2))
    ]
    prompts = [str(p) for p in range(6)]
    floor = SmokeConfig(workdir=Path("w"), tiny=True).lossless_tie_tolerance
    result = checks.check_lossless(spec, plain, prompts, WIDE_MARGINS, floor, WIDE_NOISE)
    # The plain run's token at prompt 4 is 0.53 below the target's best, past the 0.3751
    # tie; the drafter's run took the best there: no token of the drafter's is lost.
    assert result.status == checks.PASS
    assert result.evidence.startswith(
        "6/6 greedy completions differ with the drafter, the drafter's token at a tie of the "
        "target's logits at each, and 1 where the plain run's is the one past it "
        "(prompt 4 at token 5)"
    )
    assert "tie tolerance 0.3751 = 2 x the measured plain noise 0.1871" in result.evidence
    # The same gap on the drafter's side is a lost token.
    swapped = [
        *WIDE_MARGINS[:4],
        {**WIDE_MARGINS[4], "spec_gap": 0.53125, "plain_gap": 0.0},
        WIDE_MARGINS[5],
    ]
    lost = checks.check_lossless(spec, plain, prompts, swapped, floor, WIDE_NOISE)
    assert lost.status == checks.FAIL
    assert lost.details["lost"] == [4]


def _one_verdict(
    tmp_path: Path,
    check: str,
    fidelity: dict,
    first_tokens: Report | None,
    spec: ServerObservations | None = None,
    plain: ServerObservations | None = None,
) -> checks.CheckResult:
    """``evaluate``'s verdict on ``check`` alone, from what a run's steps observed."""
    results = evaluate(
        config=SmokeConfig(workdir=tmp_path, tiny=True),
        planned={c: "run" if c == check else "not asked" for c in checks.ORDER},
        info=None,
        info_error="",
        spec=spec,
        plain=plain,
        engine_result=None,
        engine_error="",
        fidelity=fidelity,
        fidelity_error="",
        first_tokens=first_tokens,
        block_size=None,
    )
    return next(r for r in results if r.id == check)


def test_evaluate_hands_check_10s_noise_to_check_1(tmp_path) -> None:
    spec_completions, plain_completions, _ = _seed_like()
    assert len(LOSSLESS_PROMPTS) == len(spec_completions)
    spec = ServerObservations(log=tmp_path / "s.log", completions=spec_completions)
    plain = ServerObservations(log=tmp_path / "p.log", completions=plain_completions)

    def lossless(first_tokens: Report | None) -> checks.CheckResult:
        fidelity = {"divergences": SEED_MARGINS}
        return _one_verdict(tmp_path, checks.LOSSLESS, fidelity, first_tokens, spec, plain)

    assert lossless(Report(tolerance=SEED_NOISE, noise=SEED_NOISE)).status == checks.PASS
    assert lossless(None).status == checks.FAIL
    assert lossless(Report(tolerance=FLOOR, noise=float("nan"))).status == checks.FAIL


def test_fidelity_gate() -> None:
    stock = {"ok": True, "agreement": 0.492, "compared_tokens": 480, "per_position": [0.6, 0.5]}
    fixed = {"ok": True, "agreement": 0.998, "compared_tokens": 480, "per_position": [0.99, 1.0]}
    assert checks.check_fidelity(stock, 0.99).status == checks.FAIL
    result = checks.check_fidelity(fixed, 0.99)
    assert result.status == checks.PASS
    assert "99.8% of 480 draft tokens" in result.evidence
    empty = {"ok": True, "agreement": None, "compared_tokens": 0}
    assert checks.check_fidelity(empty, 0.99).status == checks.ERROR


def test_fidelity_gates_every_group_on_its_tie_tolerant_figure() -> None:
    # The H200 run of 2026-11-30: 99.9% overall, but the sequential group's exact
    # figure was 98.3% (exact ties in bf16); gated, it is what counts.
    result = {
        "agreement": 0.999,
        "compared_tokens": 5229,
        "group_agreement": {"sequential": 1.0, "concurrent": 0.999},
        "group_exact_agreement": {"sequential": 0.983, "concurrent": 0.982},
    }
    verdict = checks.check_fidelity(result, 0.99)
    assert verdict.status == checks.PASS
    assert "sequential 100.0% (exact 98.3%)" in verdict.evidence
    low = {**result, "group_agreement": {"sequential": 1.0, "concurrent": 0.985}}
    verdict = checks.check_fidelity(low, 0.99)
    assert verdict.status == checks.FAIL
    assert "concurrent 98.5% (exact 98.2%)" in verdict.evidence


def test_acceptance_is_informational_unless_gated() -> None:
    stats = SpecDecodeStats(6, 18, 7, [4.0, 2.0, 1.0])
    info = checks.check_acceptance(stats, None)
    assert info.status == checks.INFO
    assert "acceptance length 2.167" in info.evidence
    assert checks.check_acceptance(stats, 1.5).status == checks.PASS
    assert checks.check_acceptance(stats, 3.0).status == checks.FAIL
    assert checks.check_acceptance(None, None).status == checks.ERROR
    assert checks.check_acceptance(SpecDecodeStats(0, 0, 0, []), None).status == checks.ERROR


def test_completion_answer_parsing() -> None:
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": " lazy",
                "finish_reason": "length",
                "token_ids": [11, 12],
                "prompt_token_ids": None,
            }
        ],
        "usage": {
            "prompt_tokens": 200,
            "completion_tokens": 2,
            "total_tokens": 202,
            "prompt_tokens_details": {"cached_tokens": 192},
        },
    }
    parsed = parse_completion(answer)
    assert parsed == Completion(" lazy", (11, 12), 200, 192, "length")
    no_details = {**answer, "usage": {"prompt_tokens": 3}}
    assert parse_completion(no_details).cached_tokens is None
    with pytest.raises(SmokeError, match="unexpected"):
        parse_completion({"error": "bad"})


def test_config_rejects_contradictory_model_choices(tmp_path: Path) -> None:
    with pytest.raises(SmokeError, match="--tiny"):
        SmokeConfig(workdir=tmp_path, tiny=True, target="t", drafter="d").validate()
    with pytest.raises(SmokeError, match="both --target and --drafter"):
        SmokeConfig(workdir=tmp_path, target="t").validate()
    SmokeConfig(workdir=tmp_path, tiny=True).validate()


def _report(tmp_path: Path, results: list[checks.CheckResult]) -> SmokeReport:
    return SmokeReport(
        checks=results,
        steps=[StepRecord("serve with DFlash", 61.2, True), StepRecord("reference", 9.0, False)],
        workdir=tmp_path,
        models={"target": "t", "drafter": "d", "tiny": True},
        engine={"num_speculative_tokens": 3},
        vllm={"version": "0.20.1", "location": "/opt/bundle/vllm"},
    )


def test_report_table_and_json(tmp_path: Path) -> None:
    results = [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "6/6 identical"),
        checks.check_aux_layers((1, 3, 5), (2, 4, 6), "serve.log"),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "acceptance length 1.000"),
    ]
    report = _report(tmp_path, results)
    assert not report.passed
    assert report.summary_line().startswith("smoke failed: 2 aux_layers (fail)")
    table = format_table(report)
    assert "vLLM 0.20.1 at /opt/bundle/vllm" in table
    assert " 2  fix 1: aux layers = target_layer_ids + 1" in table
    assert "FAIL" in table and "reference 9s FAILED" in table
    path = report.write_json()
    data = json.loads(path.read_text())
    assert data["passed"] is False
    assert [c["number"] for c in data["checks"]] == [1, 2, 6]
    assert data["checks"][1]["details"]["observed"] == [1, 3, 5]
    assert not list(tmp_path.glob(".*.part"))  # nothing half-written left


def test_report_passes_with_info_and_skips(tmp_path: Path) -> None:
    results = [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "ok"),
        checks.skipped(checks.FIDELITY, "skipped (--no-fidelity)"),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "length 1.0"),
    ]
    report = _report(tmp_path, results)
    assert report.passed
    assert "skipped 5" in report.summary_line()


def test_acceptance_plot_is_a_png(tmp_path: Path) -> None:
    out = tmp_path / "acceptance.png"
    code = (
        "import sys; from pathlib import Path; from tooling.smoke.report import plot_acceptance; "
        "print(plot_acceptance([0.31, 0.089, 0.015], Path(sys.argv[1]), 'DFlash'))"
    )
    # matplotlib is a dev dependency: the toolchain plots when it is installed.
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 2000


def _stock_like() -> list[checks.CheckResult]:
    expected = drafter_info_from_config(TINY_DRAFTER_CONFIG)
    plain = PrefixObservation(prompt_tokens=200, hits=192, queries=200, cached_tokens=192)
    stock = PrefixObservation(prompt_tokens=200, hits=176, queries=200, cached_tokens=176)
    return [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "6/6 identical"),
        checks.check_aux_layers((1, 3, 5), expected.expected_aux_layers(), "log"),
        checks.check_windows(STOCK_WINDOWS, expected.expected_windows()),
        checks.check_prefix_cache(stock, plain, block_size=16),
        checks.check_fidelity({"agreement": 0.492, "compared_tokens": 480}, 0.99),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "length 1.0"),
    ]


def test_expect_stock_is_a_negative_control(tmp_path: Path) -> None:
    stock = _report(tmp_path, _stock_like())
    assert not stock.passed  # as a fixed build it fails ...
    stock.expect = "stock"
    assert stock.passed  # ... and it is exactly what stock vLLM does
    line = stock.summary_line()
    assert line.startswith("smoke behaved as stock vLLM: failed 2 aux_layers, 3 drafter_windows,")
    assert "; output lossless" in line
    # A quick run on a hybrid target: lossless skipped, the K+1 first tokens wrong. The line
    # names those failures and claims nothing of the lossless check that did not run.
    quick = [c for c in _stock_like() if c.id != checks.LOSSLESS]
    quick.append(checks.CheckResult(checks.LOSSLESS, checks.SKIP, "not in --quick"))
    quick.append(checks.CheckResult(checks.FIRST_TOKENS, checks.FAIL, "3 of 4 prompts off"))
    hybrid = _report(tmp_path, quick)
    hybrid.models["target_info"] = {"hybrid": True}
    hybrid.expect = "stock"
    assert hybrid.passed
    assert "10 first_tokens" in hybrid.summary_line()
    assert "output lossless" not in hybrid.summary_line()
    fixed_like = _stock_like()
    fixed_like[1] = checks.check_aux_layers((2, 4, 6), (2, 4, 6), "log")
    mixed = _report(tmp_path, fixed_like)
    mixed.expect = "stock"
    assert not mixed.passed
    assert "2 aux_layers (pass)" in mixed.summary_line()
    with pytest.raises(SmokeError, match="--expect"):
        SmokeConfig(workdir=tmp_path, tiny=True, expect="patched").validate()


def test_lossless_divergences_place_each_first_difference_for_the_reference(tmp_path) -> None:
    from tooling.smoke.observe import ServerObservations
    from tooling.smoke.verdicts import lossless_divergences

    spec = ServerObservations(log=tmp_path / "s.log")
    plain = ServerObservations(log=tmp_path / "p.log")
    spec.completions = [_completion([1, 2, 3]), _completion([4, 5, 6])]
    plain.completions = [_completion([1, 2, 3]), _completion([4, 9, 6])]
    spec.prompt_ids = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
    assert lossless_divergences(spec, plain) == [
        {"context": [21, 22, 23, 24, 25, 4], "tokens": [5, 9]}
    ]
    # Ids that are not what the server counted cannot place a difference.
    spec.prompt_ids = [[11, 12, 13, 14, 15], [21, 22]]
    assert lossless_divergences(spec, plain) == []
    spec.prompt_ids = None
    assert lossless_divergences(spec, plain) == []


FIDELITY_5120 = Path(__file__).parent / "data" / "fidelity-5120"


def _recorded_tally(path: Path) -> Tally:
    """One reference shard's counts as an H200 recorded them at the seed's width (the
    in-process engine's proposals for prompts 0-3, 2400 draft tokens in two shards). That
    recording kept each mismatch's margin without its draft position; the positions are
    filled in from the per-position mismatch counts it kept, which leaves every figure
    this file asserts (overall and per group: every proposal was sequential) exact."""
    data = json.loads(path.read_text(encoding="utf-8"))["tally"]
    assert set(data["groups"]) == {"sequential"}
    exact = data["exact"]
    open_slots = [t - m for m, t in zip(exact["matches"], exact["totals"], strict=True)]
    mismatches = []
    for margin in data["margins"]:
        position = next(i for i, n in enumerate(open_slots) if n > 0)
        open_slots[position] -= 1
        mismatches.append(["sequential", position, margin])
    converted = {
        **{k: v for k, v in data.items() if k not in ("tolerant", "margins", "groups")},
        "groups": {"sequential": data["groups"]["sequential"]["exact"]},
        "mismatches": mismatches,
    }
    return Tally.from_json(converted)


def test_at_the_seeds_width_fidelity_is_gated_at_the_noise_the_run_measured(tmp_path) -> None:
    """At width 5120 the drafter's logits sit where one bf16 step is 2^-5: vLLM's drafts and
    the reference's trade places at ties of one to four such steps, past the 2^-7 floor
    sized for the narrow pairs. Gated at twice the plain noise the same run measured (check
    10), as check 1 is, the fixed wheel passes; drafts off by the logits' spread do not."""
    result = Tally.merged([_recorded_tally(p) for p in sorted(FIDELITY_5120.glob("shard-*"))])
    counts = result.result()
    assert counts["compared_tokens"] == 2400 and counts["mismatches"] == 129
    assert max(m for _, _, m in counts["mismatch_detail"]) == 0.125
    first_tokens = build_report(
        {p.stem: json.loads(p.read_text()) for p in (FIDELITY_5120 / "first-tokens").glob("*")},
        smoke_variants(15, 4.0, 4.0),
    )
    assert first_tokens.noise == pytest.approx(0.1251, abs=1e-4)

    def fidelity(tally: dict, report: Report | None) -> checks.CheckResult:
        return _one_verdict(tmp_path, checks.FIDELITY, tally, report)

    at_floor = fidelity(counts, None)
    assert at_floor.status == checks.FAIL
    assert at_floor.details["agreement"] == pytest.approx(0.96375)
    measured = fidelity(counts, first_tokens)
    assert measured.status == checks.PASS, measured.evidence
    assert measured.details["agreement"] == 1.0
    assert measured.details["tie_tolerance"]["source"] == "measured plain noise"
    assert "2 x the measured plain noise 0.1251" in measured.evidence
    # The same run with each mismatch as far below the reference's best as the logits'
    # spread puts a wrong drafter's token (a wrong layer, a wrong window).
    off = {**counts, "mismatch_detail": [[g, p, m + 1.0] for g, p, m in counts["mismatch_detail"]]}
    assert fidelity(off, first_tokens).status == checks.FAIL
