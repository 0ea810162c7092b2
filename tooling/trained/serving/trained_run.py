"""One engine on the trained pair: the lossless prompts, acceptance, and decode speed.

Runs on the GPU host as ``python -m tooling.trained.serving.trained_run IN.json OUT.json`` in
the interpreter of the vLLM under test, one engine (one variant and K, or the plain target)
per process, the way users run vLLM (compiled, CUDA graphs). ``tooling.trained.hybrid``
plans the requests and judges the results. Workloads, each optional:

- ``lossless``: the recipe's checked prompts, each served alone in order (so the prefix-cache
  prompts find what the earlier ones left), greedy, with the top-2 logprobs per position and
  the tokens the prefix cache gave;
- ``acceptance``: the recipe's held-out prompts at each concurrency (groups of that many
  requests at once), with vLLM's spec-decode counters over each pass, and each output with
  its top-2 logprobs (the lossless check under load);
- ``speed``: decode throughput at each concurrency, ``SPEED_PASSES`` passes each: the first
  is the first traffic of that shape (reported apart), the median of the others the steady
  figure. Engines that measure speed wait until every engine of the run has finished its
  other work (files in ``barrier``), then take turns on an exclusive lock, so no figure
  shares the GPU.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...smoke.serving.child import exit_now, serve
from ...smoke.serving.distribution import (
    DistributionRequest,
    RunningCounter,
    _result,
    greedy_params,
    start_engine,
)
from .acceptance import SPEC, _counters, _delta
from .turns import whole_run

logger = logging.getLogger(__name__)

#: The counters kept per prompt when prompts are served one at a time.
PER_PROMPT = (f"{SPEC}num_drafts", f"{SPEC}num_accepted_tokens")
#: Passes per speed level: the first traffic, then the steady ones. Compiles for new shapes
#: can reach past the first pass (docs/notebook/2026-12-01-trained-hybrid.md), so the steady
#: figure is a median of several.
SPEED_PASSES = 6


@dataclass
class SpeedPlan:
    concurrency: list[int]
    max_new_tokens: int
    lock: str
    """A file every speed-measuring engine of the run locks while it measures."""


@dataclass
class TrainedRunRequest:
    name: str
    engine: DistributionRequest
    lossless: list[dict[str, Any]] = field(default_factory=list)
    """``{"name", "token_ids", "max_new_tokens"}`` each, served alone in this order."""
    acceptance_prompts: list[list[int]] = field(default_factory=list)
    acceptance_max_new_tokens: int = 0
    acceptance_concurrency: list[int] = field(default_factory=list)
    speed: SpeedPlan | None = None
    barrier: str | None = None
    """A folder where each engine of the run leaves a file when its other work is done."""
    barrier_count: int = 0
    barrier_timeout_s: float = 900.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainedRunRequest:
        values = dict(data)
        values["engine"] = DistributionRequest.from_json(values["engine"])
        if values.get("speed") is not None:
            values["speed"] = SpeedPlan(**values["speed"])
        return cls(**values)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None) -> list:
    from vllm.inputs import TokensPrompt

    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        greedy_params(max_tokens, logprobs),
        use_tqdm=False,
    )


def _spec(llm: Any) -> dict[str, Any]:
    return {k: v for k, v in _counters(llm.get_metrics()).items() if k.startswith(SPEC)}


def _acceptance(llm: Any, request: TrainedRunRequest, running: RunningCounter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompts = request.acceptance_prompts
    for level in request.acceptance_concurrency:
        before = _spec(llm)
        running.most = 0
        completions: list[dict[str, Any]] = []
        per_prompt: list[dict[str, Any]] = []
        ahead = before
        for start in range(0, len(prompts), level):
            done = _generate(
                llm, prompts[start : start + level], request.acceptance_max_new_tokens, 2
            )
            completions += [_result(o) for o in done]
            if level == 1:
                behind = _spec(llm)
                per_prompt.append({k: _delta(behind, ahead, k) for k in PER_PROMPT})
                ahead = behind
        after = _spec(llm)
        out[str(level)] = {
            "outputs": [c["tokens"] for c in completions],
            "spec": {k: _delta(after, before, k) for k in after},
            "most_running": running.most,
            "completions": completions,
        }
        if per_prompt:
            # One request at a time: each prompt's own counters.
            out[str(level)]["per_prompt"] = per_prompt
    return out


def _mark_done(request: TrainedRunRequest) -> None:
    """Tell the run's speed-measuring engines this one no longer uses the GPU's time."""
    if request.barrier is not None:
        folder = Path(request.barrier)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / request.name).write_text("done\n")


def _wait_for_barrier(request: TrainedRunRequest) -> float:
    """Wait until every engine of the run has marked its other work done. Returns the wait."""
    assert request.barrier is not None
    folder = Path(request.barrier)
    begin = time.monotonic()
    while len(list(folder.iterdir())) < request.barrier_count:
        if time.monotonic() - begin > request.barrier_timeout_s:
            raise TimeoutError(
                f"speed: only {len(list(folder.iterdir()))} of {request.barrier_count} engines "
                f"finished their other work within {request.barrier_timeout_s:.0f}s"
            )
        time.sleep(0.5)
    return time.monotonic() - begin


def _speed(llm: Any, request: TrainedRunRequest, running: RunningCounter) -> dict[str, Any]:
    assert request.speed is not None
    plan = request.speed
    prompts = request.acceptance_prompts
    levels: dict[str, Any] = {}
    with whole_run(Path(plan.lock)):
        for level in plan.concurrency:
            batch = [prompts[i % len(prompts)] for i in range(level)]
            passes = []
            for _ in range(SPEED_PASSES):
                running.most = 0
                begin = time.monotonic()
                done = _generate(llm, batch, plan.max_new_tokens, None)
                seconds = time.monotonic() - begin
                tokens = sum(len(o.outputs[0].token_ids) for o in done)
                passes.append({"seconds": seconds, "tokens": tokens, "most_running": running.most})
            levels[str(level)] = passes
    return levels


def run(request: TrainedRunRequest) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    running = RunningCounter()
    running.install(Scheduler)
    logger.debug("start the engine: %d lossless prompts", len(request.lossless))
    try:
        llm, startup_s = start_engine(request.engine)
        lossless: dict[str, Any] = {}
        for prompt in request.lossless:
            done = _generate(llm, [prompt["token_ids"]], prompt["max_new_tokens"], 2)
            lossless[prompt["name"]] = {
                **_result(done[0]),
                "num_cached_tokens": done[0].num_cached_tokens or 0,
            }
        acceptance = _acceptance(llm, request, running) if request.acceptance_concurrency else {}
    finally:
        # An engine that failed must not keep the others waiting.
        _mark_done(request)
    waited = _wait_for_barrier(request) if request.speed is not None else 0.0
    speed = _speed(llm, request, running) if request.speed is not None else {}
    config = llm.llm_engine.vllm_config
    return {
        "name": request.name,
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_location": str(Path(vllm.__file__).parent),
        "startup_s": startup_s,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
        "max_num_scheduled_tokens": config.scheduler_config.max_num_scheduled_tokens,
        "num_speculative_tokens": request.engine.num_speculative_tokens,
        "lossless": lossless,
        "acceptance": acceptance,
        "barrier_wait_s": waited,
        "speed": speed,
    }


def main(argv: list[str]) -> int:
    return serve(Path(argv[0]), Path(argv[1]), lambda data: run(TrainedRunRequest.from_json(data)))


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
