"""The trained hybrid pair's plan: which engines each GPU call serves and the requests
written for them, since a call planned wrong spends scarce GPU time measuring the wrong thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.trained import hybrid_plan as hp

from .trained_pair_helpers import LOSSLESS, PREFIX, K, _pair


def test_plan_writes_one_request_per_engine_with_the_recipes_prompts(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    chosen = hp.plan(pair, tmp_path / "work")
    names = [v.name for v in chosen]
    assert names[0] == "plain" and f"stock-k{K}" in names
    assert {f"no-{p}-k{K}" for p in hp.ABLATED} <= set(names)
    # The fixed wheel with the drafter's full graphs (its default) off, and under a budget
    # whose 16 at once verify fewer drafts: in the first call only.
    (graphs,) = [v for v in chosen if v.no_drafter_graphs]
    assert graphs.call == 1 and graphs.site == "patched" and graphs.k == K
    sent = json.loads((tmp_path / "work" / f"{graphs.name}.in.json").read_text())["engine"]
    assert sent["speculative_args"] == hp.NO_DRAFTER_GRAPHS == {"dflash_full_cudagraphs": False}
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
