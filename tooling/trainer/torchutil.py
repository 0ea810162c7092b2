"""Torch helpers shared by the target and drafter stages."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pick_device(name: str | None) -> torch.device:
    """``name`` if given, else the first CUDA device, else the CPU."""
    if name:
        return torch.device(name)
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def amp(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on the device (CPU too, so a CPU run takes the GPU's code path)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def make_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (fused on CUDA) decaying matrices only: not norms, biases or embeddings."""
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else keep).append(p)
    on_cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=on_cuda,
    )


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only; buffers (RoPE's fp32 inv_freq) keep their dtype, as
    ``from_pretrained(dtype=...)`` leaves them."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate."""
    for group in opt.param_groups:
        group["lr"] = lr


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def sync(device: torch.device) -> None:
    """Wait for the device, so wall-clock phase timings are true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode for the block, restored afterwards."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)
