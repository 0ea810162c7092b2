"""Lossless under load: the fixed wheel's outputs with many requests at once, set beside the plain
engine's, whose own noise between batch shapes is all that may excuse a difference."""

from __future__ import annotations

from pathlib import Path

from tooling.trained import hybrid as tp
from tooling.trained import hybrid_plan as hp

from .trained_pair_helpers import OUTPUTS, K, _run


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
