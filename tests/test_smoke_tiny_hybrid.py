"""The default hybrid tiny pair, generated as the smoke generates it (seeded, bf16 for the
large pairs), gated as the GPU smoke gates it, and sized by the plan as written."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tooling.smoke import checks
from tooling.smoke.config import drafter_info_from_config, target_info_from_config
from tooling.smoke.pair import read_pair, tiny_pair
from tooling.smoke.serving.tiny import (
    MANIFEST,
    TinySpec,
    _qwen3_common,
    hybrid_config,
    load_manifest,
)

from .smoke_tiny_helpers import run_probe

# The ``tiny`` fixture for this module's tests; the redundant alias marks it as used.
from .smoke_tiny_helpers import tiny as tiny

HYBRID_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import transformers
    from dflash.model import extract_context_feature
    from pathlib import Path
    from tooling.smoke.serving.reference import (
        FidelityInput, LoadedPair, ModelSetup, compare, load_pair, reference_logits,
        target_hidden_states, warm_up)
    from tooling.smoke.serving.tiny import TinySpec, write_tiny_models

    root, out_path = sys.argv[1], sys.argv[2]
    # The command line's pair (seed 0) again, in this process.
    write_tiny_models(Path(root).parent / "again", TinySpec.for_arch("hybrid", 0))
    config = transformers.AutoConfig.from_pretrained(f"{root}/target")
    out = {"target_config": type(config).__name__}
    target, draft = load_pair(f"{root}/target", f"{root}/drafter", "cpu", "float32")
    out["target_class"] = type(target).__name__
    out["windows"] = [layer.self_attn.sliding_window for layer in draft.layers]
    sequence = torch.randint(10, 2000, (56,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden = target_hidden_states(target, sequence)
    out["hidden_states"] = len(hidden)
    ids = list(draft.target_layer_ids)
    right = extract_context_feature(hidden, ids)
    # What stock 0.20.1 hands the drafter: hidden_states[id], not [id + 1].
    stock = torch.cat([hidden[i] for i in ids], dim=-1)
    # The reference's own drafts from the right features, at three bonus positions.
    proposals = []
    for position in (24, 40, 55):
        logits = reference_logits(target, draft, right, position, sequence[position], 3)
        proposals.append({"prompt": 0, "position": position, "bonus": sequence[position],
                          "drafts": logits.argmax(-1).tolist()})
    # A shard's warm-up, on the loaded pair: made-up tokens, and nothing it leaves behind.
    before = reference_logits(target, draft, right, 40, sequence[40], 3)
    out["warm_up_s"] = warm_up(LoadedPair(target, draft, "cpu", 0.0))
    after = reference_logits(target, draft, right, 40, sequence[40], 3)
    out["warm_up_changes_nothing"] = bool(torch.equal(before, after))
    # The large pairs' draw (bf16 from the start, saved in shards), here on the CPU: the
    # same tensors by name and shape as the fp32 draw, seeded, and a pair the reference runs.
    for name in ("bf16-a", "bf16-b"):
        write_tiny_models(Path(root).parent / name, TinySpec.for_arch("hybrid", 0), "cpu")
    shapes = {}
    for name in ("pair", "bf16-a"):
        t, d = load_pair(f"{Path(root).parent / name}/target",
                         f"{Path(root).parent / name}/drafter", "cpu", "auto")
        shapes[name] = {k: list(v.shape) for k, v in {**t.state_dict(), **{
            "drafter." + k: v for k, v in d.state_dict().items()}}.items()}
        if name == "bf16-a":
            out["bf16_dtypes"] = sorted({str(v.dtype) for v in t.state_dict().values()})
            logits = reference_logits(t, d, extract_context_feature(
                target_hidden_states(t, sequence), ids), 40, sequence[40], 3)
            out["bf16_logits_finite"] = bool(torch.isfinite(logits).all())
    out["bf16_same_shapes"] = shapes["pair"] == shapes["bf16-a"]
    out["comparisons"] = {}
    for name, features in (("right", right), ("stock", stock)):
        path = f"{root}/{name}-features.pt"
        torch.save({0: (list(range(len(sequence))), features[0])}, path)
        setup = ModelSetup(f"{root}/target", f"{root}/drafter", "cpu", "float32")
        out["comparisons"][name] = compare(setup, FidelityInput(
            prompts=[sequence[:24]], outputs=[sequence[24:]], proposals=proposals,
            context="engine", features_path=path, expected_layers=[i + 1 for i in ids]))
    json.dump(out, open(out_path, "w"))
    """
)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, probe_python: Path, dflash_path: Path) -> dict:
    """The default tiny pair (no --arch), written by the command line and compared as the
    GPU smoke compares it by a script in another process, which writes it ``again``."""
    root = tmp_path_factory.mktemp("hybrid")
    run_probe(probe_python, dflash_path, "-m", "tooling.smoke.serving.tiny", str(root / "pair"))
    script = root / "check.py"
    script.write_text(HYBRID_SCRIPT)
    run_probe(probe_python, dflash_path, str(script), str(root / "pair"), str(root / "check.json"))
    return {"root": root, "check": json.loads((root / "check.json").read_text())}


@pytest.mark.slow
def test_generation_is_seeded(hybrid) -> None:
    """The same seed gives the same bytes, in another process (torch's and the tokenizer
    trainer's randomness included)."""
    pair = json.loads((hybrid["root"] / "pair" / MANIFEST).read_text())["files"]
    again = json.loads((hybrid["root"] / "again" / MANIFEST).read_text())["files"]
    assert pair == again and len(pair) >= 6


@pytest.mark.slow
def test_a_large_pair_is_drawn_in_bf16_seeded_and_whole(hybrid) -> None:
    """The draw a pair past the plan's LARGE_PAIR_BYTES gets (``--device cuda``), run on the
    CPU with the tiny hybrid: the fp32 draw's tensors, in bf16, seeded, named in the
    manifest."""
    check = hybrid["check"]
    assert check["bf16_same_shapes"] is True and check["bf16_logits_finite"] is True
    assert check["bf16_dtypes"] == ["torch.bfloat16"]
    a, b = (load_manifest(hybrid["root"] / name) for name in ("bf16-a", "bf16-b"))
    assert a.files == b.files and a.device == "cpu"
    assert load_manifest(hybrid["root"] / "pair").device is None


@pytest.mark.slow
def test_default_pair_is_the_hybrid_family(hybrid) -> None:
    models = load_manifest(hybrid["root"] / "pair")
    assert models.spec == TinySpec.for_arch("hybrid")
    config = json.loads(models.target.joinpath("config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    info = target_info_from_config(config)
    assert (info.hybrid, info.multimodal) == (True, True)
    check = hybrid["check"]
    assert check["target_config"] == "Qwen3_5Config"
    assert check["target_class"] == "Qwen3_5ForConditionalGeneration"
    assert check["hidden_states"] == 9  # embeddings + 8 layers
    assert check["windows"] == [16, 16, 16, 16, None]
    drafter = json.loads(models.drafter.joinpath("config.json").read_text())
    assert drafter_info_from_config(drafter).expected_windows() == [(15, 0)] * 4 + [(-1, -1)]


@pytest.mark.slow
def test_a_shards_warm_up_runs_the_hybrid_pair_and_leaves_its_results_alone(hybrid) -> None:
    assert hybrid["check"]["warm_up_s"] > 0
    assert hybrid["check"]["warm_up_changes_nothing"] is True


@pytest.mark.slow
def test_hybrid_engine_context_finds_the_captured_layers(hybrid) -> None:
    right = hybrid["check"]["comparisons"]["right"]
    assert right["context"] == "engine"
    assert right["compared_tokens"] == 9
    assert right["agreement"] == 1.0
    assert right["feature_layers"]["nearest"] == [2, 4, 6]
    stock = hybrid["check"]["comparisons"]["stock"]
    # Features taken at hidden_states[id] are nearest to those layers: check 2 fails.
    assert stock["feature_layers"]["nearest"] == [1, 3, 5]
    captured = tuple(stock["feature_layers"]["nearest"])
    verdict = checks.check_aux_layers((2, 4, 6), (2, 4, 6), "x", captured)
    assert verdict.status == checks.FAIL


def test_hybrid_drafter_shares_the_target_attention_shape() -> None:
    # One KV spec for the target's attention layers and the drafter's: vLLM 0.20.1
    # then keeps every drafter layer in one KV-cache group (see TinySpec.for_arch).
    spec = TinySpec.for_arch("hybrid")
    text = hybrid_config(spec)["text_config"]
    drafter = _qwen3_common(spec)
    keys = ("num_attention_heads", "num_key_value_heads", "head_dim")
    assert [text[k] for k in keys] == [drafter[k] for k in keys] == [2, 2, 256]


@pytest.mark.slow
def test_the_plan_counts_the_weights_the_generator_writes(tiny, hybrid) -> None:
    """The plan sizes a ``--tiny`` pair from its configs before it exists; the generated
    safetensors hold what it counted (the hybrid's small vision tower is left out)."""
    for root, arch in ((tiny["root"] / "a", "qwen3"), (hybrid["root"] / "pair", "hybrid")):
        planned = tiny_pair(arch, None, root)
        written = read_pair(str(root / "target"), str(root / "drafter"))
        assert planned.drafter.weight_bytes == written.drafter.weight_bytes, arch
        ratio = planned.target.weight_bytes / written.target.weight_bytes
        assert ratio == 1.0 if arch == "qwen3" else 0.8 < ratio <= 1.0, (arch, ratio)
        assert planned.target.kv_bytes_per_token == written.target.kv_bytes_per_token
