"""Where a profiled window of engine steps spent its time, read from torch's Chrome trace.

Pure: ``split`` takes the trace's events (``torch.profiler`` ``export_chrome_trace``) and the
number of engine steps in the window, and returns per-step figures:

- GPU time by what launched each kernel: a kernel's launch (its ``cuda_runtime`` event, found
  by correlation id) lies inside CPU regions (``user_annotation``: vLLM's own scopes and the
  ones ``speed_run`` adds); the innermost region named in ``REGION_CATEGORIES`` gives the
  category, and within the target's forward the kernel's name splits out the Gated DeltaNet
  and attention kernels;
- the GPU's busy time (the union of kernel intervals) and so its idle time;
- CPU time per region, and host waits (``Synchronize`` calls and blocking copies) per region;
- the target forward's CPU time by its outermost operations (torch ops and runtime calls not
  inside another): whether a forward's host time goes to launches, to one op, or to Python
  between ops.

The GPU host runs it right after each profile, so only the figures come back.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

#: Regions, innermost first wins, and the category their kernels and CPU time count under.
REGION_CATEGORIES: dict[str, str] = {
    "scheduler: schedule": "scheduler",
    "scheduler: update_from_output": "scheduler",
    "gpu_model_runner: preprocess": "inputs and metadata",
    "runner: attention metadata": "inputs and metadata",
    "runner: states": "inputs and metadata",
    "runner: inputs": "inputs and metadata",
    "runner: inputs: ids": "inputs and metadata",
    "runner: inputs: spec metadata": "inputs and metadata",
    "runner: inputs: previous rows": "inputs and metadata",
    "runner: inputs: draft counts": "inputs and metadata",
    "runner: inputs: slot mappings": "inputs and metadata",
    "runner: inputs: computed-token correction": "inputs and metadata",
    "runner: dispatch": "inputs and metadata",
    "gdn: metadata": "inputs and metadata",
    "gpu_model_runner: forward": "target forward",
    "gpu_model_runner: postprocess": "bookkeeping",
    "gpu_model_runner: sample": "sampling",
    "rejection sampler": "rejection sampling",
    "hybrid: accepted tokens": "bookkeeping",
    "gpu_model_runner: draft": "drafter",
    "drafter: propose": "drafter",
    "drafter: next token ids": "drafter inputs and metadata",
    "drafter: padded inputs": "drafter inputs and metadata",
    "drafter: inputs": "drafter inputs and metadata",
    "drafter: metadata": "drafter inputs and metadata",
    "drafter: context kv": "drafter context KV",
    "drafter: store context": "drafter",
    "drafter: combine": "drafter",
    "drafter: context kv write": "drafter context KV",
    "gpu_model_runner: bookkeep": "bookkeeping",
    "gpu_model_runner: ModelRunnerOutput": "bookkeeping",
}
#: Kernels of the target's forward counted apart, by name.
KERNEL_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "target forward: GDN",
        re.compile(
            r"fused_recurrent|gated_delta|causal_conv1d|chunk_|l2norm|solve_tril|"
            r"recompute_w_u|fused_gdn|gdn_|kkt|fused_sigmoid_gating",
            re.I,
        ),
    ),
    ("target forward: attention", re.compile(r"flash|fmha|attn|attention", re.I)),
)
#: Runtime calls during which the host waits for the device.
SYNC = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaStreamWaitEvent", re.I)
#: Runtime calls of the device memory allocator (a caching allocator that found no block calls
#: them; ``cudaFree`` waits for the device).
ALLOC = re.compile(r"cudaMalloc|cudaFree|cuMem(Create|Map|Unmap|Release|SetAccess|Address)", re.I)
#: The most events ``slowest_forward`` keeps.
FORWARD_EVENTS = 4000
#: How many regions back ``_Regions.innermost`` looks for one still open.
LOOKBACK = 256
#: Outside every named region.
UNNAMED = "other (engine loop, Python)"
#: The region whose CPU time is split by its outermost operations, and how many are kept.
FORWARD = "gpu_model_runner: forward"
FORWARD_OPS = 12
#: The forward's CPU time outside every operation.
BETWEEN_OPS = "(between operations: Python)"


@dataclass
class Split:
    steps: int
    window_ms: float
    gpu_busy_ms: float
    gpu_ms: dict[str, float] = field(default_factory=dict)
    cpu_ms: dict[str, float] = field(default_factory=dict)
    sync_ms: dict[str, float] = field(default_factory=dict)
    sync_calls: int = 0
    alloc_ms: dict[str, float] = field(default_factory=dict)
    alloc_calls: int = 0
    kernels: int = 0
    top_kernels: list[tuple[str, float, int]] = field(default_factory=list)
    forward_ops: dict[str, float] = field(default_factory=dict)

    def per_step(self) -> dict[str, Any]:
        n = max(self.steps, 1)

        def each(values: dict[str, float]) -> dict[str, float]:
            return {k: round(v / n, 4) for k, v in sorted(values.items(), key=lambda i: -i[1])}

        return {
            "steps": self.steps,
            "step_ms": round(self.window_ms / n, 4),
            "gpu_busy_ms": round(self.gpu_busy_ms / n, 4),
            "gpu_idle_ms": round(max(self.window_ms - self.gpu_busy_ms, 0.0) / n, 4),
            "gpu_ms": each(self.gpu_ms),
            "cpu_ms": each(self.cpu_ms),
            "forward_ops": each(self.forward_ops),
            "sync_ms": each(self.sync_ms),
            "sync_calls": round(self.sync_calls / n, 2),
            "alloc_ms": each(self.alloc_ms),
            "alloc_calls": round(self.alloc_calls / n, 2),
            "kernels": round(self.kernels / n, 1),
            "top_kernels": [
                {"name": name[:120], "ms_per_step": round(ms / n, 4), "per_step": round(c / n, 2)}
                for name, ms, c in self.top_kernels
            ],
        }


@dataclass(frozen=True)
class _Region:
    name: str
    begin: float
    end: float


class _Regions:
    """The named CPU regions of one thread, to find the innermost one around an instant."""

    def __init__(self, regions: list[_Region]) -> None:
        self.regions = sorted(regions, key=lambda r: r.begin)
        self.begins = [r.begin for r in self.regions]

    def innermost(self, ts: float) -> str | None:
        # Regions of one thread nest, so the latest-begun region still open at ts is the
        # innermost; one engine step opens a few dozen, so a region further back than
        # LOOKBACK belongs to an earlier step.
        index = bisect.bisect_right(self.begins, ts)
        for r in reversed(self.regions[max(index - LOOKBACK, 0) : index]):
            if r.end >= ts:
                return r.name
        return None


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for begin, finish in sorted(intervals):
        if finish <= end:
            continue
        total += finish - max(begin, end)
        end = finish
    return total / 1000.0


def _category(region: str | None, kernel: str) -> str:
    if region is None:
        return UNNAMED
    category = REGION_CATEGORIES[region]
    if category == "target forward":
        for kind, pattern in KERNEL_KINDS:
            if pattern.search(kernel):
                return kind
    return category


def split(
    events: list[dict[str, Any]],
    steps: int,
    window: tuple[float, float],
    marks: list[tuple[float, float]] | None = None,
) -> Split:
    """The time of ``steps`` engine steps whose first began at ``window[0]`` and last ended at
    ``window[1]`` (trace microseconds), from the trace's ``events``; with ``marks`` (each
    step's span, ``step_marks``), only what began inside a step counts, and the steps' own
    time: a window whose marked steps have others between them (prompts joining, each
    marked to its first token) is not charged for those."""
    begin, end = window
    inside = [e for e in events if e.get("ph") == "X" and begin <= float(e.get("ts", -1)) <= end]
    if marks is not None:
        starts = [start for start, _ in marks]

        def marked(ts: float) -> bool:
            at = bisect.bisect_right(starts, ts) - 1
            return at >= 0 and ts <= marks[at][1]

        inside = [e for e in inside if marked(float(e["ts"]))]
    by_thread: dict[Any, list[_Region]] = defaultdict(list)
    cpu_ms: defaultdict[str, float] = defaultdict(float)
    for e in inside:
        if e.get("cat") == "user_annotation" and e.get("name") in REGION_CATEGORIES:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            by_thread[e.get("tid")].append(_Region(e["name"], ts, ts + dur))
            cpu_ms[e["name"]] += dur / 1000.0
    regions = {tid: _Regions(r) for tid, r in by_thread.items()}

    def region_of(e: dict[str, Any]) -> str | None:
        found = regions.get(e.get("tid"))
        return found.innermost(float(e["ts"])) if found else None

    launches: dict[Any, str | None] = {}
    sync_ms: defaultdict[str, float] = defaultdict(float)
    alloc_ms: defaultdict[str, float] = defaultdict(float)
    sync_calls = alloc_calls = 0
    for e in inside:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        where = region_of(e)
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            launches[correlation] = where
        if SYNC.search(str(e.get("name", ""))):
            sync_calls += 1
            sync_ms[where or UNNAMED] += float(e.get("dur", 0.0)) / 1000.0
        if ALLOC.search(str(e.get("name", ""))):
            alloc_calls += 1
            alloc_ms[where or UNNAMED] += float(e.get("dur", 0.0)) / 1000.0
    gpu_ms: defaultdict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    for e in kernels:
        correlation = (e.get("args") or {}).get("correlation")
        if correlation not in launches:
            continue  # launched outside the window
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        intervals.append((ts, ts + dur))
        name = str(e.get("name", ""))
        gpu_ms[_category(launches[correlation], name)] += dur / 1000.0
        per_kernel[name][0] += dur / 1000.0
        per_kernel[name][1] += 1
    top = sorted(per_kernel.items(), key=lambda i: -i[1][0])[:25]
    return Split(
        steps=steps,
        window_ms=((end - begin if marks is None else sum(b - a for a, b in marks)) / 1000.0),
        gpu_busy_ms=_union_ms(intervals),
        gpu_ms=dict(gpu_ms),
        cpu_ms=dict(cpu_ms),
        sync_ms=dict(sync_ms),
        sync_calls=sync_calls,
        alloc_ms=dict(alloc_ms),
        alloc_calls=alloc_calls,
        kernels=len(intervals),
        top_kernels=[(name, ms, int(count)) for name, (ms, count) in top],
        forward_ops=outermost_ops(inside, region_of, cpu_ms.get(FORWARD, 0.0)),
    )


def outermost(spans: Iterable[tuple[float, float, T]]) -> list[tuple[float, float, T]]:
    """Of ``spans`` (start, duration, item) of one thread, those inside no other, in order:
    where one starts before the last taken has ended, it is that one's."""
    taken: list[tuple[float, float, T]] = []
    end = float("-inf")
    for start, dur, item in sorted(spans, key=lambda s: (s[0], -s[1])):
        if start < end:
            continue
        taken.append((start, dur, item))
        end = start + dur
    return taken


def outermost_ops(
    inside: list[dict[str, Any]], region_of: Any, forward_ms: float
) -> dict[str, float]:
    """The forward's CPU ms by its outermost operations (``FORWARD_OPS`` of them, the rest
    summed as "other operations"), and its time between them."""
    by_thread: defaultdict[Any, list[tuple[float, float, dict[str, Any]]]] = defaultdict(list)
    for e in inside:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            by_thread[e.get("tid")].append((float(e["ts"]), float(e.get("dur", 0.0)), e))
    by_name: defaultdict[str, float] = defaultdict(float)
    for spans in by_thread.values():
        for _, dur, e in outermost(spans):
            if region_of(e) == FORWARD:
                by_name[str(e.get("name", ""))] += dur / 1000.0
    ranked = sorted(by_name.items(), key=lambda i: -i[1])
    kept = dict(ranked[:FORWARD_OPS])
    rest = sum(ms for _, ms in ranked[FORWARD_OPS:])
    if rest:
        kept["other operations"] = rest
    if by_name:
        kept[BETWEEN_OPS] = max(forward_ms - sum(by_name.values()), 0.0)
    return kept


def slowest_forward(events: list[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """The longest target forward in ``window``, event by event (CPU ops, runtime calls and
    regions inside it, at most ``FORWARD_EVENTS``): each as [microseconds from its start,
    duration, category, name], so that where a forward's host time goes can be read off one
    step, not only summed."""
    begin, end = window
    forwards = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("name") == FORWARD
        and begin <= float(e.get("ts", -1)) <= end
    ]
    if not forwards:
        return {}
    slowest = max(forwards, key=lambda e: float(e.get("dur", 0.0)))
    start, dur, tid = float(slowest["ts"]), float(slowest.get("dur", 0.0)), slowest.get("tid")
    kinds = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
    inside = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("tid") == tid
            and e.get("cat") in kinds
            and start <= float(e.get("ts", -1)) <= start + dur
            and e is not slowest
        ),
        key=lambda e: float(e["ts"]),
    )
    rows = [
        [round(float(e["ts"]) - start, 1), round(float(e.get("dur", 0.0)), 1), e["cat"], e["name"]]
        for e in inside[:FORWARD_EVENTS]
    ]
    return {"ms": round(dur / 1000.0, 3), "events": len(inside), "rows": rows}


def step_marks(events: list[dict[str, Any]], marker: str) -> list[tuple[float, float]]:
    """Each step ``speed_run`` marked (``user_annotation`` events named ``marker``): its
    start and end, in order."""
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == marker]
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in marks)


def step_window(events: list[dict[str, Any]], marker: str) -> tuple[int, tuple[float, float]]:
    """The engine steps ``speed_run`` marked (``user_annotation`` events named ``marker``):
    their count and the span from the first's start to the last's end."""
    marks = step_marks(events, marker)
    if not marks:
        raise ValueError(f"the trace has no {marker!r} regions")
    return len(marks), (marks[0][0], max(end for _, end in marks))
