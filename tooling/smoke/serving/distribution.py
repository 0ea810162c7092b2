"""One engine's greedy runs with top-k logprobs, for comparing engines position by position.

Runs on the GPU host as ``python -m tooling.smoke.serving.distribution IN.json OUT.json``
in the interpreter of the vLLM under test, one engine (one variant) per process,
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the model runner lives in this process.
The engine is vLLM's default way of running (compiled, CUDA graphs) unless the
request says otherwise. Workloads, each optional:

- ``alone``: prompts served one at a time, each its own batch (a prompt of
  exactly K+1 tokens is then the whole first step);
- ``together``: the ``alone`` prompts again, all in one batch (for the plain
  engine: the noise two plain runs differ by);
- ``scored``: each ``alone`` prompt extended by the tokens it was served, scored in one
  pass (a prefill, its prompt logprobs): the same tokens through a pass of many tokens, as
  a DFlash engine verifies them, where the plain runs decode one token a pass;
- ``staggered``: requests added to a running engine in waves, each wave once
  the requests of the previous waves named in ``after`` have finished (steps
  that mix new prompts with requests verifying drafts);
- ``concurrent``: one batch of many requests (no logprobs), with the most
  requests the scheduler ran at once.

Every request records its tokens and, per position, the top-k logprobs.
A DFlash engine also records, per request, the last position its drafter's
first pass queried (the bonus token's position + K), to compare with
``max_model_len``.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .child import exit_now, serve
from .engine_run import ProposalRecorder, install_recorder

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    name: str
    length: int
    max_tokens: int
    seed: int

    def token_ids(self, vocab: int) -> list[int]:
        """Seeded random ids, clear of the low ids tokenizers reserve and of the top of the
        vocabulary (the mask and the multimodal ids)."""
        rng = random.Random(self.seed)
        return [rng.randrange(100, vocab - 1000) for _ in range(self.length)]


@dataclass
class Wave:
    prompts: list[Prompt]
    after: list[str] = field(default_factory=list)
    """Names of earlier requests that must have finished before this wave is added."""


@dataclass
class DistributionRequest:
    target: str
    drafter: str | None
    num_speculative_tokens: int = 0
    vocab_size: int = 248320
    max_model_len: int = 1024
    max_num_seqs: int | None = 16
    """None: vLLM's default for the GPU."""
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.1
    cudagraph_mode: str | None = None
    """None: vLLM's default for the model."""
    enforce_eager: bool = False
    logprobs: int = 5
    engine_args: dict[str, Any] = field(default_factory=dict)
    """More of vLLM's engine arguments (e.g. long_prefill_token_threshold)."""
    speculative_args: dict[str, Any] = field(default_factory=dict)
    """More of the drafter's ``speculative_config`` (e.g. num_speculative_tokens_per_batch_size)."""
    alone: list[Prompt] = field(default_factory=list)
    together: bool = False
    scored: bool = False
    staggered: list[Wave] = field(default_factory=list)
    concurrent: list[Prompt] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DistributionRequest:
        request = cls(
            **{k: v for k, v in data.items() if k not in ("alone", "concurrent", "staggered")}
        )
        request.alone = [Prompt(**p) for p in data.get("alone", [])]
        request.concurrent = [Prompt(**p) for p in data.get("concurrent", [])]
        request.staggered = [
            Wave([Prompt(**p) for p in w["prompts"]], list(w.get("after", [])))
            for w in data.get("staggered", [])
        ]
        return request


def _listed(positions: list[Any] | None) -> list[dict[str, float]]:
    """Per position, token id (as a string, for JSON) -> logprob; a position vLLM lists
    nothing for (a prompt's first) is empty."""
    return [
        {str(token): float(lp.logprob) for token, lp in (position or {}).items()}
        for position in (positions or [])
    ]


def _logprobs(output: Any) -> list[dict[str, float]]:
    """Per position of a completion, token id (as a string, for JSON) -> logprob."""
    return _listed(output.logprobs)


def _result(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "tokens": [int(t) for t in completion.token_ids],
        "logprobs": _logprobs(completion),
        "finish_reason": completion.finish_reason,
    }


class RunningCounter:
    """The most requests the scheduler ran in one step, and the tokens it scheduled since
    ``take_tokens`` (wraps ``Scheduler.schedule``)."""

    def __init__(self) -> None:
        self.most = 0
        self.tokens = 0

    def take_tokens(self) -> int:
        tokens, self.tokens = self.tokens, 0
        return tokens

    def install(self, scheduler_cls: Any) -> None:
        schedule = scheduler_cls.schedule
        counter = self

        def scheduled(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            output = schedule(scheduler, *args, **kwargs)
            counter.most = max(counter.most, len(output.num_scheduled_tokens))
            counter.tokens += int(output.total_num_scheduled_tokens)
            return output

        scheduler_cls.schedule = scheduled


def greedy_params(max_tokens: int, logprobs: int | None) -> Any:
    """Greedy sampling for exactly ``max_tokens`` token ids (no stop at EOS, no text)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=logprobs,
    )


def start_engine(request: DistributionRequest) -> tuple[Any, float]:
    """The request's engine, in this process, and the seconds it took to start."""
    from vllm import LLM

    optional: dict[str, Any] = {}
    if request.drafter is not None:
        optional["speculative_config"] = {
            "method": "dflash",
            "model": request.drafter,
            "num_speculative_tokens": request.num_speculative_tokens,
            **request.speculative_args,
        }
    if request.cudagraph_mode is not None:
        optional["compilation_config"] = {"cudagraph_mode": request.cudagraph_mode}
    if request.kv_cache_memory_bytes is not None:
        optional["kv_cache_memory_bytes"] = request.kv_cache_memory_bytes
    if request.max_num_batched_tokens is not None:
        optional["max_num_batched_tokens"] = request.max_num_batched_tokens
    logger.debug("start the engine of %s (drafter: %s)", request.target, request.drafter)
    started = time.monotonic()
    llm = LLM(
        model=request.target,
        skip_tokenizer_init=True,
        max_model_len=request.max_model_len,
        max_num_seqs=request.max_num_seqs,
        gpu_memory_utilization=request.gpu_memory_utilization,
        enforce_eager=request.enforce_eager,
        seed=0,
        language_model_only=True,
        # The offline bundle has no flashinfer, vLLM's default GDN prefill on sm90.
        gdn_prefill_backend="triton",
        attention_backend="FLASH_ATTN",
        **optional,
        **request.engine_args,
    )
    return llm, time.monotonic() - started


def run(request: DistributionRequest) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    every = [
        *request.alone,
        *(p for w in request.staggered for p in w.prompts),
        *request.concurrent,
    ]
    ids = {p.name: p.token_ids(request.vocab_size) for p in every}
    if len(ids) != len(every) or len({tuple(v) for v in ids.values()}) != len(every):
        raise ValueError("prompt names and token ids must be distinct")
    recorder = ProposalRecorder(prompt_index={tuple(v): i for i, v in enumerate(ids.values())})
    names = list(ids)
    running = RunningCounter()
    running.install(Scheduler)
    if request.drafter is not None:
        from vllm.v1.spec_decode.dflash import DFlashProposer

        install_recorder(DFlashProposer, recorder)
    llm, startup_s = start_engine(request)
    engine = llm.llm_engine
    recorder.runner = engine.model_executor.driver_worker.worker.model_runner

    def params(prompt: Prompt, logprobs: int | None) -> Any:
        return greedy_params(prompt.max_tokens, logprobs)

    def generate(prompts: list[Prompt], logprobs: int | None) -> dict[str, Any]:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids[p.name]) for p in prompts],
            [params(p, logprobs) for p in prompts],
            use_tqdm=False,
        )
        return {p.name: _result(o) for p, o in zip(prompts, outputs, strict=True)}

    results: dict[str, dict[str, Any]] = {
        "alone": {},
        "together": {},
        "scored": {},
        "staggered": {},
    }
    for prompt in request.alone:
        results["alone"].update(generate([prompt], request.logprobs))
    if request.together:
        results["together"] = generate(request.alone, request.logprobs)
    if request.scored:
        results["scored"] = _scored(llm, request, ids, results["alone"])
    if request.staggered:
        results["staggered"] = _staggered(engine, request, ids, params)
    concurrent: dict[str, Any] | None = None
    if request.concurrent:
        running.most = 0
        begin = time.monotonic()
        done = generate(request.concurrent, None)
        concurrent = {
            "requests": len(done),
            "finished": sum(1 for r in done.values() if r["finish_reason"] == "length"),
            "tokens": sum(len(r["tokens"]) for r in done.values()),
            "most_running": running.most,
            "seconds": time.monotonic() - begin,
        }
    reach: dict[str, int] = {}
    k = request.num_speculative_tokens
    for proposal in recorder.proposals:
        name = names[proposal["prompt"]]
        reach[name] = max(reach.get(name, -1), proposal["position"] + k)
    config = engine.vllm_config
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_location": str(Path(vllm.__file__).parent),
        "startup_s": startup_s,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "max_model_len": request.max_model_len,
        "num_speculative_tokens": k,
        "prompt_lengths": {name: len(v) for name, v in ids.items()},
        **results,
        "concurrent": concurrent,
        "drafter_reach": reach,
    }


def _scored(
    llm: Any, request: DistributionRequest, ids: dict[str, list[int]], alone: dict[str, Any]
) -> dict[str, Any]:
    """Each prompt and the tokens it was served alone, in one pass: per served token, the
    top-k logprobs of the position that chose it (as many as ``max_model_len`` leaves room
    for, with the one token a request must generate)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    room = {name: max(request.max_model_len - len(ids[name]) - 1, 0) for name in alone}
    served = {name: run["tokens"][: room[name]] for name, run in alone.items()}
    names = [name for name, tokens in served.items() if tokens]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        detokenize=False,
        prompt_logprobs=request.logprobs,
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids[n] + served[n]) for n in names],
        [params] * len(names),
        use_tqdm=False,
    )
    return {
        name: {
            "tokens": served[name],
            "logprobs": _listed((output.prompt_logprobs or [])[len(ids[name]) :]),
        }
        for name, output in zip(names, outputs, strict=True)
    }


def _staggered(
    engine: Any, request: DistributionRequest, ids: dict[str, list[int]], params: Any
) -> dict[str, Any]:
    """Add each wave once its ``after`` requests have finished; step the engine to the end."""
    from vllm.inputs import TokensPrompt

    finished: dict[str, Any] = {}
    waves = list(request.staggered)
    while waves or engine.has_unfinished_requests():
        while waves and all(name in finished for name in waves[0].after):
            for prompt in waves.pop(0).prompts:
                engine.add_request(
                    prompt.name,
                    TokensPrompt(prompt_token_ids=ids[prompt.name]),
                    params(prompt, request.logprobs),
                )
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"a wave waits for requests that never ran: {waves[0].after}")
        for output in engine.step():
            if output.finished:
                # The engine may suffix the id it was given; the name is what came in.
                name = output.request_id
                finished[name if name in ids else name.rsplit("-", 1)[0]] = _result(output)
    return finished


def main(argv: list[str]) -> int:
    return serve(
        Path(argv[0]), Path(argv[1]), lambda data: run(DistributionRequest.from_json(data))
    )


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
