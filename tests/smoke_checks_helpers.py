"""What the smoke-check tests share: a tiny drafter's config and the windows stock vLLM
0.20.1 gives its layers, as measured on an H200 (upstream-notes section 7)."""

from __future__ import annotations

TINY_DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 16,
    "use_sliding_window": True,
    "max_window_layers": 3,
    "num_target_layers": 8,
    "block_size": 4,
    "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 2047, "block_size": 4},
}
STOCK_WINDOWS = [
    {"layer": f"model.layers.{i}.self_attn.attn", "window": [-1, -1]} for i in range(3)
]
