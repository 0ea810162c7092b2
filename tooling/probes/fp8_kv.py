"""Fix 5: with ``--kv-cache-dtype fp8`` a DFlash drafter keeps its KV cache as the target does.

Builds a tiny target and its DFlash drafter (full attention, so every release
can build it) with vLLM's own loader path under a VllmConfig whose cache dtype
is fp8, on the FLASH_ATTN backend, and compares the KV-cache dtype and spec of
every drafter attention layer with the target's. Where V1's DFlash proposer
serves the drafter, its query metadata is built by the real proposer too (its
GPU input kernel recorded, not run): the query start offsets it hands the
kernels must be int32 on the CPU side as on the device side.

0.20.1 builds the drafter's attention without the engine's cache config, so
its layers keep the model dtype while the target's are fp8, and its CPU query
offsets are int64.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, ProbeResult

NAME = "fp8_kv"
CACHE_DTYPE = "fp8"


@contextmanager
def _fa3_fp8_support() -> Iterator[None]:
    """FlashAttention as on an H100/H200 (FA3), which stores fp8 KV caches.

    On a CPU no FlashAttention version is detected and FlashAttentionImpl
    refuses any fp8 cache, target and drafter alike; the probe asks which
    dtype each layer asks for, not whether this machine could run it.
    """
    from vllm.v1.attention.backends import flash_attn

    # The question's name differs between releases (0.22 to 0.32 do not ask).
    names = ("flash_attn_supports_fp8", "flash_attn_supports_kv_cache_dtype")
    saved = {n: getattr(flash_attn, n) for n in names if hasattr(flash_attn, n)}
    for name in saved:
        setattr(flash_attn, name, lambda *args, **kwargs: True)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(flash_attn, name, original)


def _layer(attn: Any, config: Any) -> dict[str, Any]:
    spec = attn.get_kv_cache_spec(config)
    return {
        "name": attn.layer_name,
        "kv_cache_dtype": attn.kv_cache_dtype,
        "spec": type(spec).__name__,
        "spec_dtype": str(spec.dtype),
        "page_size_bytes": spec.page_size_bytes,
    }


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3 import Qwen3Model
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=4, target_layer_ids=[0, 1, 2]
    )
    config = _harness.vllm_config(pair, cache_dtype=CACHE_DTYPE)
    _harness.ensure_single_process_group(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(config), _fa3_fp8_support():
            target = Qwen3Model(vllm_config=config, prefix="probe_target")
            drafter = DFlashQwen3Model(vllm_config=config, prefix="probe_drafter")
    finally:
        torch.set_default_dtype(previous)
    wanted = _layer(target.layers[0].self_attn.attn, config)
    layers = [_layer(layer.self_attn.attn, config) for layer in drafter.layers]
    same = ("kv_cache_dtype", "spec", "spec_dtype", "page_size_bytes")
    mismatched = [
        f"{d['name']} {d['kv_cache_dtype']}/{d['spec_dtype']}"
        for d in layers
        if any(d[k] != wanted[k] for k in same)
    ]
    details: dict = {"target": wanted, "drafter": layers}
    evidence = (
        f"--kv-cache-dtype {CACHE_DTYPE}: target KV {wanted['kv_cache_dtype']}/"
        f"{wanted['spec_dtype']}, drafter "
        + (f"differs ({', '.join(mismatched)})" if mismatched else "the same on every layer")
    )
    offsets_ok = True
    if getattr(config, "use_v2_model_runner", False) or not _harness.has_v1_dflash_proposer():
        # The V2 runner builds the drafter's query metadata itself (0.34.0 has no other).
        evidence += "; the V2 runner serves DFlash here (no V1 proposer to ask)"
    else:
        metadata = _harness.dflash_proposer_metadata(config)
        cpu, device = metadata.query_start_loc_cpu.dtype, metadata.query_start_loc.dtype
        details["query_start_loc"] = {"cpu": str(cpu), "device": str(device)}
        offsets_ok = cpu == device == torch.int32
        evidence += f"; proposer query offsets cpu {cpu}, device {device} (fixed: int32)"
    status = PRESENT if not mismatched and offsets_ok else ABSENT
    return ProbeResult(probe=NAME, status=status, evidence=evidence, details=details)
