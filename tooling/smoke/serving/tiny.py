"""Seeded tiny models for the smoke: a random target, byte-level BPE tokenizer, DFlash drafter.

Three targets (``--arch``):
- ``hybrid`` (default): ``Qwen3_5ForConditionalGeneration``, the architecture
  Qwen3.6-27B ships as: Gated DeltaNet (linear attention) layers with a gated
  full-attention layer every fourth, interleaved M-RoPE over a quarter of the
  head, and a (tiny) vision tower that the smoke never feeds: vLLM serves it
  with ``--language-model-only``. Its drafter has four sliding-window layers and
  one full layer, as the seed's does.
- ``seed``: the same architecture with Qwen3.6-27B's own geometry (64 layers,
  its attention and Gated DeltaNet heads, its vocabulary) and z-lab's drafter
  layout (window 2048, ``target_layer_ids`` [1, 16, 31, 46, 61], attention
  heads of another KV shape than the target's); only the hidden width (and the
  FFN width with it) is narrowed, by ``--hidden-size``.
- ``qwen3``: the attention-only ``Qwen3ForCausalLM``; drafter (sliding, sliding, full).

The drafter is the reference package's ``dflash.model.DFlashDraftModel``, so
what vLLM loads is exactly what the reference computes with. The tokenizer
is trained offline on a seeded synthetic corpus and saved beside the target,
so ``vllm serve`` and the OpenAI API work end to end.

Runs in an interpreter with torch, transformers, tokenizers and ``dflash``:
``python -m tooling.smoke.serving.tiny OUT_DIR [--seed N]`` writes ``OUT_DIR/target``,
``OUT_DIR/drafter`` and ``OUT_DIR/tiny.json`` (the manifest). The orchestrator
reads only the manifest, so it never imports torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...entry import answer, entry_logging
from ...fsutil import sha256_file
from ...trainer.hybrid import hybrid_config as qwen3_5_config

logger = logging.getLogger(__name__)

#: Qwen3.6's own attention head width (a quarter of it rotates).
HYBRID_ATTENTION_HEAD_DIM = 256
SEED_HIDDEN = 5120
SEED_FFN = 17408
#: The seed-shaped pair's default width: the whole depth and every head, small enough to
#: generate and serve beside its copies on one GPU.
SEED_TEST_HIDDEN = 512

#: A large pair's shards (``--device``): one safetensors file holds its tensors in host
#: memory while it is written.
LARGE_SHARD = "5GB"

MANIFEST = "tiny.json"
HYBRID = "hybrid"
SEED = "seed"
QWEN3 = "qwen3"
#: The hybrid recipe's pair (``tooling/trainer/config.py`` preset ``hybrid``) with random
#: weights: the trained pair's shapes, so its engines do the same work per step.
TRAINED_SHAPE = "trained-shape"
#: The architecture each target's config.json names; the drafter's is DRAFTER_ARCHITECTURE.
TARGET_ARCHITECTURES = {
    QWEN3: "Qwen3ForCausalLM",
    HYBRID: "Qwen3_5ForConditionalGeneration",
    SEED: "Qwen3_5ForConditionalGeneration",
    TRAINED_SHAPE: "Qwen3_5ForConditionalGeneration",
}
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|dflash_mask|>"


@dataclass(frozen=True)
class TinySpec:
    """Shapes of the tiny pair (ones vLLM 0.20.1 loads)."""

    seed: int = 0
    arch: str = QWEN3
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    target_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    draft_layer_types: tuple[str, ...] = (
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    )
    sliding_window: int = 16
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    block_size: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 64
    """The Gated DeltaNet layers' heads (hybrid targets)."""
    draft_attention: tuple[int, int, int] | None = None
    """The drafter's (heads, KV heads, head size); None: the target's."""

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def is_hybrid(self) -> bool:
        return self.arch in (HYBRID, SEED, TRAINED_SHAPE)

    @property
    def architectures(self) -> tuple[str, str]:
        """(target, drafter): the model classes vLLM resolves for this pair."""
        return TARGET_ARCHITECTURES[self.arch], DRAFTER_ARCHITECTURE

    @classmethod
    def for_arch(cls, arch: str, seed: int = 0, hidden_size: int | None = None) -> TinySpec:
        """The spec of ``arch``: the hybrid drafter gets the seed's four sliding + one full.

        The hybrid's attention shape (heads, KV heads, head size) is shared by the
        target's gated-attention layers and the drafter's: vLLM 0.20.1 groups a
        hybrid model's KV cache by layer spec into groups as large as the smallest
        spec type (here the target's two attention layers), so drafter layers of
        another shape would be split over several groups and the DFlash proposer
        refuses to start ("All drafting layers should belong to the same kv cache
        group"). With one shape the drafter's layers join the target's attention
        type and stay in one group.
        """
        if arch == SEED:
            return cls.seed_shaped(seed, hidden_size or SEED_TEST_HIDDEN)
        if hidden_size is not None:
            raise ValueError(f"the {arch} pair has a fixed hidden size")
        if arch == TRAINED_SHAPE:
            return cls.trained_shaped(seed)
        if hidden_size is not None:
            raise ValueError(f"the {arch} pair has a fixed hidden size")
        if arch == QWEN3:
            return cls(seed=seed, arch=QWEN3)
        if arch == HYBRID:
            return cls(
                seed=seed,
                arch=HYBRID,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=HYBRID_ATTENTION_HEAD_DIM,
                draft_layer_types=("sliding_attention",) * 4 + ("full_attention",),
            )
        raise ValueError(f"unknown tiny architecture {arch!r}")

    @classmethod
    def trained_shaped(cls, seed: int) -> TinySpec:
        """The hybrid recipe's pair (its ``hybrid`` preset) with random weights."""
        from ...trainer.config import PRESETS

        cfg = PRESETS["hybrid"]
        return cls(
            seed=seed,
            arch=TRAINED_SHAPE,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.target_intermediate,
            target_layers=cfg.target_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            draft_layer_types=cfg.drafter_layer_types,
            sliding_window=cfg.sliding_window,
            target_layer_ids=cfg.target_layer_ids,
            block_size=cfg.block_size,
            linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads,
            linear_head_dim=cfg.linear_head_dim,
            draft_attention=(cfg.draft_num_heads, cfg.draft_num_kv_heads, cfg.draft_head_dim),
        )

    @classmethod
    def seed_shaped(cls, seed: int, hidden_size: int) -> TinySpec:
        """Qwen3.6-27B with z-lab's drafter, narrowed to ``hidden_size`` (FFN in proportion).

        Its 16 attention layers outnumber the drafter's 5, so vLLM 0.20.1's hybrid
        grouping keeps the drafter's layers, whose KV shape differs from the
        target's, in one KV-cache group, as for the seed itself.
        """
        ffn = SEED_FFN * hidden_size // SEED_HIDDEN
        return cls(
            seed=seed,
            arch=SEED,
            vocab_size=248320,
            hidden_size=hidden_size,
            # A multiple of 128, as the seed's own FFN width is.
            intermediate_size=max(128, round(ffn / 128) * 128),
            target_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=HYBRID_ATTENTION_HEAD_DIM,
            max_position_embeddings=262144,
            draft_layer_types=("sliding_attention",) * 4 + ("full_attention",),
            sliding_window=2048,
            target_layer_ids=(1, 16, 31, 46, 61),
            block_size=16,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_head_dim=128,
            draft_attention=(32, 8, 128),
        )


@dataclass(frozen=True)
class TinyModels:
    """Where the generated pair lives (the tokenizer is in ``target``)."""

    target: Path
    drafter: Path
    spec: TinySpec
    files: dict[str, str]
    """Relative path -> sha256 of every file written."""
    device: str | None = None
    """Where it was drawn in bf16; None: in fp32 on the CPU."""

    def to_json(self) -> dict[str, Any]:
        return {
            "target": str(self.target),
            "drafter": str(self.drafter),
            "spec": asdict(self.spec),
            "files": self.files,
            "device": self.device,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TinyModels:
        spec = dict(data["spec"])
        spec["draft_layer_types"] = tuple(spec["draft_layer_types"])
        spec["target_layer_ids"] = tuple(spec["target_layer_ids"])
        return cls(
            target=Path(data["target"]),
            drafter=Path(data["drafter"]),
            spec=TinySpec(**spec),
            files=dict(data["files"]),
            device=data.get("device"),
        )


def load_manifest(root: Path) -> TinyModels:
    """The pair a previous generation wrote under ``root``."""
    return TinyModels.from_json(json.loads((root / MANIFEST).read_text(encoding="utf-8")))


def synthetic_corpus(seed: int, sentences: int = 4000) -> list[str]:
    """Deterministic training text: seeded pseudo-words plus English, code and digits.

    Generated rather than read from disk so the tokenizer does not depend on
    which Python (and which standard-library sources) the host has.
    """
    from ..config import FIDELITY_TEXTS, LOSSLESS_PROMPTS, PREFIX_PROMPT_TEXT

    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "n", "s", "t", "r", "l", "nd", "st", "ng"]
    words = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(3000)
    ]
    lines = [*LOSSLESS_PROMPTS, PREFIX_PROMPT_TEXT, *FIDELITY_TEXTS]
    for _ in range(sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
        lines.append(sentence.capitalize() + rng.choice([".", ",", "?", "!", ":", ";"]))
        lines.append(f"x_{rng.randint(0, 999)} = {rng.randint(0, 99999)}  # {rng.choice(words)}")
    return lines


def train_tokenizer(spec: TinySpec) -> Any:
    """A byte-level BPE with exactly ``spec.vocab_size`` ids, the last one the DFlash mask.

    Byte-level, so any text round-trips; id 0 is end-of-text; reserved special
    tokens fill any gap so every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - 1,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(spec.seed), trainer=trainer)
    filler = [f"<|reserved_{i}|>" for i in range(spec.vocab_size - 1 - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens([*filler, MASK_TOKEN])
    if tokenizer.token_to_id(MASK_TOKEN) != spec.mask_token_id:
        raise RuntimeError(
            f"tokenizer put {MASK_TOKEN} at {tokenizer.token_to_id(MASK_TOKEN)}, "
            f"not {spec.mask_token_id}"
        )
    return tokenizer


def _qwen3_common(spec: TinySpec) -> dict[str, Any]:
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def _save_seeded(model_class: Any, config: Any, seed: int, out: Path, device: str | None) -> None:
    """``model_class(config)`` drawn after ``manual_seed(seed)``, saved in bf16 under ``out``:
    on ``device`` in bf16 from the start (in shards), or with ``device`` None in fp32 on the
    CPU first, as the small pairs always were (``plan.LARGE_PAIR_BYTES`` says which)."""
    import torch

    torch.manual_seed(seed)
    if device is None:
        model_class(config).to(torch.bfloat16).save_pretrained(out)
        return
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, max_shard_size=LARGE_SHARD)


def write_target(out: Path, spec: TinySpec, device: str | None = None) -> None:
    """A seeded random target of ``spec.arch`` in bf16 safetensors, with its tokenizer."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if spec.is_hybrid:
        write_hybrid_target(out, spec, device)
    else:
        _save_seeded(Qwen3ForCausalLM, Qwen3Config(**target_config(spec)), spec.seed, out, device)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=spec.max_position_embeddings,
    )
    wrapped.save_pretrained(out)


def target_config(spec: TinySpec) -> dict[str, Any]:
    """config.json contents of the target (plain data, as the generator builds it)."""
    if spec.is_hybrid:
        return hybrid_config(spec)
    return dict(
        num_hidden_layers=spec.target_layers,
        architectures=[TARGET_ARCHITECTURES[QWEN3]],
        **_qwen3_common(spec),
    )


def hybrid_config(spec: TinySpec) -> dict[str, Any]:
    """config.json contents of the tiny ``Qwen3_5ForConditionalGeneration`` (plain data).

    Head counts are even so TP=2 splits them; the smoke sends no images.
    """
    return qwen3_5_config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        layers=spec.target_layers,
        attention=(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim),
        linear=(spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_head_dim),
        max_position_embeddings=spec.max_position_embeddings,
    )


def write_hybrid_target(out: Path, spec: TinySpec, device: str | None = None) -> None:
    """A seeded random Qwen3_5ForConditionalGeneration in bf16 safetensors."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(**hybrid_config(spec))
    _save_seeded(Qwen3_5ForConditionalGeneration, config, spec.seed, out, device)


def drafter_config(spec: TinySpec) -> dict[str, Any]:
    """The drafter's config (plain data): Qwen3 layers, sliding then full, and dflash_config."""
    layer_types = list(spec.draft_layer_types)
    common = _qwen3_common(spec)
    if spec.draft_attention is not None:
        heads, kv_heads, head_dim = spec.draft_attention
        common.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return dict(
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=spec.sliding_window,
        # Without it transformers sets sliding_window to None (Qwen3Config).
        use_sliding_window=True,
        max_window_layers=len(layer_types),
        architectures=[DRAFTER_ARCHITECTURE],
        **common,
        num_target_layers=spec.target_layers,
        block_size=spec.block_size,
        dflash_config={
            "target_layer_ids": list(spec.target_layer_ids),
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
        },
    )


def write_drafter(out: Path, spec: TinySpec, device: str | None = None) -> None:
    """A seeded random reference ``DFlashDraftModel`` with hybrid sliding/full layers, in bf16."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**drafter_config(spec))
    _save_seeded(DFlashDraftModel, config, spec.seed + 1, out, device)


def _digests(root: Path) -> dict[str, str]:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(path.relative_to(root))] = sha256_file(path)
    return files


def write_tiny_models(
    root: Path, spec: TinySpec | None = None, device: str | None = None
) -> TinyModels:
    """Generate the pair under ``root`` (``target/``, ``drafter/``, ``tiny.json``) and return it.
    ``device``: where to draw it in bf16; None: fp32 on the CPU."""
    spec = spec or TinySpec()
    logger.debug("write the tiny %s pair into %s", spec.arch, root)
    root.mkdir(parents=True, exist_ok=True)
    write_target(root / "target", spec, device)
    write_drafter(root / "drafter", spec, device)
    models = TinyModels(
        target=(root / "target").resolve(),
        drafter=(root / "drafter").resolve(),
        spec=spec,
        files=_digests(root),
        device=device,
    )
    # The manifest goes last: its presence means the pair is complete.
    (root / MANIFEST).write_text(json.dumps(models.to_json(), indent=2) + "\n", encoding="utf-8")
    return models


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.smoke.serving.tiny")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=(HYBRID, SEED, QWEN3, TRAINED_SHAPE), default=HYBRID)
    parser.add_argument("--hidden-size", type=int, help="the seed-shaped pair's width")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), help="draw in bf16 there (default: fp32 on the CPU)"
    )
    args = parser.parse_args(argv)
    spec = TinySpec.for_arch(args.arch, args.seed, hidden_size=args.hidden_size)
    with entry_logging():
        models = write_tiny_models(args.out, spec, args.device)
    answer(json.dumps(models.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
