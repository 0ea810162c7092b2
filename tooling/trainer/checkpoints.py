"""Loading saved models the way vLLM and the reference do, and checking what was saved."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from dflash.model import DFlashDraftModel
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..errors import TrainingError
from .common import Log

logger = logging.getLogger(__name__)


def load_target(path: Path, device: torch.device) -> nn.Module:
    """The saved target, as vLLM and the reference load it: bf16, eval, frozen; as the class
    its config names (the auto class would load a multimodal hybrid as its text model alone)."""
    config = AutoConfig.from_pretrained(path)
    cls = getattr(transformers, (config.architectures or [""])[0], AutoModelForCausalLM)
    model = cls.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_drafter(path: Path, device: torch.device) -> DFlashDraftModel:
    """The saved drafter through ``DFlashDraftModel.from_pretrained``: bf16, eval, frozen."""
    model = DFlashDraftModel.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models hold bit-identical parameters and persistent buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def check_saved(
    target_dir: Path, drafter_dir: Path, drafter: nn.Module, tok: Tokenizer, log: Log
) -> dict[str, Any]:
    """What was saved: drafter checkpoint keys and windows, tokenizer reload. Returns the facts."""
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
        drafter_keys = sorted(f.keys())
    hf_tok = AutoTokenizer.from_pretrained(target_dir)
    sample = "def main(argv):\n    return 0\n"
    info = {
        "drafter_layer_windows": [layer.self_attn.sliding_window for layer in drafter.layers],
        "drafter_checkpoint_keys": len(drafter_keys),
        "drafter_has_embeddings": any("embed" in k or "lm_head" in k for k in drafter_keys),
        "tokenizer_class": type(hf_tok).__name__,
        "tokenizer_roundtrip": hf_tok.encode(sample, add_special_tokens=False)
        == tok.encode(sample, add_special_tokens=False).ids,
    }
    log(logger, f"saved: {info}")
    if not info["tokenizer_roundtrip"]:
        raise TrainingError(f"the saved tokenizer does not encode like the trained one: {info}")
    return info
