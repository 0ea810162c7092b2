"""One engine's decode speed on the trained pair, and where its step's time goes.

Runs on the GPU host as ``python -m tooling.trained.serving.speed_run IN.json OUT.json`` in the
interpreter of the vLLM under test, one engine per process, compiled with CUDA graphs (or as
the request's engine arguments say). ``tooling.trained.speed`` plans the engines and reports.

For each concurrency level, once every engine of the run has warmed up (the first traffic of
each shape, where compiles and autotuning happen) and while it alone uses the GPU (it holds
the run's lock throughout, or, interleaved, takes turns with the other engines unit by unit:
``turns``):

- **passes**: ``passes`` batches of ``level`` prompts, ``max_new_tokens`` each (greedy, no
  EOS), timed end to end: tokens/s, as the trained pair's speed table has them, with the
  acceptance length from vLLM's own counters and the CUDA-graph dispatch of every step;
- **sustained** (with ``sustained``): ``passes`` windows with ``level`` requests kept in
  flight, each finished one replaced at once (``sustained``): tokens/s as a server under
  steady traffic makes them, which no request's tail decides, and each step's time by the
  target's CUDA-graph mode;
- **steps**: ``level`` requests, once all are decoding, ``window_steps`` engine steps timed one
  by one: the step time and the tokens each step gave (with ``sustained``, ``passes`` of
  them in turns, each kept in ``steady``);
- **profile** (levels in ``profile_levels``): ``profile_steps`` such steps under
  ``torch.profiler``, split by ``trace_split`` into GPU time by what launched it, CPU time by
  region and host waits; with ``sustained``, one such window profiled too
  (``profile_sustained``), and at one request, where a prompt joins few steps,
  ``JOINS`` prompts one after another, each from its arrival to its first token
  (``profile_joining``); vLLM's own profiling scopes are on only inside a profile;
- **timed** (the same levels): the same windows again with no profiler, each region and each
  wait of the host for the GPU timed by a clock (``regions.timed``: ``timed``,
  ``timed_sustained``, ``timed_joining``), since a profile slows the host until the GPU
  never keeps it waiting.

Around each unit it reads what else the host did meanwhile (``beside``): a unit measured
beside other work measures that work too; and the GPU's clock (``gpu_clock``): the same
kernels run slower in a window where the clock is held down.

Across the measured units it also reports anything compiled, captured or autotuned again
(vLLM's compilation counter, Dynamo's counters, the entries of every Triton autotuner, and
every Triton kernel compiled: ``watch.Stalls``, in each level's warm-up too).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...smoke.serving.child import exit_now, serve
from ...smoke.serving.distribution import DistributionRequest, RunningCounter, start_engine
from . import beside, gpu_clock, sustained
from .recompiles import compiles, grown
from .regions import Measure, profiled, timed
from .sustained import acceptance_length
from .trained_run import _generate, _mark_done, _spec, _wait_for_barrier
from .turns import Turns, whole_run
from .watch import Dispatches, Watch, totals_grown

logger = logging.getLogger(__name__)


@dataclass
class SpeedRunRequest:
    name: str
    engine: DistributionRequest
    prompts: list[list[int]]
    levels: list[int]
    passes: int
    max_new_tokens: int
    window_steps: int
    profile_levels: list[int]
    profile_steps: int
    lock: str
    """A file every engine of the run locks while it measures, so no figure shares the GPU."""
    barrier: str
    """A folder where each engine leaves a file once warm."""
    barrier_count: int
    barrier_timeout_s: float = 900.0
    constant_logits: bool = False
    """Afterwards, zero every LM head (target's and drafter's): all logits are equal, greedy
    picks token 0 everywhere and every draft is accepted; then time the steps again."""
    partial: str | None = None
    """Where the figures so far are written after each unit, for a run cut short."""
    sustained: bool = False
    """Also ``passes`` windows at each level with the batch kept full (``sustained``)."""
    staggered: bool = False
    """The windows' requests of staggered lengths (``sustained.staggered_length``), so that
    they end at different steps whatever the engine."""
    turns: dict[str, Any] | None = None
    """``Turns``' fields: measure in turns with the run's other engines, unit by unit;
    None: hold the run's lock for every unit at once."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeedRunRequest:
        values = dict(data)
        values["engine"] = DistributionRequest.from_json(values["engine"])
        return cls(**values)


def _runner(llm: Any) -> Any:
    return llm.collective_rpc(lambda worker: worker.model_runner)[0]


def _one_pass(
    llm: Any, request: SpeedRunRequest, level: int, running: RunningCounter, seen: Dispatches
) -> dict[str, Any]:
    batch = [request.prompts[i % len(request.prompts)] for i in range(level)]
    running.most = 0
    seen.take()
    before = _spec(llm)
    begin = time.perf_counter()
    done = _generate(llm, batch, request.max_new_tokens, None)
    seconds = time.perf_counter() - begin
    return {
        "seconds": seconds,
        "tokens": sum(len(o.outputs[0].token_ids) for o in done),
        "most_running": running.most,
        "acceptance_length": acceptance_length(before, _spec(llm)),
        "dispatch": seen.take(),
    }


def _decoding_window(
    llm: Any,
    request: SpeedRunRequest,
    level: int,
    steps: int,
    mark: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """``level`` requests; once each has decoded a token, ``steps`` engine steps timed one by
    one (each inside ``mark()`` where given); the rest aborted and drained."""
    from vllm.inputs import TokensPrompt

    from ...smoke.serving.distribution import greedy_params

    engine = llm.llm_engine
    k = request.engine.num_speculative_tokens
    ids = [f"window-{level}-{time.monotonic_ns()}-{i}" for i in range(level)]
    for i, rid in enumerate(ids):
        prompt = request.prompts[i % len(request.prompts)]
        room = request.engine.max_model_len - len(prompt) - k - 2
        tokens = max(min(room, (steps + 8) * (k + 1) + 8), 1)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), greedy_params(tokens, None))
    made: dict[str, int] = dict.fromkeys(ids, 0)
    finished: set[str] = set()

    def step() -> None:
        for out in engine.step():
            if out.request_id not in made:
                continue
            made[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)

    warm_steps = 0
    # A request that ends before the last has decoded: the engine could not hold them all.
    while min(made.values()) < 1 and not finished and warm_steps < 10_000:
        step()
        warm_steps += 1
    at_once = sum(1 for r in ids if made[r] >= 1)
    start = dict(made)
    times = []
    for _ in range(steps):
        if finished or at_once < level:
            break
        begin = time.perf_counter()
        with mark() if mark is not None else contextlib.nullcontext():
            step()
        times.append((time.perf_counter() - begin) * 1000.0)
    tokens = sum(made[r] - start[r] for r in ids)
    engine.abort_request([r for r in ids if r not in finished])
    while engine.has_unfinished_requests():
        engine.step()
    # As a pass's figures: the tokens made and the time the timed steps took.
    timed: dict[str, float] = {"tokens": tokens, "seconds": sum(times) / 1000.0} if times else {}
    return {
        "steps": len(times),
        **timed,
        "step_ms_median": statistics.median(times) if times else None,
        "step_ms_mean": statistics.fmean(times) if times else None,
        "tokens_per_step": tokens / len(times) if times else None,
        "prefill_steps": warm_steps,
        "at_once": at_once,
    }


def _save_partial(request: SpeedRunRequest, figures: dict[str, Any]) -> None:
    if request.partial is None:
        return
    path = Path(request.partial)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps({"ok": False, "error": "cut short", **figures}))
    os.replace(temp, path)


def _zero_lm_heads(worker: Any) -> int:
    """Zero the LM head of the target and of the drafter; how many heads were zeroed."""
    runner = worker.model_runner
    models = [runner.get_model()]
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    if drafter is not None:
        models.append(drafter)
    zeroed = 0
    for model in models:
        model = model.unwrap() if hasattr(model, "unwrap") else model
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if name.split(".")[-1] == "lm_head" and weight is not None:
                weight.data.zero_()
                zeroed += 1
    return zeroed


#: The caching allocator's counters a window reports the change of: a block it found no room
#: for makes it free its cached blocks (``cudaFree`` waits for the device) and try again.
ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def allocator_counts() -> dict[str, int]:
    """This process's caching allocator's ``ALLOCATOR_STATS`` (the worker runs in it: vLLM's
    in-process executor); none without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_STATS}


def _window(llm: Any, request: SpeedRunRequest, watch: Watch, level: int, **kwargs: Any) -> dict:
    """One window with the batch kept full at ``level`` (``sustained.run_window``), each step
    filed by the forwards ``watch`` saw dispatched and the prompts it saw join, and what the
    caching allocator did while it ran; ``kwargs``: the rest of ``run_window``'s options
    (``stalls``, ``marker``, ``measured``)."""
    before = allocator_counts()
    window: dict[str, Any] = sustained.run_window(
        llm,
        request.prompts,
        level,
        request.max_new_tokens,
        watch.dispatches.take,
        joined=watch.joins.take,
        staggered=request.staggered,
        **kwargs,
    )
    after = allocator_counts()
    window["allocator"] = {name: after[name] - before[name] for name in after}
    return window


#: A joining window's prompts (``_joining_window``): how many are marked, and the tokens each
#: makes (its first, then a verify step or a decode before the next prompt joins).
JOINS = 16
JOIN_TOKENS = 2


def _joining_window(
    llm: Any,
    request: SpeedRunRequest,
    watch: Watch,
    mark: Callable[[], AbstractContextManager[Any]],
) -> dict[str, Any]:
    """``JOINS`` prompts at one request, each marked from its arrival to its first token."""
    return sustained.run_window(
        llm,
        request.prompts,
        1,
        JOIN_TOKENS,
        watch.dispatches.take,
        marker=mark,
        # The prompt after the first completion arrives before the window opens.
        measured=JOINS + 1,
        joined=watch.joins.take,
        joins=True,
    )


def _units(
    llm: Any,
    request: SpeedRunRequest,
    running: RunningCounter,
    figures: dict[str, Any],
    watch: Watch,
) -> Iterator[tuple[str, Callable[[], None]]]:
    """The run's units of measuring, in order; each fills ``figures`` when called."""
    seen = watch.dispatches
    for level in request.levels:
        key = str(level)

        def one_pass(level: int = level, key: str = key) -> None:
            figures["speed"].setdefault(key, []).append(
                _one_pass(llm, request, level, running, seen)
            )

        def one_window(level: int = level, key: str = key) -> None:
            window = _window(llm, request, watch, level, stalls=watch.stalls.take)
            figures["sustained"].setdefault(key, []).append(window)

        def steps(level: int = level, key: str = key) -> None:
            window = _decoding_window(llm, request, level, request.window_steps)
            figures["steps"].setdefault(key, window)
            if request.sustained:
                figures["steady"].setdefault(key, []).append(window)

        def profile(level: int = level, key: str = key) -> None:
            windows: list[tuple[str, Measure]] = [
                (
                    "",
                    lambda mark: _decoding_window(
                        llm, request, level, request.profile_steps, mark=mark
                    ),
                )
            ]
            # The steps a server under steady traffic runs, prompts joining included: above one
            # request, where most steps have one; at one request they are rare and a window's
            # trace would be long.
            if request.sustained and level > 1:
                windows.append(
                    (
                        "_sustained",
                        lambda mark: _window(
                            llm, request, watch, level, marker=mark, measured=level
                        ),
                    )
                )
            # At one request a joining step is rare and far longer than a decode step, so its
            # own window: prompts of a few tokens each, one after another, each marked from
            # its arrival to its first token.
            elif request.sustained:
                windows.append(
                    ("_joining", lambda mark: _joining_window(llm, request, watch, mark))
                )
            runner = _runner(llm)
            how: list[tuple[str, Callable[[Measure], dict[str, Any]]]] = [
                ("profile", profiled),
                ("timed", lambda measure: timed(runner, measure)),
            ]
            for (kind, split), (suffix, measure) in itertools.product(how, windows):
                kept = figures.setdefault(kind + suffix, {})
                try:
                    kept[key] = split(measure)
                except Exception as exc:  # a split that fails leaves the speed figures
                    logger.exception("%s%s at %d", kind, suffix, level)
                    kept[key] = {"error": f"{type(exc).__name__}: {exc}"}

        for _ in range(request.passes):
            yield f"pass at {level}", one_pass
        for _ in range(request.passes if request.sustained else 0):
            yield f"sustained window at {level}", one_window
        # With the batch kept full (the bar's run), steady windows in turns as well: single
        # passes on a shared host spread too much to hold plain to stock by.
        for _ in range(request.passes if request.sustained else 1):
            yield f"steps at {level}", steps
        if level in request.profile_levels:
            yield f"profile at {level}", profile


def _constant_logits(llm: Any, request: SpeedRunRequest) -> dict[str, Any]:
    zeroed = sum(llm.collective_rpc(_zero_lm_heads))
    return {
        "lm_heads_zeroed": zeroed,
        "steps": {
            str(level): _decoding_window(llm, request, level, request.window_steps)
            for level in request.levels
        },
    }


def run_unit(
    name: str, unit: Callable[[], None], figures: dict[str, Any], turns: Turns | None
) -> None:
    """One unit in its turn, what else the host did meanwhile (``beside``) and the GPU's
    clock (``gpu_clock``)."""
    with turns.turn() if turns is not None else contextlib.nullcontext():
        host, clock = beside.sample(), gpu_clock.mark()
        unit()
        other = beside.beside(host, beside.sample())
        clocked = gpu_clock.since(clock)
    if other is not None or clocked is not None:
        figures.setdefault("beside", []).append({"unit": name, **(other or {}), **(clocked or {})})


def _measure(
    llm: Any,
    request: SpeedRunRequest,
    running: RunningCounter,
    turns: Turns | None,
    watch: Watch,
) -> dict[str, Any]:
    """Every unit, alone on the GPU: all in one hold of the run's lock, or interleaved with
    the other engines' units (``turns``)."""
    before = compiles()
    compiled = watch.compiled_so_far()
    figures: dict[str, Any] = {"speed": {}, "steps": {}, "steady": {}, "profile": {}}
    if request.sustained:
        figures["sustained"] = {}
    held = whole_run(Path(request.lock)) if turns is None else contextlib.nullcontext()
    with held:
        for name, unit in _units(llm, request, running, figures, watch):
            logger.info("%s: %s", request.name, name)
            run_unit(name, unit, figures, turns)
            _save_partial(request, figures)
        figures["steady_changes"] = grown(before, compiles())
        figures["triton_compiled"] = totals_grown(compiled, watch.compiled_so_far())
        if request.constant_logits:
            with turns.turn() if turns is not None else contextlib.nullcontext():
                figures["constant_logits"] = _constant_logits(llm, request)
    return figures


def _warm(llm: Any, request: SpeedRunRequest, watch: Watch) -> dict[str, Any]:
    """The first traffic of each level's shapes, before the measured passes; with
    ``sustained``, a short window with the batch kept full as well, whose mixed steps no batch
    runs, with the Triton kernels the level's warm-up compiled."""
    warm: dict[str, Any] = {}
    for level in request.levels:
        compiled = watch.compiled_so_far()
        batch = [request.prompts[i % len(request.prompts)] for i in range(level)]
        begin = time.perf_counter()
        done = _generate(llm, batch, request.max_new_tokens, None)
        warm[str(level)] = {
            "seconds": time.perf_counter() - begin,
            "tokens": sum(len(o.outputs[0].token_ids) for o in done),
        }
        _decoding_window(llm, request, level, 4)
        if request.sustained:
            warm[str(level)]["sustained_cold"] = _window(
                llm, request, watch, level, measured=level, stalls=watch.stalls.take
            )
        warm[str(level)]["triton_compiled"] = totals_grown(compiled, watch.compiled_so_far())
    return warm


def run(request: SpeedRunRequest) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    running = RunningCounter()
    running.install(Scheduler)
    turns = Turns(**request.turns) if request.turns is not None else None
    try:
        try:
            llm, startup_s = start_engine(request.engine)
            watch = Watch.installed(_runner(llm).cudagraph_dispatcher)
            warm = _warm(llm, request, watch)
        finally:
            # An engine that failed must not keep the others waiting.
            _mark_done(request)  # type: ignore[arg-type]
        waited = _wait_for_barrier(request)  # type: ignore[arg-type]
        measured = _measure(llm, request, running, turns, watch)
    finally:
        # Done or failed at any point: the others take their turns without this engine's.
        if turns is not None:
            turns.finish()
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    return {
        "name": request.name,
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_location": str(Path(vllm.__file__).parent),
        "startup_s": startup_s,
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "max_num_scheduled_tokens": config.scheduler_config.max_num_scheduled_tokens,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "num_speculative_tokens": request.engine.num_speculative_tokens,
        "barrier_wait_s": waited,
        "warm": warm,
        **measured,
    }


def main(argv: list[str]) -> int:
    return serve(Path(argv[0]), Path(argv[1]), lambda data: run(SpeedRunRequest.from_json(data)))


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
