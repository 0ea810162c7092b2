"""Patch 37's kernel against vLLM's own, on the GPU: the drafter's context K/V written into
each layer's cache by ``ContextKVWriter`` and by the kernels it replaces (vLLM's RMSNorm a
layer, its RoPE, its cache insert a layer), compiled, on the same inputs.

On the CPU the kernel only runs in Triton's interpreter, which truncates to bfloat16 and
misrounds some float8 values, and vLLM's CUDA kernels do not run at all. Here both run as
users run them. Each case gives the largest distance between the two caches in steps of the
cache's own format at each head row's scale (its largest magnitude), how many elements differ,
and whether any row outside the context's slots was written. It also gives each path's host
time a call (launches and Python, no sync), which the check does not judge.

A case passes when every element is within the rounding the two paths may differ by
(``_steps_apart``) and nothing outside its slots was written.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any

from .kernel_timing import drain, host_us

logger = logging.getLogger(__name__)

#: At most this many steps of K/V's dtype apart, at a head row's scale: the two paths reduce
#: K's squares in different orders, so a normed value may sit a step apart (one for x, one
#: for y), and each path rounds RoPE's two products and their sum on its own (three more).
TOLERANCE_STEPS = 5


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    neox: bool
    dtype: str
    cache: str
    """vLLM's kv_cache_dtype: "auto" (the K/V dtype) or "fp8" (e4m3)."""
    tokens: int
    block_size: int


#: The seed's drafter (z-lab's Qwen3.6-27B DFlash: 5 layers, 8 KV heads of 128, NeoX RoPE over
#: the whole head, bfloat16, 480-token blocks in the hybrid engine) at one request and K = 15
#: (16 context tokens) and at 64 requests, then the formats and layouts users change.
CASES = (
    Case("seed-1", 5, 8, 128, 128, True, "bfloat16", "auto", 16, 480),
    Case("seed-64", 5, 8, 128, 128, True, "bfloat16", "auto", 1024, 480),
    Case("seed-64-fp8", 5, 8, 128, 128, True, "bfloat16", "fp8", 1024, 480),
    Case("float16", 5, 8, 128, 128, True, "float16", "auto", 1024, 16),
    Case("float16-fp8", 5, 8, 128, 128, True, "float16", "fp8", 1024, 16),
    Case("partial-gptj", 3, 4, 256, 64, False, "bfloat16", "auto", 300, 16),
)


@dataclass
class Outcome:
    case: str
    worst_steps: float
    """In steps of the cache's format at the head row's scale."""
    within: bool
    differing: int
    elements: int
    stray_rows: int
    stock_host_us: float
    fused_host_us: float

    @property
    def ok(self) -> bool:
        return self.within and self.stray_rows == 0


def _cos_sin(rotary_dim: int, positions: int, dtype: Any, device: Any) -> Any:
    import torch

    inv = 1.0 / (1e7 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


def _layers(case: Case, blocks: int, device: Any) -> list[Any]:
    import torch

    shape = (2, blocks, case.block_size, case.kv_heads, case.head_dim)
    dtype = torch.uint8 if case.cache == "fp8" else getattr(torch, case.dtype)
    return [
        types.SimpleNamespace(
            kv_cache=torch.zeros(shape, dtype=dtype, device=device),
            _k_scale=torch.tensor([0.25 + 0.5 * i], device=device),
            _v_scale=torch.tensor([0.75], device=device),
            kv_cache_dtype=case.cache,
        )
        for i in range(case.layers)
    ]


def _stock(
    case: Case,
    layers: list[Any],
    weights: list[Any],
    all_kv: Any,
    positions: Any,
    slots: Any,
    cos_sin: Any,
) -> None:
    """What vLLM 0.20.1's DFlash model does: its copy, RMSNorm a layer, RoPE, an insert a layer."""
    from vllm import _custom_ops as ops

    n, L, nkv, hd = all_kv.shape[0], case.layers, case.kv_heads, case.head_dim
    kv = all_kv.view(n, L, 2, nkv, hd).permute(2, 1, 0, 3, 4).contiguous()
    k, v = kv[0], kv[1]
    normed = k.new_empty(k.shape)
    for i in range(L):
        ops.rms_norm(normed[i], k[i], weights[i], 1e-6)
    flat = normed.view(L * n, nkv * hd)
    ops.rotary_embedding(positions.repeat(L), flat, None, hd, cos_sin, case.neox)
    for i, layer in enumerate(layers):
        key_cache, value_cache = layer.kv_cache.unbind(0)
        ops.reshape_and_cache_flash(
            normed[i],
            v[i],
            key_cache,
            value_cache,
            slots,
            case.cache,
            layer._k_scale,
            layer._v_scale,
        )


#: Mantissa bits of each format: one step at a value's scale is 2^(exponent - bits).
_MANTISSA = {"bfloat16": 7, "float16": 10, "fp8": 3}


def _values(cache: Any) -> Any:
    """The cache's elements as float32, fp8 codes decoded (unscaled: steps count alike)."""
    import torch

    if cache.dtype == torch.uint8:
        return cache.view(torch.float8_e4m3fn).float()
    return cache.float()


def _step(x: Any, bits: int) -> Any:
    """One step of a format with ``bits`` mantissa bits at the scale of ``x`` (> 0)."""
    import torch

    return torch.exp2(torch.floor(torch.log2(x)) - bits)


def _steps_apart(case: Case, a: Any, b: Any) -> tuple[float, int, bool]:
    """Largest distance in steps of the cache's format at each head row's scale, how many
    elements differ, and whether every element is within the bound.

    A RoPE output can be a near-cancellation of two products, so counting adjacent values
    at the output's own magnitude makes a rounding of the products look like thousands
    of steps. The bound is at the row's largest magnitude instead (the rotation keeps a
    pair's norm): both paths round the normed K, each of RoPE's two products and their
    sum once, from normed values that may sit a step apart, so at most TOLERANCE_STEPS
    steps of K/V's dtype; an fp8 cache adds its own conversion, one step of fp8."""
    import torch

    x, y = _values(a), _values(b)
    scale = torch.maximum(x.abs().amax(-1, keepdim=True), y.abs().amax(-1, keepdim=True))
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    cache_step = _step(scale, _MANTISSA["fp8" if case.cache == "fp8" else case.dtype])
    bound = TOLERANCE_STEPS * _step(scale, _MANTISSA[case.dtype])
    if case.cache == "fp8":
        bound = bound + cache_step
    gap = (x - y).abs()
    return float((gap / cache_step).max()), int((a != b).sum()), bool((gap <= bound).all())


#: Faults the check must find, each made on vLLM's side of a case: the rotation turned the
#: other way, and every position one later. A check that passed them could not fail.
CONTROLS = ("sine negated", "positions one later")


def _faulty(control: str | None, positions: Any, cos_sin: Any) -> tuple[Any, Any]:
    """The positions and rotary cache vLLM's side is given under ``control``."""
    import torch

    if control is None:
        return positions, cos_sin
    if control == "sine negated":
        half = cos_sin.shape[-1] // 2
        return positions, torch.cat((cos_sin[:, :half], -cos_sin[:, half:]), dim=-1)
    if control == "positions one later":
        return (positions + 1) % cos_sin.shape[0], cos_sin
    raise ValueError(f"no control {control!r}")


def run_case(case: Case, device: Any, control: str | None = None) -> Outcome:
    """``case`` on both paths; with ``control``, vLLM's side given that fault (``CONTROLS``)."""
    import torch
    from vllm.model_executor.models.dflash_context_kv import ContextKVWriter

    logger.debug("context K/V case %s%s", case.name, f" ({control})" if control else "")

    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device="cpu").manual_seed(case.tokens * 7 + case.layers)
    width = case.layers * 2 * case.kv_heads * case.head_dim
    all_kv = (torch.randn(case.tokens, width, generator=g) * 4).to(dtype).to(device)
    weights = [
        (1 + torch.randn(case.head_dim, generator=g) / 4).to(dtype).to(device)
        for _ in range(case.layers)
    ]
    blocks = case.tokens // case.block_size + 3
    slots = torch.randperm(blocks * case.block_size, generator=g)[: case.tokens]
    slots[1] = -1  # the padding slot: written nowhere
    slots = slots.to(device)
    positions = torch.randint(0, 8192, (case.tokens,), generator=g).to(device)
    cos_sin = _cos_sin(case.rotary_dim, 8192, dtype, device)

    stock, fused = _layers(case, blocks, device), _layers(case, blocks, device)
    stock_positions, stock_cos_sin = _faulty(control, positions, cos_sin)
    _stock(case, stock, weights, all_kv, stock_positions, slots, stock_cos_sin)
    writer = ContextKVWriter(fused, weights, 1e-6, case.kv_heads, case.head_dim, case.neox)
    writer.write(all_kv, positions, slots, cos_sin)
    drain()

    worst, differing, elements, within = 0.0, 0, 0, True
    for a, b in zip(stock, fused, strict=True):
        apart, count, inside = _steps_apart(case, a.kv_cache, b.kv_cache)
        worst, differing = max(worst, apart), differing + count
        within, elements = within and inside, elements + a.kv_cache.numel()
    live = torch.zeros(blocks * case.block_size, dtype=torch.bool, device=device)
    live[slots[slots >= 0]] = True
    stray = 0
    for layer in fused:
        rows = layer.kv_cache.reshape(2, blocks * case.block_size, -1)
        stray += int(((rows != 0).any(-1).any(0) & ~live).sum())
    return Outcome(
        case.name,
        worst,
        within,
        differing,
        elements,
        stray,
        host_us(lambda: _stock(case, stock, weights, all_kv, positions, slots, cos_sin)),
        host_us(lambda: writer.write(all_kv, positions, slots, cos_sin)),
    )
