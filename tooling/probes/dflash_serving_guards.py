"""Fix 11: what 0.20.1 serves wrong with DFlash is refused, or served another way, at once.

Three configurations, each asked through the release's own code:

- pipeline parallelism: the drafter reads the target's hidden states at its
  ``target_layer_ids``, which live on other stages. Fixed where building the engine's
  config with ``pipeline_parallel_size`` 2 fails with an error that names pipeline
  parallelism and DFlash (0.20.1 fails on the drafter model's missing pipeline support, a
  message that names neither), or where the config is accepted and the release's runner
  relays those hidden states between stages: its load-time check (0.34.0's V2 runner) then
  passes an attention-only target whose layers relay them and refuses a hybrid (Qwen3-Next)
  target, naming pipeline parallelism and the method. The check runs on the target model
  as vLLM builds it, on the meta device;
- a hybrid target (Qwen3-Next) at ``tensor_parallel_size`` 2: vLLM's custom
  all-reduce faults while such a server captures its CUDA graphs, so the config
  must select NCCL's all-reduce (``disable_custom_all_reduce``); an
  attention-only target at TP 2 keeps the custom one (control);
- a request for structured output (a JSON object) from a server with a reasoning parser and
  speculative decoding, whose drafts end reasoning: ``a </think> {``. Fixed where
  ``SamplingParams.verify`` refuses it, or where the release's structured-output manager
  constrains the token after ``</think>`` to the grammar and leaves the reasoning free
  (upstream #44297); 0.20.1 leaves every row of that step unconstrained. Control: the same
  request whose prompt has already ended reasoning is constrained from its first row.

Fixed means all three hold.
"""

from __future__ import annotations

from typing import Any

from . import _harness, _serving_guards
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


def _structured_output(pair: Any) -> tuple[str, bool]:
    """How the release serves structured output after reasoning ends inside the drafts:
    "refused" (for that reason), "constrained" or "unconstrained"; and whether the controls
    hold (the request without structured output is served, and a request whose prompt
    ended reasoning is constrained from its first row)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    tokenizer = _serving_guards.write_tokenizer(pair.target)
    config = _serving_guards.structured_output_config(_harness.vllm_config(pair))
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    # Control first: the same request without structured output is served.
    for request in (SamplingParams(max_tokens=8), params):
        try:
            request.verify(
                config.model_config,
                config.speculative_config,
                config.structured_outputs_config,
                tokenizer,
            )
        except Exception as e:  # releases raise ValueError or their own validation error
            message = " ".join(str(e).split())
            if request is params and "reasoning" in message.lower():
                return "refused", True
            return f"refused ({message[:120]})", False
    rows = _serving_guards.grammar_rows(config, params, ["<think>", "a"], ["a", "</think>", "{"])
    ended = _serving_guards.grammar_rows(config, params, ["<think>", "a", "</think>"], ["{"])
    control = ended[0] is not None and "{" in ended[0]
    # Row 2 samples the token after the drafted </think>: the answer's first.
    constrained = rows[0] is None and rows[2] is not None and "{" in rows[2]
    return ("constrained" if constrained else "unconstrained"), control


def _pipeline(attention: Any, hybrid: Any) -> tuple[bool | None, str]:
    """Whether pipeline parallelism with DFlash is refused at start-up by name, or served by
    relaying the drafter's hidden states (see the module), None where the target cannot be
    built here to ask; and what was seen."""
    named, seen = _pipeline_refused(attention)
    if named or seen != "accepted":
        return named, seen
    try:
        # The hybrid (MoE) target first: the process group made for it serves both.
        hybrid_check = _serving_guards.load_check(_harness.vllm_config(hybrid))
        relayed = _serving_guards.load_check(_harness.vllm_config(attention))
    except LookupError as e:
        return False, f"accepted ({e})"
    except _serving_guards.CannotBuild as e:
        return None, f"accepted; the load-time check cannot be asked here: {e}"
    refused_by_name = (
        hybrid_check is not None
        and "pipeline" in hybrid_check.lower()
        and "dflash" in hybrid_check.lower()
    )
    seen = (
        "accepted; at load, attention-only target: "
        f"{'served, hidden states relayed' if relayed is None else 'refused: ' + relayed[:80]}"
        f"; hybrid target: {'served' if hybrid_check is None else 'refused: ' + hybrid_check[:80]}"
    )
    return relayed is None and refused_by_name, seen


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    root = _harness.scratch_dir()
    attention = _harness.write_tiny_pair(
        root / "attention", target_layers=8, target_layer_ids=[1, 3, 5]
    )
    hybrid = _harness.hybrid_pair(root / "hybrid")
    pipeline_ok, pipeline = _pipeline(attention, hybrid)
    custom_hybrid = _custom_all_reduce_at_tp2(hybrid)
    custom_attention = _custom_all_reduce_at_tp2(attention)
    try:
        structured, control = _structured_output(attention)
    except TimeoutError as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"structured output: {e}")
    evidence = (
        f"pipeline_parallel_size 2: {pipeline}; TP 2 all-reduce: hybrid target "
        f"{'custom' if custom_hybrid else 'NCCL'}, attention-only "
        f"{'custom' if custom_attention else 'NCCL'}; structured output with reasoning "
        f"parser {_serving_guards.REASONING_PARSER}, drafts 'a </think> {{': {structured}"
    )
    if not custom_attention or not control:
        status = UNKNOWN
        evidence = "a control is refused, redirected or unconstrained: " + evidence
    elif pipeline_ok is False or custom_hybrid or structured == "unconstrained":
        status = ABSENT
    else:
        status = PRESENT if pipeline_ok else UNKNOWN
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={
            "pipeline_refused_or_relayed": pipeline_ok,
            "hybrid_tp2_custom_all_reduce": custom_hybrid,
            "attention_tp2_custom_all_reduce": custom_attention,
            "structured_output_after_reasoning_in_drafts": structured,
        },
    )
