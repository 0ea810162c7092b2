"""Fix 11: what 0.20.1 serves wrong with DFlash is refused, or served another way, at once.

Three configurations, each asked through vLLM's own config and request checks:

- pipeline parallelism: the drafter reads the target's hidden states at its
  ``target_layer_ids``, which live on other stages. Building the engine's
  config with ``pipeline_parallel_size`` 2 must fail with an error that names
  pipeline parallelism and DFlash (0.20.1 fails on the drafter model's missing
  pipeline support, a message that names neither);
- a hybrid target (Qwen3-Next) at ``tensor_parallel_size`` 2: vLLM's custom
  all-reduce faults while such a server captures its CUDA graphs, so the config
  must select NCCL's all-reduce (``disable_custom_all_reduce``); an
  attention-only target at TP 2 keeps the custom one (control);
- a request asking for structured output from a server with a reasoning parser
  and speculative decoding: when reasoning ends inside the drafts one step
  accepts, 0.20.1 leaves the answer unconstrained. ``SamplingParams.verify``
  must refuse it; the same request without structured output passes (control).

Fixed means all three hold.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "dflash_serving_guards"


def _pipeline_refused(pair: Any) -> tuple[bool, str]:
    try:
        _harness.vllm_config(pair, pipeline_parallel_size=2)
    except Exception as e:  # vLLM raises pydantic's ValidationError, or its own
        message = " ".join(str(e).split())
        named = "pipeline" in message.lower() and "dflash" in message.lower()
        return named, f"refused ({type(e).__name__}: {message[:160]})"
    return False, "accepted"


def _custom_all_reduce_at_tp2(pair: Any) -> bool:
    return not _harness.vllm_config(
        pair, tensor_parallel_size=2
    ).parallel_config.disable_custom_all_reduce


def _structured_output_refused(pair: Any, structured: bool) -> bool:
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    config = _harness.vllm_config(pair)
    params = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(json={"type": "object"}) if structured else None,
    )
    try:
        params.verify(
            config.model_config,
            config.speculative_config,
            StructuredOutputsConfig(reasoning_parser="qwen3"),
            None,
        )
    except Exception as e:  # releases raise ValueError or their own validation error
        # Without a tokenizer vLLM refuses any structured output, with its own reason.
        return "tokenizer" not in str(e)
    return False


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    root = _harness.scratch_dir()
    attention = _harness.write_tiny_pair(
        root / "attention", target_layers=8, target_layer_ids=[1, 3, 5]
    )
    hybrid = _harness.hybrid_pair(root / "hybrid")
    pipeline_ok, pipeline = _pipeline_refused(attention)
    custom_hybrid = _custom_all_reduce_at_tp2(hybrid)
    custom_attention = _custom_all_reduce_at_tp2(attention)
    so_refused = _structured_output_refused(attention, structured=True)
    plain_refused = _structured_output_refused(attention, structured=False)
    evidence = (
        f"pipeline_parallel_size 2: {pipeline}; TP 2 all-reduce: hybrid target "
        f"{'custom' if custom_hybrid else 'NCCL'}, attention-only "
        f"{'custom' if custom_attention else 'NCCL'}; structured output with reasoning "
        f"parser qwen3: {'refused' if so_refused else 'accepted'} (without structured output: "
        f"{'refused' if plain_refused else 'accepted'})"
    )
    if not custom_attention or plain_refused:
        status = UNKNOWN
        evidence = "a control is refused or redirected too: " + evidence
    else:
        status = PRESENT if pipeline_ok and not custom_hybrid and so_refused else ABSENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={
            "pipeline_refused_by_name": pipeline_ok,
            "hybrid_tp2_custom_all_reduce": custom_hybrid,
            "attention_tp2_custom_all_reduce": custom_attention,
            "structured_output_with_reasoning_refused": so_refused,
        },
    )
