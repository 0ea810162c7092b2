"""The recipe's settings: one frozen dataclass, two presets, ``key=value`` overrides.

No torch here, so settings and digests can be computed anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, fields, replace
from typing import Any

from .hybrid import FULL_ATTENTION_INTERVAL

# Bump when the recipe's behaviour changes in a way the settings do not show.
RECIPE_VERSION = 4

ARCHES = ("qwen3", "hybrid")


@dataclass(frozen=True)
class RecipeConfig:
    """Every setting that shapes the trained weights and the measurement.

    The defaults are the full GPU recipe (minutes on one GPU); ``PRESETS``
    holds a tiny CPU variant for tests.
    """

    seed: int = 0

    # Corpus: the stdlib's *.py files, split by a hash of each file's path.
    heldout_fraction: float = 0.05  # prompts and held-out loss; never trained on
    draft_fraction: float = 0.10  # drafter prompts only; unseen by the target
    max_files: int | None = None  # a seeded subset, for quick runs
    max_file_bytes: int = 2_000_000

    # Tokenizer.
    vocab_size: int = 8192

    # Target: "qwen3" is transformers' attention-only Qwen3ForCausalLM; "hybrid" is
    # Qwen3_5ForConditionalGeneration, the seed's family (three Gated DeltaNet layers to one
    # gated attention layer), whose linear-attention heads are the linear_* settings.
    arch: str = "qwen3"
    target_layers: int = 8
    hidden_size: int = 768
    target_intermediate: int = 2048
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 4096
    target_seq_len: int = 512
    target_batch: int = 64
    target_epochs: float = 3.0
    target_max_steps: int = 0  # 0: from target_epochs
    target_lr: float = 1e-3
    target_time_cap_s: float = 150.0
    # More training at the schedule's last rate while the target is not yet decisive
    # (min_target_margin), checked every target_check_every_s; 0: none.
    target_extra_time_s: float = 0.0
    target_check_every_s: float = 60.0
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_head_dim: int = 128
    eval_tokens: int = 262_144

    # Drafter data: the target's own greedy continuations of corpus windows.
    data_prompt_len: int = 256
    data_gen_len: int = 128
    data_sequences: int = 24_576
    data_time_cap_s: float = 75.0  # generation stops early past this (keeps what it has)
    data_unseen_fraction: float = 0.5  # share of prompts from the drafter-only split
    gen_batch: int = 1024
    feature_batch: int = 256
    data_eval_sequences: int = 256  # from held-out files, for a proxy of acceptance

    # Drafter (dflash.model.DFlashDraftModel on a Qwen3Config).
    drafter_layer_types: tuple[str, ...] = (
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    )
    sliding_window: int = 32
    target_layer_ids: tuple[int, ...] = (1, 4, 6)
    block_size: int = 4
    drafter_intermediate: int = 2048
    # The drafter's attention heads (0: the target's). The seed's drafter has another KV
    # shape than its target's attention, which vLLM must then keep in a KV-cache group of its own.
    draft_num_heads: int = 0
    draft_num_kv_heads: int = 0
    draft_head_dim: int = 0

    # Drafter training.
    drafter_steps: int = 5000
    drafter_batch: int = 64
    anchors_per_seq: int = 64
    gen_anchor_fraction: float = 0.75  # anchors inside the generated part
    min_anchor: int = 16
    drafter_lr: float = 1e-3
    loss_gamma: float = 4.0  # position weight exp(-(k-1)/gamma), as in the DFlash paper
    drafter_time_cap_s: float = 180.0
    # Steps the drafter trains even when the wall budget leaves it less time than the cap:
    # the acceptance floor depends on steps, and a shared or slower GPU takes fewer a second.
    drafter_min_steps: int = 0

    # Shared optimiser settings.
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 50

    # Reference acceptance on held-out prompts.
    num_prompts: int = 32
    prompt_len: int = 256
    max_new_tokens: int = 96
    crosscheck_prompts: int = 4  # also run through the minimal uncached loop
    # Drafted tokens per step the reference measures besides block_size - 1 (a drafter of
    # block size B serves any K < B).
    reference_speculative_tokens: tuple[int, ...] = ()
    lossless_new_tokens: int = 48  # per prompt of the lossless check (but the one to the end)
    lossless_candidates: int = 16  # seeded windows per prompt, the most decisive kept

    # Quality floors (0: none). A run short of one ends with TrainingError, naming the figure,
    # and writes no pair: a lossless check needs a decisive target (near-ties flip under any
    # change of batch shape), and an acceptance table needs a drafter that drafts.
    min_target_margin: float = 0.0
    """Median top-2 logit margin of the target's greedy choices on the checked prompts."""
    min_acceptance_length: float = 0.0
    """The reference's mean acceptance length at ``floor_speculative_tokens``."""
    floor_speculative_tokens: int = 0

    # Whole run.
    wall_budget_s: float = 420.0
    reserve_s: float = 60.0  # kept back from the drafter for saving and measuring

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready data."""
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out

    def digest_material(self) -> str:
        """Canonical JSON of the settings and the recipe version."""
        return json.dumps({"recipe": RECIPE_VERSION, "config": self.to_dict()}, sort_keys=True)

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work together."""
        for f in fields(self):
            value = getattr(self, f.name)
            if any(v < 0 for v in _numbers(value)):
                raise ValueError(f"{f.name} {value}: must not be negative")
            if f.name in POSITIVE and not value:
                raise ValueError(f"{f.name} {value}: must be above 0")
        # HF's last hidden state is after the final norm, while vLLM captures the raw
        # residual stream: the two agree only for ids up to num_layers - 2.
        if any(i < 0 or i > self.target_layers - 2 for i in self.target_layer_ids):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids}: each must be in "
                f"[0, {self.target_layers - 2}]"
            )
        if self.sliding_window < self.block_size:
            raise ValueError("sliding_window must be at least block_size")
        sliding = "sliding_attention" in self.drafter_layer_types
        if sliding and self.sliding_window >= self.prompt_len:
            raise ValueError("sliding_window must be shorter than the prompts to test SWA")
        if self.data_prompt_len <= self.min_anchor or self.data_gen_len < self.block_size:
            raise ValueError("drafter data sequences are too short for the anchors")
        if self.num_heads * self.head_dim <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.heldout_fraction + self.draft_fraction >= 1.0:
            raise ValueError("heldout_fraction + draft_fraction must stay below 1")
        if self.arch not in ARCHES:
            raise ValueError(f"arch {self.arch!r}: not one of {', '.join(ARCHES)}")
        if self.arch == "hybrid":
            attention = self.target_layers // FULL_ATTENTION_INTERVAL
            if attention < len(self.drafter_layer_types):
                # vLLM groups KV caches by the smallest layer-type count: fewer target
                # attention layers than drafter layers splits the drafter over groups.
                raise ValueError(
                    f"a hybrid target of {self.target_layers} layers has {attention} attention "
                    f"layers, fewer than the drafter's {len(self.drafter_layer_types)}"
                )
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    "linear_num_value_heads must be a multiple of linear_num_key_heads"
                )
        for k in (*self.reference_speculative_tokens, self.floor_speculative_tokens):
            if not 0 <= k < self.block_size:
                raise ValueError(
                    f"{k} drafted tokens: a block of {self.block_size} drafts 0 to "
                    f"{self.block_size - 1}"
                )
        if self.min_acceptance_length and not self.floor_speculative_tokens:
            raise ValueError("min_acceptance_length needs floor_speculative_tokens")

    def drafter_cap_s(self, left_s: float) -> float:
        """The drafter's time cap where ``left_s`` of the wall budget is left after its
        reserve. With an acceptance floor the drafter trains its whole cap, over the budget if
        need be: on a slower GPU the stages before it spend the budget, and a drafter cut
        short fails the floor, so the run writes no pair for all its target's training.
        Without a floor the drafter yields to the budget, down to a quarter of its cap."""
        if self.min_acceptance_length:
            return self.drafter_time_cap_s
        return min(self.drafter_time_cap_s, max(left_s, 0.25 * self.drafter_time_cap_s))

    @property
    def speculative_tokens(self) -> tuple[int, ...]:
        """Every K the reference measures, block_size - 1 first."""
        ks = [self.block_size - 1, *self.reference_speculative_tokens]
        if self.floor_speculative_tokens:
            ks.append(self.floor_speculative_tokens)
        return tuple(dict.fromkeys(ks))


PRESETS: dict[str, RecipeConfig] = {
    "full": RecipeConfig(),
    # A tiny end-to-end run for CPU tests: every stage, about half a minute.
    "smoke": RecipeConfig(
        heldout_fraction=0.2,
        draft_fraction=0.2,
        max_files=70,
        max_file_bytes=40_000,
        vocab_size=400,
        target_layers=4,
        hidden_size=64,
        target_intermediate=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        target_seq_len=64,
        target_batch=8,
        target_max_steps=20,
        target_lr=3e-3,
        target_time_cap_s=120.0,  # generous: the steps, not the clock, should end it
        eval_tokens=1024,
        data_prompt_len=32,
        data_gen_len=16,
        data_sequences=32,
        data_time_cap_s=60.0,
        gen_batch=16,
        feature_batch=16,
        data_eval_sequences=8,
        sliding_window=8,
        target_layer_ids=(0, 1, 2),
        drafter_intermediate=128,
        drafter_steps=20,
        drafter_batch=8,
        anchors_per_seq=8,
        min_anchor=4,
        drafter_lr=3e-3,
        drafter_time_cap_s=120.0,
        log_every=4,
        num_prompts=2,
        prompt_len=32,
        max_new_tokens=16,
        crosscheck_prompts=2,
        lossless_candidates=3,
        wall_budget_s=400.0,
        reserve_s=20.0,
    ),
    # The seed's family on one H200: Qwen3.6-27B's head geometry (gated attention 24 x 256 over
    # 4 KV heads; Gated DeltaNet 16 key and 48 value heads of 128) on 24 layers (6 attention),
    # narrowed in width; z-lab's drafter layout ([sliding x4, full], 32 x 128 heads over 8 KV
    # heads, another KV shape than the target's) with target_layer_ids spread over the depth
    # as the seed's [1, 16, 31, 46, 61] are over 64, and blocks of 16 (K up to 15).
    "hybrid": RecipeConfig(
        arch="hybrid",
        target_layers=24,
        hidden_size=512,
        target_intermediate=1536,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        # Small batches: without flash-linear-attention's kernels, transformers' reference
        # Gated DeltaNet keeps every chunk's state for the backward pass.
        target_batch=8,
        target_time_cap_s=150.0,
        target_extra_time_s=120.0,
        data_sequences=8192,
        data_time_cap_s=45.0,
        gen_batch=128,
        feature_batch=128,
        drafter_layer_types=(*("sliding_attention",) * 4, "full_attention"),
        sliding_window=64,
        target_layer_ids=(1, 6, 11, 16, 21),
        block_size=16,
        drafter_intermediate=1536,
        draft_num_heads=32,
        draft_num_kv_heads=8,
        draft_head_dim=128,
        drafter_batch=32,
        anchors_per_seq=32,
        loss_gamma=7.0,
        drafter_time_cap_s=100.0,
        drafter_min_steps=300,
        num_prompts=16,
        crosscheck_prompts=0,
        reference_speculative_tokens=(7,),
        min_target_margin=1.0,
        min_acceptance_length=3.0,
        floor_speculative_tokens=7,
        wall_budget_s=840.0,
        reserve_s=90.0,
    ),
}
# The hybrid recipe at CPU size: every stage, the floors' code paths with floors of zero.
PRESETS["hybrid-smoke"] = replace(
    PRESETS["smoke"],
    arch="hybrid",
    max_position_embeddings=256,
    lossless_new_tokens=8,
    target_layers=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_head_dim=16,
    drafter_layer_types=("sliding_attention", "full_attention"),
    target_layer_ids=(1, 3, 5),
    block_size=8,
    draft_num_heads=4,
    draft_num_kv_heads=2,
    draft_head_dim=32,
    reference_speculative_tokens=(3,),
    floor_speculative_tokens=3,
    crosscheck_prompts=0,
)


#: Sizes and counts a run cannot do without (the other numbers may be 0: none, or off).
POSITIVE = frozenset(
    {
        "vocab_size",
        "target_layers",
        "hidden_size",
        "target_intermediate",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
        "target_seq_len",
        "target_batch",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_head_dim",
        "eval_tokens",
        "data_prompt_len",
        "data_gen_len",
        "data_sequences",
        "gen_batch",
        "feature_batch",
        "data_eval_sequences",
        "sliding_window",
        "block_size",
        "drafter_intermediate",
        "drafter_steps",
        "drafter_batch",
        "anchors_per_seq",
        "num_prompts",
        "prompt_len",
        "max_new_tokens",
        "lossless_new_tokens",
        "lossless_candidates",
        "log_every",
        "max_file_bytes",
        "wall_budget_s",
    }
)


def _numbers(value: Any) -> tuple[Any, ...]:
    """A setting's numbers: itself, or a tuple's items (no bools, no strings)."""
    items = value if isinstance(value, tuple) else (value,)
    return tuple(v for v in items if isinstance(v, int | float) and not isinstance(v, bool))


def _convert(raw: str, annotation: Any) -> Any:
    """``raw`` as the field's type (int, float, str, optional int, tuple of int or str)."""
    text = str(annotation)
    if "None" in text and raw.lower() in ("none", "null", ""):
        return None
    if text.startswith("tuple"):
        items = [s.strip() for s in raw.split(",") if s.strip()]
        return tuple(int(s) for s in items) if "int" in text else tuple(items)
    if "float" in text:
        return float(raw)
    if "int" in text:
        return int(raw)
    return raw


def apply_overrides(cfg: RecipeConfig, pairs: list[str]) -> RecipeConfig:
    """A copy of ``cfg`` with ``key=value`` pairs applied (tuples as comma lists)."""
    hints = typing.get_type_hints(RecipeConfig)
    names = {f.name for f in fields(RecipeConfig)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY one of the settings")
        try:
            changes[key] = _convert(raw.strip(), hints[key])
        except ValueError:
            hint = hints[key]
            kind = hint.__name__ if isinstance(hint, type) else str(hint)
            raise ValueError(f"--set {pair!r}: {key} takes {kind}") from None
    return replace(cfg, **changes)


def recipe_digest(cfg: RecipeConfig, corpus_digest: str, code_digest: str) -> str:
    """The 16-hex-digit name of a run's output folder."""
    h = hashlib.sha256()
    for part in (cfg.digest_material(), corpus_digest, code_digest):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


#: ``--arch``'s presets: the GPU recipe and its CPU-sized smoke, per architecture.
ARCH_PRESETS = {
    "qwen3": {"full": "full", "smoke": "smoke"},
    "hybrid": {"full": "hybrid", "smoke": "hybrid-smoke"},
}
