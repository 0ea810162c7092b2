"""What the tiny-model tests share: the probe interpreter run with the reference
``dflash==0.1.0`` on its path (conftest's ``probe_python`` and ``dflash_path``), and the
attention-only pair ``tiny`` that a check script writes and loads back."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR

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


def probe_env(dflash_path: Path) -> dict[str, str]:
    """The probe interpreter's variables: the reference and the toolchain on its path, offline,
    one thread."""
    return {
        **bytecode_env(),
        "PYTHONPATH": os.pathsep.join([str(dflash_path), str(REPO_DIR)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def run_probe(probe_python: Path, dflash_path: Path, *args: str, timeout: int = 240) -> None:
    env = probe_env(dflash_path)
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
    run_probe(probe_python, dflash_path, str(script), str(root / "a"), str(root / "check.json"))
    return {"root": root, "check": json.loads((root / "check.json").read_text())}
