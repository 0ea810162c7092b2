"""In-process vLLM run with the DFlash drafter: every proposal, each drafter layer's window.

Runs on the GPU host as ``python -m tooling.smoke.engine_run IN.json OUT.json``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model runner lives in this
process. Before the engine exists, ``DFlashProposer.propose`` is wrapped to
record, per call, the bonus token (the target's sampled next token), its
position and the drafted tokens. After start-up it reads the window each
drafter attention layer computes with (``impl.sliding_window``) and the aux
layers the runner derives from the drafter config. Prompts run one at a time
so every proposal belongs to one known request.

Attribute paths checked against vLLM 0.20.1:
``LLM.llm_engine.model_executor`` (v1/engine/llm_engine.py, in-process only)
``.driver_worker.worker.model_runner`` (uniproc_executor.py, worker_base.py)
``.drafter`` (gpu_model_runner.py: DFlashProposer) ``.model`` (DFlashQwen3ForCausalLM),
``DFlashProposer.positions`` (dflash.py: query positions, bonus first).
"""

from __future__ import annotations

import inspect
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .child import exit_now, serve


@dataclass
class EngineRunInput:
    """What the orchestrator asks of the in-process run (serialised as JSON)."""

    target: str
    drafter: str
    texts: list[str]
    lengths: list[int]
    max_tokens: int = 40
    num_speculative_tokens: int = 3
    attention_backend: str = "FLASH_ATTN"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.3
    seed: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRunInput:
        return cls(**data)


@dataclass
class ProposalRecorder:
    """Collects each proposal vLLM's DFlash drafter makes, tagged with the running prompt."""

    current_prompt: int = -1
    proposals: list[dict[str, Any]] = field(default_factory=list)
    unmatched_calls: int = 0

    def record(self, proposer: Any, bound: inspect.BoundArguments, drafts: Any) -> None:
        next_token_ids = bound.arguments["next_token_ids"]
        k = int(drafts.shape[-1])
        rows = drafts.reshape(-1, k).tolist()
        bonuses = next_token_ids.reshape(-1).tolist()
        # The DFlash kernel writes each request's query positions (bonus first,
        # then the masks) to proposer.positions, 1 + k per request.
        positions = proposer.positions[: len(rows) * (1 + k)].tolist()
        if len(rows) != 1:
            # One prompt at a time: anything else is a padded or dummy batch.
            self.unmatched_calls += 1
        for row, (bonus, drafted) in enumerate(zip(bonuses, rows, strict=False)):
            self.proposals.append(
                {
                    "prompt": self.current_prompt,
                    "row": row,
                    "position": int(positions[row * (1 + k)]),
                    "bonus": int(bonus),
                    "drafts": [int(t) for t in drafted],
                }
            )


def install_recorder(proposer_cls: Any, recorder: ProposalRecorder) -> None:
    """Wrap ``proposer_cls.propose`` so every call is recorded; behaviour is unchanged."""
    original = proposer_cls.propose
    signature = inspect.signature(original)
    if "next_token_ids" not in signature.parameters:
        raise RuntimeError(f"{proposer_cls.__name__}.propose has no next_token_ids parameter")

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = original(self, *args, **kwargs)
        recorder.record(self, signature.bind(self, *args, **kwargs), drafts)
        return drafts

    propose.__wrapped__ = original  # type: ignore[attr-defined]
    proposer_cls.propose = propose


def attention_windows(model: Any) -> list[dict[str, Any]]:
    """Name and FlashAttention window of every attention layer in ``model``, in module order.

    A vLLM ``Attention`` keeps the window its kernel uses on ``impl.sliding_window``:
    (w-1, 0) for a window of w tokens, (-1, -1) for none.
    """
    found = []
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(impl, "sliding_window"):
            continue
        window = impl.sliding_window
        found.append(
            {
                "layer": name,
                "window": list(window) if window is not None else None,
                "impl": type(impl).__name__,
            }
        )
    return found


def build_prompts(target: str, texts: list[str], lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths: the target's tokenizer over ``texts``.

    Falls back to seeded random ids when the target has no loadable tokenizer.
    """
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception:
        tokenizer = None
    prompts = []
    for i, length in enumerate(lengths):
        if tokenizer is not None:
            text = texts[i % len(texts)]
            ids = tokenizer.encode(text, add_special_tokens=False)
            while len(ids) < length:
                ids = ids + ids
            prompts.append([int(t) for t in ids[:length]])
        else:
            rng = random.Random(seed + i)
            prompts.append([rng.randrange(10, 1000) for _ in range(length)])
    return prompts


def _metrics_summary(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in metrics:
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "values", None)
        out[metric.name] = value
    return out


def run(request: EngineRunInput) -> dict[str, Any]:
    """Start the engine, generate each prompt greedily, return everything recorded."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.spec_decode.dflash import DFlashProposer

    recorder = ProposalRecorder()
    install_recorder(DFlashProposer, recorder)
    prompts = build_prompts(request.target, request.texts, request.lengths, request.seed)
    started = time.monotonic()
    llm = LLM(
        model=request.target,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=request.max_model_len,
        gpu_memory_utilization=request.gpu_memory_utilization,
        seed=request.seed,
        disable_log_stats=False,
        attention_backend=request.attention_backend,
        # Prompts are distinct; no cache keeps the drafter's context exactly the
        # prompt plus what was generated.
        enable_prefix_caching=False,
        speculative_config={
            "method": "dflash",
            "model": request.drafter,
            "num_speculative_tokens": request.num_speculative_tokens,
        },
    )
    startup_s = time.monotonic() - started
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafter = runner.drafter
    windows = attention_windows(drafter.model)
    aux_layers = runner._get_eagle3_aux_layers_from_config()
    params = SamplingParams(
        temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = []
    for index, prompt in enumerate(prompts):
        recorder.current_prompt = index
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        outputs.append([int(t) for t in result[0].outputs[0].token_ids])
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_location": str(Path(vllm.__file__).parent),
        "startup_s": startup_s,
        "drafter_class": type(drafter).__name__,
        "drafter_model_class": type(drafter.model).__name__,
        "windows": windows,
        "aux_layers": list(aux_layers) if aux_layers else None,
        "prompts": prompts,
        "outputs": outputs,
        "proposals": recorder.proposals,
        "unmatched_calls": recorder.unmatched_calls,
        "num_speculative_tokens": request.num_speculative_tokens,
        "spec_decode_metrics": _metrics_summary(llm.get_metrics()),
    }


def main(argv: list[str]) -> int:
    """Run the request in ``argv[0]`` and write the result to ``argv[1]``; 0 when it ran."""
    return serve(
        Path(argv[0]), Path(argv[1]), lambda request: run(EngineRunInput.from_json(request))
    )


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
