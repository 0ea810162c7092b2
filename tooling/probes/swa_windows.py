"""Fix 2: each DFlash drafter layer attends as the reference does, in its ``layer_types`` window.

Builds the DFlash drafter model with vLLM's own loader path (real
SpeculativeConfig over a drafter config.json with ``layer_types`` [sliding,
sliding, full] and ``sliding_window`` 16) on the FLASH_ATTN backend, then runs
each drafter layer's attention forward on the CPU with the metadata DFlash's
proposer gives it, built by the backend's own metadata builder from the layer's
own KV-cache spec. FlashAttention's varlen function (a CUDA kernel) is recorded
instead of run: the (window, causal) pair it receives is the attention the
drafter computes, whatever the static window says (from 0.25 the builder puts a
window of its own in the metadata and symmetrises it for non-causal queries).

The reference (``dflash`` 0.1.0) makes a sliding layer causal within the window
(a query sees keys at most 15 before it and none after) and a full layer
bidirectional. The fix is present when the effective masks are exactly that.
The KV specs tell the form: one full-attention group (compute-only window, what
V1's DFlash path supports) or per-layer sliding specs (a multi-group runner).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, ProbeResult

NAME = "swa_windows"
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
WINDOW = 16
SM90_FA_VERSION = 3


def expected_masks() -> list[tuple[int, int]]:
    """(keys visible before, keys visible after) each query; -1 is unbounded."""
    return [(WINDOW - 1, 0) if t == "sliding_attention" else (-1, -1) for t in LAYER_TYPES]


def effective_mask(window: list[int] | tuple[int, int] | None, causal: bool) -> tuple[int, int]:
    """What FlashAttention attends to for ``window_size`` and ``causal``.

    A causal call sees no key after the query whatever the window's right side.
    """
    left, right = tuple(window) if window is not None else (-1, -1)
    return (left, 0 if causal else right)


def _layer_causal(config: Any, model: Any) -> list[bool] | None:
    """Per-layer causal flags the runner gives the drafter where they are not the proposer's.

    V2's DFlash speculator (0.26+) builds one metadata per KV-cache group with
    the causality the model reports for its layers (``get_draft_attn_causal``);
    before that (0.24, 0.25) one causality for every layer, the drafter config's
    ``dflash_config.causal``; V1's proposer builds one metadata for all layers
    (None here).
    """
    # 0.34.0 has the V2 runner alone, and no flag for it.
    if _harness.serves_v1(config):
        return None
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    if hasattr(DFlashQwen3ForCausalLM, "get_draft_attn_causal"):
        return list(DFlashQwen3ForCausalLM.get_draft_attn_causal(SimpleNamespace(model=model)))
    from vllm.v1.worker.gpu.spec_decode.dflash.utils import get_dflash_causal

    causal = get_dflash_causal(config.speculative_config.draft_model_config)
    return [bool(causal)] * len(model.layers)


def _kv_cache(backend: Any, spec: Any, impl: Any) -> Any:
    """A zeroed four-block KV cache in the layout this release's backend reads."""
    import torch

    if hasattr(backend, "get_kv_cache_shape"):
        shape = backend.get_kv_cache_shape(4, spec.block_size, impl.num_kv_heads, impl.head_size)
        return torch.zeros(shape, dtype=spec.dtype)
    # 0.33 sizes every layer's cache from its spec, in bytes.
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    shape = compute_layer_kv_cache_shape_bytes(spec, 4)
    return torch.zeros(shape, dtype=torch.uint8).view(spec.dtype)


def _record_forward(config: Any, attn: Any, metadata: Any) -> dict[str, Any]:
    """Run ``attn``'s backend forward once on ``metadata``; what FlashAttention was asked."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import flash_attn

    spec = attn.get_kv_cache_spec(config)
    backend = attn.attn_backend
    with set_current_vllm_config(config):
        builder = backend.get_builder_cls()(spec, [attn.layer_name], config, torch.device("cpu"))
        built = builder.build(common_prefix_len=0, common_attn_metadata=metadata)
    impl = attn.impl
    tokens = metadata.num_actual_tokens
    kv_cache = _kv_cache(backend, spec, impl)
    query = torch.zeros(tokens, impl.num_heads, impl.head_size, dtype=torch.bfloat16)
    key = torch.zeros(tokens, impl.num_kv_heads, impl.head_size, dtype=torch.bfloat16)
    output = torch.zeros_like(query)
    # A CPU detects no FlashAttention version; the forward runs as on an
    # H100/H200 (FA3), the hosts DFlash drafters are served on.
    detected = impl.vllm_flash_attn_version
    impl.vllm_flash_attn_version = detected or SM90_FA_VERSION
    try:
        with _harness.recording(flash_attn, "flash_attn_varlen_func") as recorder:
            impl.forward(attn, query, key, key.clone(), kv_cache, built, output)
    finally:
        impl.vllm_flash_attn_version = detected
    if len(recorder.calls) != 1:
        raise RuntimeError(f"{attn.layer_name}: {len(recorder.calls)} FlashAttention calls")
    call = recorder.calls[0]
    window = call.get("window_size")
    return {
        "window": list(window) if window is not None else None,
        "causal": bool(call["causal"]),
        "kv_spec": type(spec).__name__,
    }


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(),
        target_layers=8,
        target_layer_ids=[1, 3, 5],
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
    )
    config = _harness.vllm_config(pair)
    _harness.ensure_single_process_group(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(config):
            model = DFlashQwen3Model(vllm_config=config, prefix="probe_drafter")
    except NotImplementedError as e:
        # vLLM itself says it cannot run this drafter (0.25's V1 path does this).
        return ProbeResult(
            probe=NAME, status=ABSENT, evidence=f"vLLM refuses a sliding+full drafter: {e}"
        )
    finally:
        torch.set_default_dtype(previous)
    per_layer = _layer_causal(config, model)
    if per_layer is not None and not _harness.has_v1_dflash_proposer():
        # No V1 proposer (0.34.0): the V2 speculator's query pass, per group.
        proposed = _harness.dflash_v2_query_metadata(config)
    else:
        proposed = _harness.dflash_proposer_metadata(config)
    runner = "v2 runner" if per_layer is not None else "v1 runner"
    calls = []
    for idx, layer in enumerate(model.layers):
        metadata = proposed if per_layer is None else replace(proposed, causal=per_layer[idx])
        calls.append(_record_forward(config, layer.self_attn.attn, metadata))
    masks = [effective_mask(c["window"], c["causal"]) for c in calls]
    specs = [c["kv_spec"] for c in calls]
    attns = [layer.self_attn.attn for layer in model.layers]
    one_group = len({repr(a.get_kv_cache_spec(config)) for a in attns}) == 1
    form = (
        "one KV-cache group (window applied at compute time)"
        if one_group
        else "per-layer KV-cache specs (needs a multi-group runner)"
    )
    expected = expected_masks()
    status = PRESENT if masks == expected else ABSENT
    shown = ", ".join(
        f"{tuple(c['window']) if c['window'] else None}{' causal' if c['causal'] else ''}"
        for c in calls
    )
    evidence = (
        f"layer_types {[t.split('_')[0] for t in LAYER_TYPES]} window {WINDOW} -> "
        f"FlashAttention called with [{shown}] ({runner}), keys seen before/after "
        f"each query {masks} (reference: {expected}); KV specs {specs}"
    )
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form=f"{form}, {runner}" if status == PRESENT else None,
        details={
            "calls": calls,
            "masks": [list(m) for m in masks],
            "runner": runner,
            "backend": attns[0].attn_backend.get_name(),
        },
    )
