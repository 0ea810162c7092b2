"""Seconds of checks on tiny random models before minutes of training.

They catch an API mismatch with the installed transformers or dflash, or a
training forward that no longer reproduces the reference, before the GPU
time is spent.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ..errors import TrainingError
from .common import Log
from .config import RecipeConfig
from .drafter import build_drafter, check_equivalence, drafter_config
from .hybrid import FULL_ATTENTION_INTERVAL
from .reference_accept import dflash_loop_supported, dflash_run, minimal_run
from .target import build_target, target_config
from .torchutil import cast_parameters

logger = logging.getLogger(__name__)


def preflight(cfg: RecipeConfig, device: torch.device, log: Log) -> dict[str, Any]:
    """Check the training forward and both reference loops on tiny random models.

    Seconds of work that catch an API mismatch before minutes of training.
    Returns the equivalence error and the loops' agreement; raises if the
    multi-block forward does not reproduce the reference forward.
    """
    # The recipe's architecture and layer ids at toy width: a hybrid target needs a
    # gated attention layer for each drafter layer (RecipeConfig.validate).
    layers = max(cfg.target_layer_ids) + 2
    if cfg.arch == "hybrid":
        layers = max(layers, FULL_ATTENTION_INTERVAL * len(cfg.drafter_layer_types))
    tiny = replace(
        cfg,
        vocab_size=256,
        target_layers=layers,
        hidden_size=64,
        target_intermediate=128,
        num_heads=2,
        num_kv_heads=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_head_dim=16,
        draft_num_heads=4 if cfg.draft_num_heads else 0,
        draft_num_kv_heads=2 if cfg.draft_num_kv_heads else 0,
        draft_head_dim=cfg.draft_head_dim // 4 if cfg.draft_head_dim else 0,
        max_position_embeddings=512,
        sliding_window=min(cfg.sliding_window, 8),
        drafter_intermediate=128,
    )
    tconf = target_config(tiny, tiny.vocab_size)
    target = build_target(tconf, 1234, device).eval()
    drafter = build_drafter(drafter_config(tiny, tconf, 1), 1235, device).eval()
    gen = torch.Generator(device="cpu").manual_seed(7)
    ctx_len, blocks = 40, 5
    ctx = torch.randn(2, ctx_len, len(cfg.target_layer_ids) * 64, generator=gen).to(device)
    noise = torch.randn(2, blocks * cfg.block_size, 64, generator=gen).to(device)
    anchors = torch.stack(
        [torch.randperm(ctx_len - 12, generator=gen)[:blocks] + 12 for _ in range(2)]
    ).to(device)
    diff = check_equivalence(drafter, ctx, noise, anchors)
    if not diff < 1e-3:
        raise TrainingError(f"preflight: multi-block forward differs from the reference by {diff}")
    # The same in bf16, where the masked and unmasked paths may pick other attention kernels:
    # only rounding may differ (a broken kernel would be off by O(1)).
    cast_parameters(drafter, torch.bfloat16)
    diff_bf16 = check_equivalence(drafter, ctx.bfloat16(), noise.bfloat16(), anchors)
    cast_parameters(drafter, torch.float32)
    if not diff_bf16 < 1.0:
        raise TrainingError(f"preflight: in bf16 the multi-block forward differs by {diff_bf16}")
    prompt = torch.randint(2, 256, (24,), generator=gen).tolist()
    supported = dflash_loop_supported(cfg.arch)
    minimal = minimal_run(target, drafter, prompt, 12)
    agree = None
    if supported:
        ref = dflash_run(target, drafter, prompt, 12)
        agree = ref.output_ids == minimal.output_ids
    else:
        log(
            logger,
            "preflight: dflash_generate cannot run here (a hybrid target's recurrent state "
            "cannot be cut back, or this transformers lacks "
            "DynamicCache.activate_past_recording); the reference acceptance will use the "
            "minimal uncached loop",
        )
    log(
        logger,
        f"preflight: multi-block vs reference forward max |diff| {diff:.2e} "
        f"(bf16 {diff_bf16:.2e}); "
        f"dflash loop {'runs' if supported else 'unavailable'}"
        + (f", agrees with minimal loop: {agree}" if agree is not None else ""),
    )
    return {
        "equivalence_max_abs_diff": diff,
        "equivalence_bf16_max_abs_diff": diff_bf16,
        "dflash_loop_supported": supported,
        "tiny_loops_agree": agree,
    }
