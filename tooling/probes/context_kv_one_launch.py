"""Fix 37: the DFlash drafter's context K/V is normed, rotated and cached in one launch.

Each step the drafter turns the target's hidden states into K/V for every one of its layers.
vLLM 0.20.1 projects them in one GEMM, then per layer norms K (an RMSNorm launch) and writes
K and V into that layer's cache (a cache-insert launch), beside a layer-major copy, a repeat
of the positions and one RoPE launch: two launches a layer and a few more at every step,
whatever the batch.

The probe builds the tree's DFlash drafter model (``DFlashQwen3ForCausalLM``, two layers of
the tiny pair's drafter) on the CPU, in float16 so that a float's rounding is the same in
both paths, gives each layer a FlashAttention cache of its own and asks it to store the
context of ``TOKENS`` tokens at scattered slots, one of them the padding slot (-1). vLLM's
three CUDA kernels the stock path calls (RMSNorm, RoPE, the cache insert) run as the
torch operations they compute, each counted as one launch; a Triton kernel runs in Triton's
interpreter, counted as one. The caches are then checked against the K/V computed here
with vLLM's rounding (the normed K rounded before its weight is applied and after, each RoPE
product rounded before the sum).

Present: every cache row is right, nothing is written for the padding slot, and the store
launched no per-layer kernel (one RMSNorm, the hidden states', and no cache insert).
Absent: right, with a cache insert a layer. Unknown: a row wrong, or the drafter could not
be built or run.
"""

from __future__ import annotations

import contextlib
from typing import Any

from . import _harness
from ._interpreted import interpreted_or_unknown
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "context_kv_one_launch"
TOKENS = 9
BLOCK = 16
BLOCKS = 6
#: The token whose slot is the padding slot: its K/V is written nowhere.
PADDED = 4


def _reference_rms(out: Any, x: Any, weight: Any, eps: float) -> None:
    """vLLM's rms_norm kernel: float32 variance, the normed value rounded to the input's
    dtype, then multiplied by the weight in that dtype. A weight of two dimensions is one
    row for each index of ``x``'s outermost dimension (0.34.0's grouped RMSNorm)."""
    import torch

    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if w.dim() == 2:
        w = w.view(w.shape[0], *[1] * (x.dim() - 2), w.shape[1])
    out.copy_(((xf * inv).to(x.dtype).float() * w).to(x.dtype))


def _reference_rope(
    positions: Any, query: Any, key: Any, head_size: int, cache: Any, is_neox: bool
) -> None:
    """vLLM's rotary_embedding kernel on ``query`` in place (``key`` None, as DFlash calls
    it): each product rounded to the dtype before the sum."""
    import torch

    dt = query.dtype
    rot = cache.shape[-1]
    half = rot // 2
    heads = query.view(query.shape[0], -1, head_size)
    cos = cache[positions, :half].float()[:, None, :]
    sin = cache[positions, half:].float()[:, None, :]
    xi = torch.arange(half) if is_neox else 2 * torch.arange(half)
    yi = xi + half if is_neox else xi + 1
    x, y = heads[..., xi].float(), heads[..., yi].float()

    def r(t: Any) -> Any:
        return t.to(dt).float()

    heads[..., xi] = (r(x * cos) - r(y * sin)).to(dt)
    heads[..., yi] = (r(y * cos) + r(x * sin)).to(dt)


def _drafter_model(config: Any) -> Any:
    """The tree's DFlash drafter model for ``config``, float16, its weights drawn."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    # A DFlash drafter is built on the engine's own config (no kernel overrides without an
    # MoE backend), by either runner.
    _harness.ensure_single_process_group(config)
    with set_current_vllm_config(config):
        model = initialize_model(config, model_config=config.speculative_config.draft_model_config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    model = model.half()
    model.model._build_fused_kv_buffers()
    return model


def stored() -> dict[str, Any]:
    """What the tree's drafter writes of the probe's context, the K/V expected, and the
    launches it made (run where Triton interprets)."""
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    model = _drafter_model(_harness.vllm_config(pair, num_speculative_tokens=3))
    inner = model.model
    layers = inner._attn_layers
    nkv, hd = inner._num_kv_heads, inner._head_dim
    for attn in layers:
        attn.kv_cache = torch.zeros(2, BLOCKS, BLOCK, nkv, hd, dtype=torch.float16)
    launches = {"rms_norm": 0, "rotary_embedding": 0, "cache_insert": 0, "triton": 0}

    def rms(*args: Any) -> None:
        launches["rms_norm"] += 1
        _reference_rms(*args)

    def rope(*args: Any) -> None:
        launches["rotary_embedding"] += 1
        _reference_rope(*args)

    def insert(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> None:
        launches["cache_insert"] += 1
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                kv_cache[0, slot // BLOCK, slot % BLOCK] = key[t]
                kv_cache[1, slot // BLOCK, slot % BLOCK] = value[t]

    import vllm.model_executor.models as models_package

    # The fixed tree's kernel module (stock has none): the kernels it launches counted; their
    # helpers are called inside them.
    module = getattr(models_package, "dflash_context_kv", None)
    launched = {
        attr: _CountedKernel(value, launches)
        for attr, value in (vars(module) if module else {}).items()
        if attr.endswith("_kernel")
        and type(value).__name__ in ("JITFunction", "InterpretedFunction")
    }
    counted = _harness.replaced(module, **launched) if module else contextlib.nullcontext()
    generator = torch.Generator().manual_seed(7)
    states = torch.randn(TOKENS, inner._hidden_norm_weight.shape[0], generator=generator)
    states = states.half()
    positions = torch.randint(0, 200, (TOKENS,), generator=generator)
    slots = torch.randperm(BLOCKS * BLOCK, generator=generator)[:TOKENS]
    slots[PADDED] = -1
    with (
        _harness.replaced(ops, rms_norm=rms, rotary_embedding=rope),
        _harness.replaced(FlashAttentionImpl, do_kv_cache_update=insert),
        counted,
        torch.no_grad(),
    ):
        inner.precompute_and_store_context_kv(states, positions, slots)
    return {
        "layers": len(layers),
        "launches": launches,
        "wrong": _wrong(inner, states, positions, slots),
    }


class _CountedKernel:
    """A Triton kernel launched as it is, each launch counted."""

    def __init__(self, kernel: Any, launches: dict[str, int]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.launches["triton"] += 1
            return launch(*args, **kwargs)

        return counted


def _wrong(inner: Any, states: Any, positions: Any, slots: Any) -> list[str]:
    """Each layer's cache rows that differ from the K/V computed here with vLLM's rounding,
    and any row written for the padding slot."""
    import torch

    layers = inner._attn_layers
    nkv, hd = inner._num_kv_heads, inner._head_dim
    normed = torch.empty_like(states)
    _reference_rms(normed, states, inner._hidden_norm_weight, inner._rms_norm_eps)
    kv = torch.nn.functional.linear(normed, inner._fused_kv_weight, inner._fused_kv_bias)
    kv = kv.view(states.shape[0], len(layers), 2, nkv, hd)
    wrong = []
    for i, attn in enumerate(layers):
        k = torch.empty_like(kv[:, i, 0])
        _reference_rms(k, kv[:, i, 0], inner._k_norm_weights[i], inner._rms_norm_eps)
        flat = k.reshape(k.shape[0], -1)
        _reference_rope(positions, flat, None, hd, inner._rope_cos_sin_cache, inner._rope_is_neox)
        cache = attn.kv_cache
        written = cache.reshape(2, -1, nkv, hd).abs().sum((0, 2, 3)) > 0
        expected_rows = {int(s) for s in slots.tolist() if s >= 0}
        if {int(r) for r in written.nonzero().flatten().tolist()} != expected_rows:
            wrong.append(f"layer {i}: rows written other than the context's slots")
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            row = cache[:, slot // BLOCK, slot % BLOCK]
            if not torch.equal(row[0], flat[t].view(nkv, hd)):
                wrong.append(f"layer {i} token {t}: K differs")
            if not torch.equal(row[1], kv[t, i, 1]):
                wrong.append(f"layer {i} token {t}: V differs")
    return wrong


def run() -> ProbeResult:
    found = interpreted_or_unknown(NAME, "stored", "the drafter could not store a context")
    if isinstance(found, ProbeResult):
        return found
    launches, layers = found["launches"], found["layers"]
    evidence = (
        f"a context of {TOKENS} tokens (one at the padding slot) for a drafter of {layers} "
        f"layers: launches {launches}"
    )
    if found["wrong"]:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"the caches are wrong ({'; '.join(found['wrong'][:4])}): {evidence}",
            details=found,
        )
    one = launches["cache_insert"] == 0 and launches["rms_norm"] <= 1
    return ProbeResult(
        probe=NAME,
        status=PRESENT if one else ABSENT,
        evidence=f"every cache row right; {evidence}",
        details=found,
    )
