"""The trained hybrid pair's GPU verdicts, judged on results of the engine side's own shape
(that side needs a GPU): each check is shown able to fail, so that its pass on a GPU means
something."""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.trained import hybrid as tp
from tooling.trained import hybrid_plan as hp
from tooling.trained import hybrid_verdicts as hv

from .trained_pair_helpers import LOSSLESS, OUTPUTS, K, _completion, _pair, _run


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


def test_an_engine_that_did_not_run_is_no_pass(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    work = tmp_path / "work"
    hp.plan(pair, work)
    text, ok = tp.report(pair, work)
    assert not ok and "error: no result" in text


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
