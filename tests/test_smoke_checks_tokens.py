"""Verdicts on the tokens: lossless output (check 1) and the drafter's agreement with the
reference (check 5), each forgiving ties only within the noise a run measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.smoke import checks
from tooling.smoke.client import Completion
from tooling.smoke.config import LOSSLESS_PROMPTS, SmokeConfig
from tooling.smoke.distribution import FLOOR, Report, build_report
from tooling.smoke.distribution_plan import smoke_variants
from tooling.smoke.observe import ServerObservations
from tooling.smoke.serving.agreement import Tally
from tooling.smoke.verdicts import evaluate


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
