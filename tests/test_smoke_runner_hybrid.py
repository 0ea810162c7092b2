"""A hybrid target under the stand-in: ``--quick``'s first tokens and the prefix-cache
prompt sized to the enlarged attention blocks its engines report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tooling.smoke import run_smoke
from tooling.smoke.checks import ERROR, FAIL, PASS, SKIP
from tooling.smoke.serving.tiny import TinySpec, hybrid_config

from .smoke_models import write_model
from .smoke_runner_helpers import _config, standin_vllm_fixture  # noqa: F401 (fixture)


@pytest.mark.parametrize("mode", ["fixed", "stock"])
def test_quick_on_a_hybrid_pair_answers_in_one_start(tmp_path, standin_vllm, monkeypatch, mode):
    """--quick: no server; the first tokens of K, K+1, K+2-token prompts, each alone, with
    and without the drafter. Stock's (K+1)-token prompts start from another state."""
    monkeypatch.setenv("STANDIN_MODE", mode)
    drafter = standin_vllm[1]
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    config = replace(_config(tmp_path, hybrid, drafter, quick=True), expect=mode)
    report = run_smoke(config, notify=lambda m: None)
    status = {c.id: c.status for c in report.checks}
    first = next(c for c in report.checks if c.id == "first_tokens")
    assert status.pop("first_tokens") == (PASS if mode == "fixed" else FAIL), first.evidence
    assert set(status.values()) == {SKIP}
    assert report.passed  # as expected: stock fails the first tokens on a hybrid target
    if mode == "stock":
        assert first.evidence.startswith("1 of 4 prompts off")
        assert "A3-K+1-0" in first.evidence
    assert not any(s.name.startswith("serve") for s in report.steps)
    assert report.to_json()["plan"]["mode"] == "quick"


@pytest.mark.parametrize("mode", ["fixed", "stock"])
def test_hybrid_prefix_prompt_fills_two_of_each_engines_blocks(
    tmp_path, standin_vllm, monkeypatch, mode
):
    """A hybrid target's engines state their enlarged blocks in their logs; each server's
    repeated prompt is two of its blocks and a tail, and stock drops the last one."""
    monkeypatch.setenv("STANDIN_MODE", mode)
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    report = run_smoke(_config(tmp_path, hybrid, standin_vllm[1]), notify=lambda m: None)
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.status == (PASS if mode == "fixed" else FAIL), prefix.evidence
    assert prefix.details["speculative"]["prompt_tokens"] == 976
    assert prefix.details["speculative"]["block_size"] == 480
    assert prefix.details["plain"] == {
        "prompt_tokens": 816,
        "hits": 800,
        "queries": 816,
        "cached_tokens": 800,
        "block_size": 400,
    }
    if mode == "stock":
        assert "480 tokens from the cache" in prefix.evidence
        assert "one block dropped: fix 3 absent" in prefix.evidence


def test_hybrid_prefix_prompt_too_long_for_max_model_len_is_an_error(
    tmp_path, standin_vllm, monkeypatch
):
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    config = _config(tmp_path, hybrid, standin_vllm[1])
    config = replace(config, engine=replace(config.engine, max_model_len=512))
    report = run_smoke(config, notify=lambda m: None)
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.status == ERROR
    assert prefix.evidence == (
        "no prefix-cache observation: the repeated prompt needs two 480-token blocks and a "
        "16-token tail (976 tokens) and 8 to generate: more than max_model_len 512"
    )
