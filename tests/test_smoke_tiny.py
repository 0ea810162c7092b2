"""The attention-only tiny pair loads back as vLLM and the reference read it, and the
reference comparison reproduces the reference's own speculative loop (stock vLLM's
miswired drafts fall below the gate), one process or sharded alike."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tooling.errors import SmokeError
from tooling.fsutil import sha256_file
from tooling.procs import group_members
from tooling.smoke import checks
from tooling.smoke.config import drafter_info_from_config
from tooling.smoke.reference_pool import reference_pool
from tooling.smoke.serving.tiny import TinySpec, load_manifest

from .smoke_tiny_helpers import probe_env

# The ``tiny`` fixture for this module's tests; the redundant alias marks it as used.
from .smoke_tiny_helpers import tiny as tiny


@pytest.mark.slow
def test_manifest_lists_every_file_with_its_digest(tiny) -> None:
    models = load_manifest(tiny["root"] / "a")
    assert models.spec == TinySpec.for_arch("qwen3")
    assert models.target.is_dir() and models.drafter.is_dir()
    expected = {
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "drafter/config.json",
        "drafter/model.safetensors",
    }
    assert expected <= set(models.files)
    for rel, digest in models.files.items():
        assert sha256_file(tiny["root"] / "a" / rel) == digest


@pytest.mark.slow
def test_drafter_config_is_what_vllm_and_the_reference_read(tiny) -> None:
    config = json.loads((tiny["root"] / "a" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["use_sliding_window"] is True
    assert config["dflash_config"] == {
        "target_layer_ids": [1, 3, 5],
        "mask_token_id": 2047,
        "block_size": 4,
    }
    info = drafter_info_from_config(config)
    assert info.expected_windows() == [(15, 0), (15, 0), (-1, -1)]
    assert info.expected_aux_layers() == (2, 4, 6)


@pytest.mark.slow
def test_models_load_back(tiny) -> None:
    check = tiny["check"]
    assert check["target"] == {"layers": 8, "vocab": 2048, "dtype": "torch.bfloat16", "eos": 0}
    drafter = check["drafter"]
    assert drafter["target_layer_ids"] == [1, 3, 5]
    assert drafter["mask_token_id"] == 2047
    assert drafter["block_size"] == 4
    assert drafter["windows"] == [16, 16, None]
    assert drafter["causal"] == [True, True, False]
    # No embeddings or head: the drafter borrows the target's.
    assert drafter["keys"] == ["fc", "hidden_norm", "layers", "norm"]


@pytest.mark.slow
def test_tokenizer_round_trips(tiny) -> None:
    tok = tiny["check"]["tokenizer"]
    assert tok["size"] == 2048
    assert tok["eos_token_id"] == 0
    assert tok["mask"] == "<|dflash_mask|>"
    assert all(tok["round_trips"])
    assert tok["mask_skipped"]


@pytest.mark.slow
def test_reference_comparison_reproduces_the_reference_loop(tiny) -> None:
    same = tiny["check"]["comparisons"]["same"]
    assert same["compared_tokens"] > 150
    assert same["skipped"] == {"no_context": 0, "bonus_mismatch": 0}
    assert same["agreement"] == 1.0
    assert checks.check_fidelity(same, 0.99).status == checks.PASS
    # Where the comparison's time went, so a slow reference step says why.
    assert set(same["seconds"]) == {
        "load",
        "target",
        "features_file",
        "features",
        "drafter",
        "divergences",
    }
    assert all(s >= 0 for s in same["seconds"].values()) and same["seconds"]["drafter"] > 0


@pytest.mark.slow
def test_divergence_margins_are_the_targets_own(tiny) -> None:
    (margin,) = tiny["check"]["comparisons"]["same"]["divergences"]
    chosen = tiny["check"]["same_request"]["outputs"][0][5]
    # The greedy output's token is the target's best there; another one is below it.
    assert margin["argmax"] == chosen
    assert margin["spec_gap"] == 0.0
    assert margin["plain_gap"] > 0.0
    assert margin["spread"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["all_full", "no_offset"])
def test_stock_like_drafts_fail_the_gate(tiny, mode: str) -> None:
    result = tiny["check"]["comparisons"][mode]
    assert result["agreement"] < 0.95
    assert result["mismatches"] == sum(result["totals"]) - sum(result["matches"])
    assert len(result["mismatch_margins"]) == min(result["mismatches"], 50)
    # Every mismatch has a margin; 0 where the reference's logits tie exactly.
    assert all(m >= 0 for m in result["mismatch_margins"])
    verdict = checks.check_fidelity(result, 0.99)
    assert verdict.status == checks.FAIL
    assert f"of {result['mismatches']} mismatches are near ties" in verdict.evidence


@pytest.mark.slow
def test_tie_tolerance_counts_close_logits_as_agreement(tiny) -> None:
    strict = tiny["check"]["comparisons"]["all_full"]
    any_tie = tiny["check"]["comparisons"]["all_full_any_tie"]
    assert any_tie["exact_agreement"] == strict["agreement"]
    assert any_tie["agreement"] == 1.0  # an unbounded tolerance accepts every token


def _pool(tmp_path: Path, setup: dict, probe_python: Path, dflash_path: Path, shards: int):
    env = {**os.environ, **probe_env(dflash_path)}
    return reference_pool(
        str(probe_python),
        tmp_path,
        tmp_path / "logs",
        "t",
        setup,
        shards=shards,
        env=env,
        early=True,
    )


@pytest.mark.slow
def test_shards_give_what_one_process_gives(tiny, tmp_path, probe_python, dflash_path) -> None:
    """The smoke's path: children that load first, then take their share of the prompts
    from stdin (the engine's proposals, while the servers are still observed), and the
    first one the servers' divergences last; their summed counts are the one-process
    result, divergences included."""
    request = tiny["check"]["same_request"]
    with _pool(tmp_path, tiny["check"]["setup"], probe_python, dflash_path, 2) as pool:
        pool.dispatch(request)
        # The second shard has all its work: it compares and ends without the first.
        pool.procs[1].wait(timeout=240)
        assert pool.procs[0].poll() is None
        sharded = pool.finish(request["divergences"], timeout_s=240)
    whole = tiny["check"]["comparisons"]["same"]
    assert sharded["shards"] == 2
    # Both shards had work: the request holds two prompts.
    assert all(
        json.loads((tmp_path / f"t-reference-in-{i}.json").read_text())["prompt_indices"]
        for i in range(2)
    )
    timing = {"seconds", "shards", "mismatch_examples"}
    assert {k: v for k, v in sharded.items() if k not in timing} == {
        k: v for k, v in whole.items() if k not in timing
    }
    assert sharded["compared_tokens"] == whole["compared_tokens"] > 150
    assert len(sharded["divergences"]) == 1
    # Each shard warmed its models up before its work came.
    assert sharded["seconds"]["warm_up"] > 0
    # Each log says how far its shard got, prompt by prompt, with the phases' seconds: a
    # comparison still running when a run is cut short says where its time went.
    for i in range(2):
        log = (tmp_path / "logs" / f"t-reference-{i}.log").read_text()
        assert re.search(r"^1/1 prompts compared \(.*target [0-9.]+s.*drafter [0-9.]+s", log, re.M)
    assert "1 divergences measured in " in (tmp_path / "logs" / "t-reference-0.log").read_text()


@pytest.mark.slow
def test_a_shard_that_cannot_load_is_one_line_naming_its_log(
    tiny, tmp_path, probe_python, dflash_path
) -> None:
    setup = {**tiny["check"]["setup"], "drafter": str(tmp_path / "no-such-drafter")}
    with _pool(tmp_path, setup, probe_python, dflash_path, 1) as pool:
        with pytest.raises(SmokeError) as raised:
            pool.dispatch(tiny["check"]["same_request"])
            pool.finish([], timeout_s=240)
        procs = list(pool.procs)
    message = str(raised.value)
    assert "\n" not in message and "t-reference-0.log" in message
    assert "no-such-drafter" in message
    assert all(group_members(p.pid) == [] for p in procs)
