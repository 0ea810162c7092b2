"""One engine of a GPU fuzz pair, driven step by step through many workloads.

Runs on the GPU host as ``python -m tooling.fuzzing.serving.gpu_run IN.json OUT.json`` in
the interpreter of the vLLM under test, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the
model runner in this process) and a ``VLLM_CACHE_ROOT`` of its own. The campaign starts two
at once for each drawn setting: the DFlash engine ("dflash") and the plain engine of the
same settings ("plain"). Engines are reused across the workloads, because a start (its
compile and graph capture) is what a setting costs.

The workloads are drawn from the DFlash engine's own figures (``gpu_case.draw_workload``):
the DFlash process writes them to ``figures_file`` once its engine is built, and the plain
process waits for that file, so both draw the same requests. ``replay`` gives the workloads
instead (a saved case, a shrink's candidates).

Each workload goes through ``LLMEngine.add_request`` / ``step`` / ``abort_request``:
requests arrive at their steps and are aborted at theirs; each engine step records the
tokens the scheduler scheduled, the output tokens it gave and the requests left; each
request its tokens, top-k logprobs, finish reason and the steps it was added and finished
at. The DFlash engine adds the lookahead-slot audit (``smoke.serving.engine_run``'s
``SlotAuditor``) and its spec-decode counters per workload. An exception in a step is the
engine's death: recorded, and no workload runs after it. ``progress`` is rewritten
(atomically) before and after every workload, so the campaign knows what ran, and which
workload an engine was in, when it has to stop the process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...fsutil import atomic_write_text
from ...smoke.serving.child import exit_now, serve
from ...smoke.serving.distribution import (
    DistributionRequest,
    RunningCounter,
    _logprobs,
    start_engine,
)
from ...smoke.serving.engine_run import SlotAuditor
from ...smoke.serving.slotaudit import SlotAudit
from ...trained.serving.acceptance import SPEC, _counters, _delta
from ..gpu_case import (
    EngineFigures,
    GpuReq,
    GpuSettings,
    draw_workload,
    prompt_ids,
    step_bound,
    stop_ids,
    workload_number,
)

logger = logging.getLogger(__name__)

#: The most logprobs a request may ask for (``gpu_case.LOGPROBS``'s largest).
MAX_LOGPROBS = 20
#: vLLM's refusals of a setting while it builds the engine's config: an answer, no finding.
REFUSALS = (ValueError, NotImplementedError)


@dataclass
class GpuRunRequest:
    role: str
    """"dflash" or "plain"."""
    target: str
    drafter: str | None
    settings: GpuSettings
    kv_cache_memory_bytes: int
    figures_file: str
    progress: str
    seed: int = 0
    number: int = 0
    workloads: int = 0
    """Workloads to draw (when ``replay`` is empty)."""
    replay: list[list[GpuReq]] = field(default_factory=list)
    vocab_size: int = 248320
    seconds: float | None = None
    """No workload starts after this long."""
    cut_after: float | None = None
    """A workload still running this long after the process started is ended here (its
    requests aborted) and recorded as cut: the pair's time ran out, not the engine's
    progress. Only a step that does not return is left for the campaign to stop (a hang)."""
    figures_timeout_s: float = 1200.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GpuRunRequest:
        values = dict(data)
        values["settings"] = GpuSettings(**values["settings"])
        values["replay"] = [[GpuReq(**r) for r in w] for w in values.get("replay", [])]
        return cls(**values)


def _engine_request(request: GpuRunRequest) -> DistributionRequest:
    s = request.settings
    eager = s.cudagraph_mode == "eager"
    return DistributionRequest(
        target=request.target,
        drafter=request.drafter,
        num_speculative_tokens=s.k if request.drafter else 0,
        vocab_size=request.vocab_size,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        kv_cache_memory_bytes=request.kv_cache_memory_bytes,
        cudagraph_mode=None if eager else s.cudagraph_mode,
        enforce_eager=eager,
        engine_args={
            "enable_prefix_caching": s.prefix_caching,
            "async_scheduling": s.async_scheduling,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "kv_cache_dtype": s.kv_cache_dtype,
            "mamba_ssm_cache_dtype": s.gdn_state_dtype,
            "max_logprobs": MAX_LOGPROBS,
            "disable_log_stats": False,
        },
        speculative_args=_options(s) if request.drafter else {},
    )


def _options(s: GpuSettings) -> dict[str, Any]:
    """The DFlash engine's keys of fixes 33 and 22, only where set: a vLLM without them
    refuses each key, even as 0 or false."""
    options: dict[str, Any] = {}
    if s.join_hold_steps:
        options["join_hold_steps"] = s.join_hold_steps
    if s.drafter_full_graphs is not None:
        options["dflash_full_cudagraphs"] = s.drafter_full_graphs
    return options


def _figures(engine: Any) -> EngineFigures:
    config = engine.vllm_config
    sched = config.scheduler_config
    return EngineFigures(
        block_size=int(config.cache_config.block_size),
        facts={
            "budget": int(sched.max_num_scheduled_tokens or sched.max_num_batched_tokens),
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "num_gpu_blocks": config.cache_config.num_gpu_blocks,
            "prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "async_scheduling": bool(sched.async_scheduling),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        },
    )


def _wait_for_figures(path: Path, timeout_s: float) -> EngineFigures | str:
    """The DFlash engine's figures, or why there are none (it failed to start, or never
    said within ``timeout_s``)."""
    begin = time.monotonic()
    while not path.is_file():
        if time.monotonic() - begin > timeout_s:
            return f"the DFlash engine gave no figures within {timeout_s:.0f}s"
        time.sleep(0.5)
    data = json.loads(path.read_text())
    if data.get("failed"):
        return f"the DFlash engine did not start: {data['failed']}"
    return EngineFigures(int(data["block_size"]), dict(data["facts"]))


def _one_line(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        where = f" at {frames[-1].filename.rsplit('/vllm/', 1)[-1]}:{frames[-1].lineno}"
    return f"{type(e).__name__}{where}: {' '.join(str(e).split())}"[:400]


class Driver:
    """One engine through one workload after another."""

    def __init__(self, request: GpuRunRequest, engine: Any, counter: RunningCounter) -> None:
        self.request = request
        self.engine = engine
        self.counter = counter
        self.auditor: SlotAuditor | None = None

    def run(self, index: int, reqs: list[GpuReq], cut_at: float | None = None) -> dict[str, Any]:
        """Workload ``index``: its record (``gpu_oracles.WorkloadRun``'s JSON form), ended
        at the first step that starts after ``cut_at`` (monotonic) with ``cut`` set."""
        if self.auditor is not None:
            self.auditor.audit = SlotAudit()
        before = _counters(self.engine.get_metrics()) if self.request.drafter else {}
        begin = time.monotonic()
        record: dict[str, Any] = {"index": index, "requests": [asdict(r) for r in reqs]}
        record.update(self._drive(index, reqs, cut_at))
        record["seconds"] = time.monotonic() - begin
        if self.auditor is not None:
            record["slot_audit"] = self.auditor.audit.to_json()
        if self.request.drafter and record.get("error") is None:
            after = _counters(self.engine.get_metrics())
            record["spec"] = {
                "drafts": _delta(after, before, f"{SPEC}num_drafts"),
                "accepted": _delta(after, before, f"{SPEC}num_accepted_tokens"),
            }
        return record

    def _params(self, req: GpuReq, prompt: list[int]) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=req.max_tokens,
            min_tokens=min(req.min_tokens, req.max_tokens),
            stop_token_ids=stop_ids(prompt) if req.stop else None,
            ignore_eos=True,
            detokenize=False,
            logprobs=req.logprobs,
        )

    def _drive(self, index: int, reqs: list[GpuReq], cut_at: float | None) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        engine, vocab = self.engine, self.request.vocab_size
        names = [f"w{index}r{i}" for i in range(len(reqs))]
        keys = {name: f"r{i}" for i, name in enumerate(names)}
        results: dict[str, dict[str, Any]] = {}
        last: dict[str, Any] = {}
        number = workload_number(reqs)
        pending = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
        bound = step_bound(tuple(reqs))
        steps: dict[str, list[int]] = {"scheduled": [], "produced": [], "unfinished": []}
        step, error, cut = 0, None, None
        self.counter.take_tokens()
        try:
            while True:
                while pending and reqs[pending[0]].arrival <= step:
                    i = pending.pop(0)
                    prompt = prompt_ids(number, i, reqs[i], vocab)
                    results[f"r{i}"] = {"tokens": [], "added": step}
                    try:
                        engine.add_request(
                            names[i],
                            TokensPrompt(prompt_token_ids=prompt),
                            self._params(reqs[i], prompt),
                        )
                    except ValueError as e:  # the request refused (too long): no death
                        results[f"r{i}"]["refused"] = _one_line(e)
                for i, r in enumerate(reqs):
                    live = f"r{i}" in results and not {"finished", "refused"} & set(
                        results[f"r{i}"]
                    )
                    if r.abort_at == step and live:
                        engine.abort_request([names[i]])
                        results[f"r{i}"]["aborted"] = True
                if not pending and not engine.has_unfinished_requests():
                    break
                if step >= bound:
                    break
                if cut_at is not None and time.monotonic() > cut_at:
                    cut = step
                    break
                produced = 0
                for output in engine.step():
                    # The engine may suffix the id it was given; the name is what came in.
                    rid = output.request_id
                    key = keys.get(rid) or keys[rid.rsplit("-", 1)[0]]
                    done = len(output.outputs[0].token_ids)
                    produced += max(0, done - len(results[key]["tokens"]))
                    results[key]["tokens"] = [int(t) for t in output.outputs[0].token_ids]
                    last[key] = output
                    if output.finished:
                        results[key]["finished"] = step
                steps["scheduled"].append(self.counter.take_tokens())
                steps["produced"].append(produced)
                steps["unfinished"].append(int(engine.get_num_unfinished_requests()))
                step += 1
        except Exception as e:  # the engine raised in a step: it is dead
            error = _one_line(e)
            logger.debug("workload %d: the engine raised %s", index, error)
        if error is None and engine.has_unfinished_requests():
            # Past the bound: ended here so the next workload finds the engine empty.
            engine.abort_request([names[i] for i in range(len(reqs))])
        for key, output in last.items():
            completion = output.outputs[0]
            results[key]["logprobs"] = _logprobs(completion)
            results[key]["finish_reason"] = completion.finish_reason
        return {"bound": bound, "results": results, "error": error, "cut": cut, **steps}


class Progress:
    """The run's record so far, rewritten whole after every change."""

    def __init__(self, path: Path, role: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"role": role, "workloads": [], "current": None}

    def write(self, **changes: Any) -> None:
        self.data.update(changes)
        atomic_write_text(self.path, json.dumps(self.data) + "\n")


def _workloads(request: GpuRunRequest, figures: EngineFigures) -> list[list[GpuReq]]:
    if request.replay:
        return request.replay
    return [
        list(draw_workload(request.seed, request.number, w, figures, request.settings))
        for w in range(request.workloads)
    ]


def run(request: GpuRunRequest) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    # The campaign's limit counts from the process's start: the engine's start is in it.
    begin = time.monotonic()
    deadline = None if request.seconds is None else begin + request.seconds
    cut_at = None if request.cut_after is None else begin + request.cut_after
    progress = Progress(Path(request.progress), request.role)
    figures_file = Path(request.figures_file)
    counter = RunningCounter()
    counter.install(Scheduler)
    auditor = None
    if request.drafter is not None:
        from vllm.v1.spec_decode.dflash import DFlashProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        auditor = SlotAuditor()
        auditor.install(Scheduler, GPUModelRunner, DFlashProposer)
    progress.write(vllm_version=getattr(vllm, "__version__", None))
    try:
        llm, startup_s = start_engine(_engine_request(request))
    except REFUSALS as e:
        if request.role == "dflash":
            atomic_write_text(figures_file, json.dumps({"failed": _one_line(e)}))
        progress.write(refused=_one_line(e))
        return progress.data
    except Exception as e:
        if request.role == "dflash":
            atomic_write_text(figures_file, json.dumps({"failed": _one_line(e)}))
        progress.write(start_error=_one_line(e))
        return progress.data
    engine = llm.llm_engine
    own = _figures(engine)
    progress.write(startup_s=startup_s, facts={"block_size": own.block_size, **own.facts})
    if request.role == "dflash":
        atomic_write_text(figures_file, json.dumps(asdict(own)))
        figures: EngineFigures | str = own
    else:
        figures = _wait_for_figures(figures_file, request.figures_timeout_s)
    if isinstance(figures, str):
        progress.write(no_workloads=figures)
        return progress.data
    driver = Driver(request, engine, counter)
    if auditor is not None:
        auditor.runner = engine.model_executor.driver_worker.worker.model_runner
        driver.auditor = auditor
    for index, reqs in enumerate(_workloads(request, figures)):
        if deadline is not None and time.monotonic() > deadline:
            break
        progress.write(current=index, current_requests=[asdict(r) for r in reqs])
        record = driver.run(index, reqs, cut_at)
        done = [*progress.data["workloads"], record]
        progress.write(current=None, current_requests=None, workloads=done)
        if record["error"] is not None:
            progress.write(dead=True)
            break
        if record["cut"] is not None:
            break
    return progress.data


def main(argv: list[str]) -> int:
    return serve(Path(argv[0]), Path(argv[1]), lambda data: run(GpuRunRequest.from_json(data)))


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
