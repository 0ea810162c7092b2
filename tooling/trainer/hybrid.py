"""The config of a ``Qwen3_5ForConditionalGeneration``, the seed's hybrid family, as plain data.

Standard library only: the trainer builds its hybrid target from it, and the smoke's
generated pairs (``smoke/serving/tiny.py``) write theirs with it.
"""

from __future__ import annotations

import math
from typing import Any

#: Every fourth layer is gated full attention, the others Gated DeltaNet, as in Qwen3.6.
FULL_ATTENTION_INTERVAL = 4
#: Qwen3.6 rotates a quarter of each attention head.
PARTIAL_ROTARY_FACTOR = 0.25


def mrope_section(head_dim: int) -> list[int]:
    """Interleaved M-RoPE sections over the rotated half-dimensions (Qwen3.6's is [11, 11, 10]
    for its 256-wide heads): the first two take the larger share."""
    rotated = int(head_dim * PARTIAL_ROTARY_FACTOR) // 2
    first = math.ceil(rotated / 3)
    return [first, first, rotated - 2 * first]


def layer_types(layers: int) -> list[str]:
    """The layer pattern: three Gated DeltaNet layers, then one gated attention layer."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(layers)
    ]


def hybrid_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    layers: int,
    attention: tuple[int, int, int],
    linear: tuple[int, int, int],
    max_position_embeddings: int,
    eos_token_id: int = 0,
) -> dict[str, Any]:
    """``Qwen3_5Config`` arguments: the text model and a tiny vision tower nothing feeds.

    ``attention`` is (query heads, KV heads, head dim); ``linear`` the Gated DeltaNet's
    (key heads, value heads, head dim). vLLM serves the result with ``--language-model-only``;
    the multimodal token ids are reserved ids at the top of the vocabulary.
    """
    heads, kv_heads, head_dim = attention
    linear_keys, linear_values, linear_dim = linear
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim,
        linear_num_key_heads=linear_keys,
        linear_num_value_heads=linear_values,
        full_attention_interval=FULL_ATTENTION_INTERVAL,
        layer_types=layer_types(layers),
        max_position_embeddings=max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            "mrope_section": mrope_section(head_dim),
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=hidden_size,
        num_position_embeddings=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    reserved = vocab_size - 5
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config=text,
        vision_config=vision,
        image_token_id=reserved,
        video_token_id=reserved + 1,
        vision_start_token_id=reserved + 2,
        vision_end_token_id=reserved + 3,
        tie_word_embeddings=False,
    )
