"""Verdicts on how the drafter is wired, stock-like against fixed-like: the aux layers it
reads, its attention windows and the prefix cache it leaves whole (fixes 1 to 3)."""

from __future__ import annotations

import pytest

from tooling.errors import SmokeError
from tooling.smoke import checks
from tooling.smoke.checks import PrefixObservation
from tooling.smoke.config import drafter_info_from_config

from .smoke_checks_helpers import STOCK_WINDOWS, TINY_DRAFTER_CONFIG

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
