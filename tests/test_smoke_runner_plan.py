"""What a dry run plans (steps, waves, argv) and which architectures the preflight
asks the serving interpreter about, with no process started."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tooling.errors import SmokeError
from tooling.smoke import GpuFacts, SmokeConfig, describe_plan


def test_dry_run_plan_lists_every_process(tmp_path) -> None:
    h200 = GpuFacts(1, 141 * 2**30)
    plan = describe_plan(
        SmokeConfig(workdir=tmp_path, tiny=True, python="/usr/bin/python3", gpus=h200)
    ).to_json()
    steps = [s["step"] for s in plan["steps"]]
    # --tiny: everything fits one GPU at once. The reference's four children start first
    # and load while the engines compile, then wait for the in-process engine's proposals.
    assert steps == [
        "models",
        "reference comparison (engine)",
        "serve with DFlash",
        "serve without speculation",
        "first tokens with DFlash",
        "first tokens without speculation",
        "in-process engine (engine)",
    ]
    assert plan["steps"][1]["processes"] == 4 and plan["steps"][1]["loads_before_the_engine"]
    assert plan["layout"] == "side by side"
    config = SmokeConfig(workdir=tmp_path, tiny=True, overlap_engines=False, gpus=h200)
    serial = describe_plan(config).to_json()["steps"]
    assert [(s["step"], s["wave"]) for s in serial][1:] == [
        ("serve with DFlash", 1),
        ("in-process engine (engine)", 2),
        ("serve without speculation", 3),
        ("first tokens with DFlash", 4),
        ("first tokens without speculation", 5),
        ("reference comparison (engine)", 6),
    ]
    # One after another on one GPU, the reference runs last, alone.
    assert not serial[-1]["loads_before_the_engine"]
    assert all(s["argv"][0] == "/usr/bin/python3" for s in plan["steps"])
    assert plan["steps"][0]["argv"][-2:] == ["--arch", "hybrid"]
    assert "--speculative-config" in plan["steps"][2]["argv"]
    assert "--speculative-config" not in plan["steps"][3]["argv"]
    # Compiled graphs unless asked: vLLM's own default.
    assert "--enforce-eager" not in plan["steps"][2]["argv"]


def test_warm_cache_plan_and_its_one_line_errors(tmp_path) -> None:
    with pytest.raises(SmokeError, match="needs another build"):
        SmokeConfig(workdir=tmp_path, tiny=True, warm_cache=True).validate()
    with pytest.raises(SmokeError, match="no vllm package"):
        SmokeConfig(
            workdir=tmp_path, tiny=True, warm_cache=True, other_site=str(tmp_path)
        ).validate()
    site = tmp_path / "stock"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    config = SmokeConfig(
        workdir=tmp_path,
        tiny=True,
        warm_cache=True,
        other_site=str(site),
        gpus=GpuFacts(1, 141 * 2**30),
    )
    steps = [(s.name, s.wave) for s in describe_plan(config).steps]
    # The warm-cache runs come first: that check is what such a run is for.
    assert steps[:5] == [
        ("models", 0),
        ("reference comparison (warm-A)", 1),
        ("in-process engine (warm-A)", 1),
        ("reference comparison (warm-B)", 2),
        ("in-process engine (warm-B)", 2),
    ]
    assert steps[-1] == ("in-process engine (engine)", 3)


def test_model_architectures_are_the_pairs_classes(tmp_path) -> None:
    from tooling.smoke.preflight import model_architectures

    tiny = SmokeConfig(workdir=tmp_path, tiny=True)
    assert model_architectures(tiny) == ["Qwen3_5ForConditionalGeneration", "DFlashDraftModel"]
    assert model_architectures(replace(tiny, tiny_arch="qwen3"))[0] == "Qwen3ForCausalLM"
    target, drafter = tmp_path / "t", tmp_path / "d"
    for folder, arch in ((target, "Qwen3_5ForCausalLM"), (drafter, "DFlashDraftModel")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
    given = SmokeConfig(workdir=tmp_path, target=str(target), drafter=str(drafter))
    assert model_architectures(given) == ["Qwen3_5ForCausalLM", "DFlashDraftModel"]
    # A hub id (no local config): vLLM inspects it itself.
    hub = SmokeConfig(workdir=tmp_path, target="Qwen/Qwen3.6-27B", drafter=str(drafter))
    assert model_architectures(hub) == ["DFlashDraftModel"]
