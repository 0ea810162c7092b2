"""Acceptance of the vLLM importable here on the trained pair (runs inside the SERVING
interpreter, started by ``tooling.trained.acceptance.measure_engines`` as
``python -m tooling.trained.serving.acceptance run IN.json OUT.json`` with the measured install
first on PYTHONPATH).

The held-out prompts of the recipe, greedy, ``ignore_eos``, 3 drafted tokens; acceptance from
vLLM's own spec-decode counters. Then every prompt again, to read the prefix-cache hit rate on
repeats (fix 3).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from ...entry import entry_logging
from ...smoke.serving.child import exit_now, serve

logger = logging.getLogger(__name__)

#: The prefix of vLLM's spec-decode counters (the toolchain's table reads them by it too).
SPEC = "vllm:spec_decode_"


def _counters(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in metrics:
        if metric.name.startswith(SPEC) or metric.name.startswith("vllm:prefix_cache"):
            value = getattr(metric, "values", None)
            out[metric.name] = value if value is not None else getattr(metric, "value", 0)
    return out


def _delta(after: dict[str, Any], before: dict[str, Any], name: str) -> Any:
    a, b = after.get(name, 0), before.get(name, 0)
    if isinstance(a, list):
        b = b if isinstance(b, list) else [0] * len(a)
        return [int(x) - int(y) for x, y in zip(a, b, strict=False)]
    return int(a) - int(b)


def run_engine(request: dict[str, Any]) -> dict[str, Any]:
    """Measure the vLLM importable here on the recipe's prompts (GPU host only)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [p["token_ids"] for p in request["prompts"]]
    logger.debug("start the engine of %s: %d prompts", request["target"], len(prompts))
    started = time.monotonic()
    llm = LLM(
        model=request["target"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=request.get("max_model_len", 1024),
        gpu_memory_utilization=request.get("gpu_memory_utilization", 0.3),
        seed=0,
        disable_log_stats=False,
        attention_backend="FLASH_ATTN",
        enable_prefix_caching=True,
        block_size=16,
        speculative_config={
            "method": "dflash",
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        },
    )
    startup_s = time.monotonic() - started
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True, detokenize=False
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    before = _counters(llm.get_metrics())
    first = llm.generate(inputs, params, use_tqdm=False)
    after_first = _counters(llm.get_metrics())
    # The same prompts again: every full block should now come from the cache.
    # Each output says how many of its prompt tokens the cache supplied.
    repeat = llm.generate(inputs, params, use_tqdm=False)
    outputs = [[int(t) for t in r.outputs[0].token_ids] for r in first]
    block = 16
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "startup_s": startup_s,
        "outputs": outputs,
        "spec": {k: _delta(after_first, before, k) for k in after_first if k.startswith(SPEC)},
        "prefix_repeat": {
            "cached_tokens": sum(int(r.num_cached_tokens or 0) for r in repeat),
            "prompt_tokens": sum(len(p) for p in prompts),
            # A hit can cover at most the full blocks before the last prompt token.
            "full_block_tokens": sum((len(p) - 1) // block * block for p in prompts),
        },
    }


def main(argv: list[str]) -> int:
    """``run IN.json OUT.json``: measure this interpreter's vLLM; exit 0 when it ran."""
    with entry_logging():
        if len(argv) != 3 or argv[0] != "run":
            logger.error("usage: python -m tooling.trained.serving.acceptance run IN.json OUT.json")
            return 2
        return serve(Path(argv[1]), Path(argv[2]), run_engine)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
