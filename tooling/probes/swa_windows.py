"""Fix 2: each DFlash drafter layer attends within the window its ``layer_types`` asks for.

Builds the DFlash drafter model with vLLM's own loader path (real
SpeculativeConfig over a drafter config.json with ``layer_types`` [sliding,
sliding, full] and ``sliding_window`` 16) on the FLASH_ATTN backend, then reads
the window each attention impl will compute with and the KV-cache spec each
layer reports. The fix is present when the sliding layers compute with window
16 (FlashAttention's (15, 0)) and the full layer with none. The KV specs tell
the form: one full-attention group (compute-only window, what V1's DFlash path
supports) or per-layer sliding specs (needs a multi-group runner).
"""

from __future__ import annotations

from . import _harness
from .result import ABSENT, PRESENT, ProbeResult

NAME = "swa_windows"
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
WINDOW = 16


def expected_windows() -> list[tuple[int, int]]:
    return [(WINDOW - 1, 0) if t == "sliding_attention" else (-1, -1) for t in LAYER_TYPES]


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
    attns = [layer.self_attn.attn for layer in model.layers]
    windows = [tuple(a.impl.sliding_window) for a in attns]
    specs = [a.get_kv_cache_spec(config) for a in attns]
    spec_names = [type(s).__name__ for s in specs]
    one_group = all(s == specs[0] for s in specs)
    form = (
        "one KV-cache group (window applied at compute time)"
        if one_group
        else "per-layer KV-cache specs (needs a multi-group runner)"
    )
    expected = expected_windows()
    status = PRESENT if windows == expected else ABSENT
    evidence = (
        f"layer_types {[t.split('_')[0] for t in LAYER_TYPES]} window {WINDOW} -> "
        f"FA windows {windows} (fixed: {expected}); KV specs {spec_names}"
    )
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form=form if status == PRESENT else None,
        details={
            "windows": [list(w) for w in windows],
            "kv_specs": spec_names,
            "backend": attns[0].attn_backend.get_name(),
        },
    )
