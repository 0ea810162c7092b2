"""The tiny models and the reference comparison, in the CPU interpreter with torch.

The torch part runs in the probe interpreter with the reference
``dflash==0.1.0`` on its path (conftest's ``probe_python`` and ``dflash_path``). The models
are generated through the same ``python -m tooling.smoke.serving.tiny`` the smoke
runs, loaded back with transformers and with the reference package, and the
reference comparison (``tooling.smoke.serving.reference``) is checked against the
reference's own speculative loop (``DFlashDraftModel.spec_generate``): drafts
recorded from that loop must be reproduced exactly, and drafts from the same
loop with the drafter miswired as stock vLLM 0.20.1 wires it (every layer full
attention; context read at ``hidden_states[id]``) must fall below the gate.
That loop needs the attention-only ``qwen3`` target (its cache is cropped
after each verification). The ``hybrid`` target (the smoke's default) is
checked the way the GPU smoke gates it: context features handed in as the
engine's, and the HF layer they are nearest to.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tooling.errors import SmokeError
from tooling.fsutil import sha256_file
from tooling.paths import REPO_DIR
from tooling.procs import group_members
from tooling.smoke import checks
from tooling.smoke.config import drafter_info_from_config, target_info_from_config
from tooling.smoke.pair import read_pair, tiny_pair
from tooling.smoke.reference_pool import reference_pool
from tooling.smoke.serving.tiny import (
    MANIFEST,
    TinySpec,
    _qwen3_common,
    hybrid_config,
    load_manifest,
)

from .helpers import bytecode_env

CHECK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import dflash.model as dm
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    from tooling.smoke.serving.reference import FidelityInput, ModelSetup, compare, load_pair
    from tooling.smoke.serving.tiny import TinySpec, write_tiny_models

    root, out_path = sys.argv[1], sys.argv[2]
    out = {}
    # The pair, written here rather than by a process of its own (the hybrid one is).
    write_tiny_models(Path(root), TinySpec.for_arch("qwen3", 0))

    # Load back with transformers and with the reference package.
    target = Qwen3ForCausalLM.from_pretrained(f"{root}/target")
    out["target"] = {
        "layers": target.config.num_hidden_layers,
        "vocab": target.config.vocab_size,
        "dtype": str(target.dtype),
        "eos": target.config.eos_token_id,
    }
    draft = dm.DFlashDraftModel.from_pretrained(f"{root}/drafter")
    out["drafter"] = {
        "target_layer_ids": list(draft.target_layer_ids),
        "mask_token_id": draft.mask_token_id,
        "block_size": draft.block_size,
        "windows": [layer.self_attn.sliding_window for layer in draft.layers],
        "causal": [layer.self_attn.is_causal for layer in draft.layers],
        "keys": sorted({k.split(".")[0] for k in draft.state_dict()}),
    }
    tok = AutoTokenizer.from_pretrained(f"{root}/target")
    texts = ["Hello world", "Grüße — ünïcödé ✓", "def f(x):\\n    return x ** 2\\n", "  a  b  "]
    out["tokenizer"] = {
        "size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "mask": tok.convert_ids_to_tokens(2047),
        "round_trips": [tok.decode(tok.encode(t, add_special_tokens=False)) == t for t in texts],
        "mask_skipped": tok.decode([2047, 0], skip_special_tokens=True) == "",
    }

    # Proposals of the reference's own loop, recorded, in float32 (exact on CPU).
    def record(mode):
        target, draft = load_pair(f"{root}/target", f"{root}/drafter", "cpu", "float32")
        if mode == "all_full":  # stock 0.20.1 runs every drafter layer as full attention
            for layer in draft.layers:
                layer.self_attn.sliding_window = None
                layer.self_attn.is_causal = False
        original = dm.extract_context_feature
        if mode == "no_offset":  # stock 0.20.1 captures hidden_states[id], not [id + 1]
            dm.extract_context_feature = lambda hs, ids: torch.cat([hs[i] for i in ids], -1)
        records, forward, logits_of = [], draft.forward, draft.compute_logits

        def recording_forward(*args, **kwargs):
            n = kwargs["noise_embedding"].shape[1]
            records.append({"position": int(kwargs["position_ids"][0, -n])})
            return forward(*args, **kwargs)

        def recording_logits(hidden, head):
            logits = logits_of(hidden, head)
            records[-1]["drafts"] = torch.argmax(logits, -1)[0].tolist()
            return logits

        draft.forward, draft.compute_logits = recording_forward, recording_logits
        gen = torch.Generator().manual_seed(0)
        prompts, outputs, proposals = [], [], []
        for index, length in enumerate([48, 64]):
            ids = torch.randint(10, 2000, (1, length), generator=gen)
            records.clear()
            seq = draft.spec_generate(target, ids, max_new_tokens=32, stop_token_ids=None)
            seq = seq[0].tolist()
            prompts.append(seq[:length])
            outputs.append(seq[length:])
            for r in records:
                proposals.append({"prompt": index, "position": r["position"],
                                  "bonus": seq[r["position"]], "drafts": r["drafts"]})
        dm.extract_context_feature = original
        return {"prompts": prompts, "outputs": outputs, "proposals": proposals}

    setup = ModelSetup(f"{root}/target", f"{root}/drafter", "cpu", "float32")
    out["setup"] = vars(setup)

    out["comparisons"] = {}
    for mode in ("same", "all_full", "no_offset"):
        request = record(mode)
        if mode == "same":
            # A first difference placed in the reference's own greedy output: the
            # token it chose there, and another one.
            chosen = request["outputs"][0][5]
            request["divergences"] = [{
                "context": request["prompts"][0] + request["outputs"][0][:5],
                "tokens": [chosen, 10 + (chosen + 1) % 1990],
            }]
            out["same_request"] = request
        out["comparisons"][mode] = compare(setup, FidelityInput(**request))
        if mode == "all_full":
            tolerant = {**request, "tie_tolerance": 1e9}
            out["comparisons"]["all_full_any_tie"] = compare(setup, FidelityInput(**tolerant))
    json.dump(out, open(out_path, "w"))
    """
)


def _run(probe_python: Path, dflash_path: Path, *args: str, timeout: int = 240) -> None:
    env = {
        **bytecode_env(),
        "PYTHONPATH": os.pathsep.join([str(dflash_path), str(REPO_DIR)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [str(probe_python), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, probe_python: Path, dflash_path: Path) -> dict:
    """An attention-only pair ``a``, written by the check script, which loads it back."""
    root = tmp_path_factory.mktemp("tiny")
    script = root / "check.py"
    script.write_text(CHECK_SCRIPT)
    _run(probe_python, dflash_path, str(script), str(root / "a"), str(root / "check.json"))
    return {"root": root, "check": json.loads((root / "check.json").read_text())}


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
    env = {
        **os.environ,
        **bytecode_env(),
        "PYTHONPATH": os.pathsep.join([str(dflash_path), str(REPO_DIR)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
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
    _run(probe_python, dflash_path, "-m", "tooling.smoke.serving.tiny", str(root / "pair"))
    script = root / "check.py"
    script.write_text(HYBRID_SCRIPT)
    _run(probe_python, dflash_path, str(script), str(root / "pair"), str(root / "check.json"))
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
