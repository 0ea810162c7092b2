"""Where an engine step's time goes: the regions ``speed_run`` times, under ``torch.profiler``
(``profiled``) or with a clock and no profiler (``timed``).

A profile records every operation, which slows the host so much that the GPU has finished
each step before the host asks for its results: a host that waits for the GPU unprofiled
shows no wait in a profile. ``timed`` keeps the regions and times them with
``time.perf_counter`` alone, and times the host's waits for the GPU where the step makes
them:

- a runner's events (``RUNNER_EVENTS``), an asynchronous output's copy to the host
  (``get_output``), and the engine's wait for a step's output (``Future.result``);
- ``.item()``, ``.tolist()`` and ``.cpu()`` of a device tensor;
- a CUDA event's, a stream's or the device's ``synchronize``.

A wait inside the operations themselves (a copy to pageable host memory, a device mask's
``nonzero``) counts as its region's time only; a profile names those.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from . import trace_split

logger = logging.getLogger(__name__)

#: The region that marks each measured engine step.
STEP_REGION = "engine step"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
_DFLASH = "vllm.v1.spec_decode.dflash"
_DFLASH_MODEL = "vllm.model_executor.models.qwen3_dflash"
#: Methods timed as regions: (module, class, method, region).
REGIONS = (
    (_SCHEDULER, "Scheduler", "schedule", "scheduler: schedule"),
    (_SCHEDULER, "Scheduler", "update_from_output", "scheduler: update_from_output"),
    (_RUNNER, "GPUModelRunner", "_build_attention_metadata", "runner: attention metadata"),
    # The rest of "preprocess", on which a DFlash step spends more than plain's.
    (_RUNNER, "GPUModelRunner", "_update_states", "runner: states"),
    (_RUNNER, "GPUModelRunner", "_prepare_inputs", "runner: inputs"),
    # Within it, where a drafting engine's inputs cost more than plain's: the asynchronous
    # path's input ids, the speculative metadata, the previous rows, each row's draft
    # counts, the slot mappings and the correction of the optimistic computed tokens (a
    # function of the runner's module: no class).
    (_RUNNER, "GPUModelRunner", "_prepare_input_ids", "runner: inputs: ids"),
    (_RUNNER, "GPUModelRunner", "_calc_spec_decode_metadata", "runner: inputs: spec metadata"),
    (_RUNNER, "GPUModelRunner", "_compute_prev_positions", "runner: inputs: previous rows"),
    (_RUNNER, "GPUModelRunner", "_fill_decode_draft_tokens", "runner: inputs: draft counts"),
    (
        "vllm.v1.worker.block_table",
        "MultiGroupBlockTable",
        "compute_slot_mapping",
        "runner: inputs: slot mappings",
    ),
    (
        _RUNNER,
        None,
        "update_num_computed_tokens_for_batch_change",
        "runner: inputs: computed-token correction",
    ),
    (_RUNNER, "GPUModelRunner", "_determine_batch_execution_and_padding", "runner: dispatch"),
    (_RUNNER, "GPUModelRunner", "_update_states_after_model_execute", "hybrid: accepted tokens"),
    (
        "vllm.v1.attention.backends.gdn_attn",
        "GDNAttentionMetadataBuilder",
        "build",
        "gdn: metadata",
    ),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward", "rejection sampler"),
    # The drafter's CPU apart from its forward: what is left of "drafter: propose" once
    # the regions below are taken out is the forward's launch and the drafts' sampling.
    (_PROPOSER, "SpecDecodeBaseProposer", "propose", "drafter: propose"),
    (
        _PROPOSER,
        "SpecDecodeBaseProposer",
        "prepare_next_token_ids_padded",
        "drafter: next token ids",
    ),
    (_PROPOSER, "SpecDecodeBaseProposer", "prepare_inputs_padded", "drafter: padded inputs"),
    (_DFLASH, "DFlashProposer", "set_inputs_first_pass", "drafter: inputs"),
    (_DFLASH, "DFlashProposer", "build_model_inputs_first_pass", "drafter: context kv"),
    (_DFLASH, "DFlashProposer", "build_per_group_and_layer_attn_metadata", "drafter: metadata"),
    # A step with drafting off (patch 23) runs only this of the drafter: its share of the
    # runner's "draft" scope, and within it the context K/V's projection and writes.
    (_DFLASH, "DFlashProposer", "store_context", "drafter: store context"),
    (_DFLASH_MODEL, "DFlashQwen3ForCausalLM", "combine_hidden_states", "drafter: combine"),
    (
        _DFLASH_MODEL,
        "DFlashQwen3Model",
        "precompute_and_store_context_kv",
        "drafter: context kv write",
    ),
)
#: The model runner's events the host synchronizes on (each used through its methods alone).
RUNNER_EVENTS = (
    "prepare_inputs_event",
    "num_accepted_tokens_event",
    "valid_sampled_token_count_event",
    "draft_token_ids_event",
)
#: A wait outside every region, on the engine's own thread.
OTHER = trace_split.UNNAMED
#: The engine's wait for a step's output (the batch queue's future).
OUTPUT = "engine: a step's output"

#: A window measured with a marker: the marker is a context manager each measured step runs in.
Measure = Callable[[Callable[[], AbstractContextManager[Any]]], dict[str, Any]]


@contextlib.contextmanager
def _methods_as(regions: Any, scope: Callable[[str], AbstractContextManager[Any]]) -> Iterator:
    """Every method of ``REGIONS`` run inside ``scope(region)`` (a function of a module where
    the class is None), and vLLM's own profiling scopes too; yields the methods the release
    lacks."""
    import vllm.v1.utils as vutils

    missing: list[str] = []
    restore: list[tuple[Any, str, Any]] = []
    for module, cls_name, method, region in regions:
        found = importlib.import_module(module)
        cls = found if cls_name is None else getattr(found, cls_name, None)
        original = getattr(cls, method, None) if cls is not None else None
        if original is None:
            missing.append(f"{cls_name or module}.{method}")
            continue

        def scoped(*args: Any, __fn: Any = original, __region: str = region, **kwargs: Any) -> Any:
            with scope(__region):
                return __fn(*args, **kwargs)

        restore.append((cls, method, original))
        setattr(cls, method, scoped)
    scopes = vutils._PROFILER_FUNC
    vutils._PROFILER_FUNC = scope
    try:
        yield missing
    finally:
        vutils._PROFILER_FUNC = scopes
        for cls, method, original in reversed(restore):
            setattr(cls, method, original)


def _no_steps(window: dict[str, Any]) -> dict[str, Any]:
    """A window that measured no step: why, as its figures."""
    at_once = window.get("at_once")
    return {"error": window.get("error") or f"no steady step: {at_once} decoded at once"}


def profiled(measure: Measure) -> dict[str, Any]:
    """``measure`` under ``torch.profiler``, split per step by ``trace_split``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    logger.debug("profiling a window (%s)", ", ".join(a.name for a in activities))
    with tempfile.TemporaryDirectory(prefix="speed-trace-") as folder:
        trace = Path(folder) / "trace.json"
        with (
            _methods_as(REGIONS, record_function) as missing,
            profile(activities=activities) as prof,
        ):
            window = measure(lambda: record_function(STEP_REGION))
        if not window.get("steps"):
            return _no_steps(window)
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    steps, span = trace_split.step_window(events, STEP_REGION)
    marks = trace_split.step_marks(events, STEP_REGION)
    figures = trace_split.split(events, steps, span, marks).per_step()
    figures["slowest_forward"] = trace_split.slowest_forward(events, span)
    return {**figures, "window": window, "regions_missing": missing}


class Clock:
    """Seconds by region (inclusive, as a profile's are) and the host's waits by the region
    open around them, counted only inside the steps ``step`` marks; regions nest per thread."""

    def __init__(self) -> None:
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.waits: defaultdict[str, float] = defaultdict(float)
        self.wait_calls = 0
        self.steps = 0
        self.step_s = 0.0
        self._counting = False
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> list[str]:
        stack: list[str] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._counting = True
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.step_s += time.perf_counter() - begin
            self.steps += 1
            self._counting = False

    def region(self, name: str) -> _Region:
        return _Region(self, name)

    def wait(
        self, fn: Callable[..., Any], *args: Any, where: str | None = None, **kwargs: Any
    ) -> Any:
        counting = self._counting
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if counting:
                spent = time.perf_counter() - begin
                where = where or self._where()
                with self._lock:
                    self.waits[where] += spent
                    self.wait_calls += 1

    def _where(self) -> str:
        """The region open around a wait on this thread, else the thread's own name."""
        stack = self._stack()
        if stack:
            return stack[-1]
        if threading.current_thread() is threading.main_thread():
            return OTHER
        return f"thread {threading.current_thread().name.rstrip('_0123456789')}"

    def per_step(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "step_ms": round(self.step_s * 1000.0 / n, 4),
            "cpu_ms": {k: round(v * 1000.0 / n, 4) for k, v in self.cpu.items()},
            "sync_ms": {k: round(v * 1000.0 / n, 4) for k, v in self.waits.items()},
            "sync_calls": round(self.wait_calls / n, 2),
        }


class _Region:
    """One region's time, added to its clock's when it closes (a class, not a generator: it
    runs dozens of times a step)."""

    __slots__ = ("begin", "clock", "counting", "name")

    def __init__(self, clock: Clock, name: str) -> None:
        self.clock = clock
        self.name = name

    def __enter__(self) -> None:
        self.clock._stack().append(self.name)
        self.counting = self.clock._counting
        self.begin = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        spent = time.perf_counter() - self.begin
        self.clock._stack().pop()
        if self.counting:
            with self.clock._lock:
                self.clock.cpu[self.name] += spent


@contextlib.contextmanager
def _waits_timed(clock: Clock, runner: Any) -> Iterator[None]:
    """The host's waits (the module's list) through ``clock.wait``, put back on leaving."""
    import concurrent.futures

    import torch

    restore: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name in ("item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)

        def on_device(self: Any, *args: Any, __fn: Any = original, **kwargs: Any) -> Any:
            if self.is_cuda:
                return clock.wait(__fn, self, *args, **kwargs)
            return __fn(self, *args, **kwargs)

        swap(torch.Tensor, name, on_device)
    # A CPU runner's stand-ins for these have no synchronize of their own.
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        if (sync := getattr(owner, "synchronize", None)) is not None:
            swap(owner, "synchronize", lambda self, __fn=sync: clock.wait(__fn, self))
    swap(
        torch.cuda,
        "synchronize",
        lambda *a, __fn=torch.cuda.synchronize, **kw: clock.wait(__fn, *a, **kw),
    )
    result = concurrent.futures.Future.result
    swap(
        concurrent.futures.Future,
        "result",
        lambda self, *a, **kw: clock.wait(result, self, *a, where=OUTPUT, **kw),
    )
    runner_module = importlib.import_module(_RUNNER)
    output = getattr(runner_module, "AsyncGPUModelRunnerOutput", None)
    if output is not None:
        swap(output, "get_output", lambda self, __fn=output.get_output: clock.wait(__fn, self))

    class TimedEvent:
        """A runner's event whose ``synchronize`` is timed; ``type(event)()`` makes another."""

        def __init__(self, inner: Any = None) -> None:
            self._inner = torch.Event() if inner is None else inner

        def synchronize(self) -> None:
            clock.wait(self._inner.synchronize)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    for name in RUNNER_EVENTS:
        event = getattr(runner, name, None)
        if event is not None:
            swap(runner, name, TimedEvent(event))
    try:
        yield
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


def timed(runner: Any, measure: Measure, regions: Any = REGIONS) -> dict[str, Any]:
    """``measure`` with its steps timed by a ``Clock`` (no profiler): per step, the step's ms,
    each region's (``regions`` and vLLM's own scopes) and the host's waits by region."""
    clock = Clock()
    with _methods_as(regions, clock.region) as missing, _waits_timed(clock, runner):
        if missing:
            logger.debug("regions the release lacks, not timed: %s", ", ".join(missing))
        window = measure(clock.step)
    if not window.get("steps"):
        return _no_steps(window)
    return {**clock.per_step(), "window": window, "regions_missing": missing}
