"""Fix 8: a Gated DeltaNet layer gives its spec tokens their own gates in a mixed step.

In a step that mixes spec decodes with non-spec requests (a short prompt, or
the last small chunk of a long one, beside requests verifying drafts), the GDN
layer gathers the spec tokens' q/k/v by ``spec_token_indx`` and hands them to
the recurrent spec-decode kernel with the spec tokens' own offsets. The gate
inputs ``a`` and ``b`` must be gathered the same way: the kernel reads them at
those offsets too. Where they are not, a spec token whose request sits after a
non-spec one gets another token's gates, and its output and the request's
recurrent state drift.

The probe builds vLLM's own ``GatedDeltaNetAttention`` layer (a config-only
Qwen3-Next target, DFlash at K = 3) and the metadata vLLM's
``GDNAttentionMetadataBuilder`` makes for a step of two requests: a 3-token
prompt first, then a request verifying 3 drafts (a query of K+1 tokens, which
the GDN backend does not reorder before a 3-token query). The layer's core
forward runs on the CPU with the GPU kernels it calls replaced: the
convolutions and the gate preparation return their input, and the spec-decode
recurrent kernel records its arguments and stops the forward. Each token's
``a`` and ``b`` carry its batch position, so the recorded gates say which
tokens' gates the kernel got. Fixed means exactly the spec tokens', in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "gdn_gate_gather"
K = 3
PREFIX = "model.layers.0.linear_attn"
#: The step: (query tokens, tokens computed before it, drafts verified) per request.
STEP = ((3, 0, None), (K + 1, 12, K))
NUM_STATE_BLOCKS = 8


class _Reached(Exception):
    """The spec-decode kernel was called: its arguments are the probe's answer."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("spec-decode kernel reached")
        self.kwargs = kwargs


def _first(*args: Any, **kwargs: Any) -> Any:
    return args[0] if args else next(iter(kwargs.values()))


def _prep(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    out = kwargs.get("conv_output", args[0] if args else None)
    return (out,) * 5


def _spec_kernel(*args: Any, **kwargs: Any) -> Any:
    raise _Reached(kwargs)


#: The module-level kernels the core forward calls, and what stands in for each.
FAKES = {
    "causal_conv1d_update": _first,
    "causal_conv1d_fn": _first,
    "fused_post_conv_prep": _prep,
    "fused_sigmoid_gating_delta_rule_update": _spec_kernel,
}


@contextmanager
def _kernels_replaced(module: Any) -> Iterator[None]:
    missing = [name for name in FAKES if not hasattr(module, name)]
    if missing:
        raise LookupError(f"the GDN layer calls no {', '.join(sorted(missing))}")
    with _harness.replaced(module, **FAKES):
        yield


def _metadata(layer: Any, config: Any) -> Any:
    """The GDN metadata vLLM's builder makes for STEP."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    query = [q for q, _, _ in STEP]
    computed = [c for _, c, _ in STEP]
    starts = [0]
    for q in query:
        starts.append(starts[-1] + q)
    seq_lens = [c + q for c, q in zip(computed, query, strict=True)]
    cpu = torch.device("cpu")
    builder = GDNAttentionMetadataBuilder(layer.get_kv_cache_spec(config), [PREFIX], config, cpu)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    fields = {
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "query_start_loc_cpu": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": seq_lens_cpu,
        "num_reqs": len(STEP),
        "num_actual_tokens": starts[-1],
        "max_query_len": max(query),
        "max_seq_len": max(seq_lens),
        # One state block per request, as the Mamba cache gives it.
        "block_table_tensor": torch.arange(len(STEP), dtype=torch.int32)[:, None],
        "slot_mapping": torch.zeros(starts[-1], dtype=torch.int64),
        "is_prefilling": torch.tensor([c < 1 for c in computed]),
        # The CPU copies, under each release's name for them.
        "_seq_lens_cpu": seq_lens_cpu,
        "seq_lens_cpu_upper_bound": seq_lens_cpu,
        "_num_computed_tokens_cpu": torch.tensor(computed, dtype=torch.int32),
    }
    accepted = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    common = CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in accepted})
    drafts = [-1 if d is None else d for _, _, d in STEP]
    return builder.build(
        common_prefix_len=0,
        common_attn_metadata=common,
        num_accepted_tokens=torch.ones(len(STEP), dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
    )


def _gdn_layer_class() -> Any:
    """The Gated DeltaNet layer Qwen3-Next's decoder layers build (its module moved in 0.23)."""
    from vllm.model_executor.models import qwen3_next

    for name in ("GatedDeltaNetAttention", "QwenGatedDeltaNetAttention"):
        if hasattr(qwen3_next, name):
            return getattr(qwen3_next, name)
    raise LookupError("Qwen3-Next names no Gated DeltaNet layer this probe knows")


def _gates_reaching_the_spec_kernel(config: Any) -> tuple[list[int], list[int], list[int]]:
    """(spec token positions, rows of ``a``, rows of ``b``) the spec kernel was given."""
    import sys

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    _harness.ensure_single_process_group(config)
    layer_class = _gdn_layer_class()
    gdn_module = sys.modules[layer_class.__module__]
    hf_config = config.model_config.hf_config
    with set_current_vllm_config(config):
        layer = layer_class(
            hf_config, vllm_config=config, prefix=PREFIX, gqa_interleaved_layout=True
        )
        layer.kv_cache = tuple(
            torch.zeros((NUM_STATE_BLOCKS, *shape), dtype=torch.float32)
            for shape in layer.get_state_shape()
        )
        metadata = _metadata(layer, config)
    if metadata.spec_token_indx is None or metadata.num_prefills == 0:
        raise LookupError("vLLM's builder made no mixed spec/non-spec metadata for the step")
    tokens = metadata.num_actual_tokens
    heads = layer.num_v_heads // layer.tp_size
    # Each token's gate inputs hold its batch position, in every head.
    a = torch.arange(tokens, dtype=torch.float32)[:, None].repeat(1, heads)
    b = a + 0.5
    mixed_qkv = torch.zeros((tokens, layer.conv_dim // layer.tp_size), dtype=torch.float32)
    core_out = torch.zeros((tokens, heads, layer.head_v_dim), dtype=torch.float32)
    with _kernels_replaced(gdn_module), set_forward_context({PREFIX: metadata}, config):
        try:
            layer._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_out)
        except _Reached as reached:
            got = reached.kwargs
        else:
            raise LookupError("the layer never called the spec-decode kernel")
    spec = [int(i) for i in metadata.spec_token_indx.tolist()]
    rows_a = [int(v) for v in got["a"][:, 0].tolist()]
    rows_b = [int(v - 0.5) for v in got["b"][:, 0].tolist()]
    return spec, rows_a, rows_b


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    config = _harness.vllm_config(pair, num_speculative_tokens=K)
    try:
        spec, rows_a, rows_b = _gates_reaching_the_spec_kernel(config)
    except (LookupError, KeyError, TypeError) as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run the step: {e}")
    evidence = (
        f"a {STEP[0][0]}-token prompt, then a request verifying {K} drafts: the spec tokens "
        f"are batch positions {spec}; the spec-decode kernel got the gates of positions "
        f"a {rows_a}, b {rows_b}"
    )
    status = PRESENT if rows_a == spec and rows_b == spec else ABSENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={"spec_token_indx": spec, "a_rows": rows_a, "b_rows": rows_b},
    )
