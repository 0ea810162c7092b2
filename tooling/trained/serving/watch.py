"""What an engine did between two looks, seen by wrapping or hooking what it calls, each
counted until its ``take``:

- ``Dispatches``: the CUDA-graph mode and padded size of every forward dispatched;
- ``Joins``: the prompts vLLM's scheduler admitted;
- ``Stalls``: Triton kernels compiled (or loaded from Triton's disk cache) and Python's garbage
  collections, which hold the step that meets them and which neither a steady step nor
  vLLM's compile counters show.

Runs in the interpreter of the vLLM under test.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class Dispatches:
    """The CUDA-graph mode and padded size of every forward the engine dispatched, the target's
    and the drafter's apart (wraps ``CudagraphDispatcher.dispatch``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.target: Any = None

    def install(self) -> None:
        from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

        original = CudagraphDispatcher.dispatch
        seen = self

        def dispatch(self: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            mode, descriptor = original(self, num_tokens, *args, **kwargs)
            who = "target" if self is seen.target else "drafter"
            padded = getattr(descriptor, "num_tokens", num_tokens)
            seen.counts[f"{who} {getattr(mode, 'name', mode)} {num_tokens}->{padded}"] += 1
            return mode, descriptor

        CudagraphDispatcher.dispatch = dispatch  # type: ignore[method-assign]

    def take(self) -> dict[str, int]:
        out = dict(self.counts.most_common())
        self.counts.clear()
        return out


class Joins:
    """How many prompts vLLM's scheduler admitted since the last ``take`` (wraps
    ``Scheduler.schedule``, which the in-process engine calls inside each step)."""

    def __init__(self) -> None:
        self.joined = 0

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.schedule
        seen = self

        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            seen.joined += len(out.scheduled_new_reqs)
            return out

        Scheduler.schedule = schedule  # type: ignore[method-assign]

    def take(self) -> int:
        joined, self.joined = self.joined, 0
        return joined


class Stalls:
    """Triton compiles and garbage collections since the last ``take``, each with its ms.

    Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles a specialization its
    in-memory cache lacks (a load from its disk cache included) and ``jit_post_compile_hook``
    after, so a launch that hits the cache costs these hooks nothing. Hooks set before are
    called as well, and the cache hook's answer stays theirs (a true answer skips the compile).
    """

    def __init__(self) -> None:
        self.compiled: list[tuple[str, float]] = []
        self.gc_ms = 0.0
        self.collections = 0
        self.hooked = False
        #: Every kernel compiled since ``install``, never cleared by ``take``: [times, ms].
        self.totals: dict[str, list[float]] = {}
        self._began: dict[tuple[str, int], float] = {}
        self._gc_began: float | None = None

    def install(self) -> None:
        gc.callbacks.append(self._collection)
        try:
            from triton import knobs
        except ImportError:
            logger.warning("Triton has no knobs here: its compiles are not counted")
            return
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook = lambda **kw: self._compiling(before, **kw)
        runtime.jit_post_compile_hook = lambda **kw: self._compiled(after, **kw)
        self.hooked = True

    @staticmethod
    def _name(fn: Any) -> str:
        return f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"

    def _compiling(self, chained: Any, **kw: Any) -> Any:
        self._began[(self._name(kw.get("fn")), id(kw.get("key")))] = time.perf_counter()
        return chained(**kw) if chained is not None else False

    def _compiled(self, chained: Any, **kw: Any) -> Any:
        name = self._name(kw.get("fn"))
        began = self._began.pop((name, id(kw.get("key"))), None)
        ms = (time.perf_counter() - began) * 1000.0 if began is not None else 0.0
        self.compiled.append((name, round(ms, 3)))
        tally(self.totals, name, ms)
        return chained(**kw) if chained is not None else None

    def _collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_ms += (time.perf_counter() - self._gc_began) * 1000.0
            self.collections += 1
            self._gc_began = None

    def take(self) -> dict[str, Any]:
        out = {
            "compiled": self.compiled,
            "gc_ms": round(self.gc_ms, 3),
            "collections": self.collections,
        }
        self.compiled, self.gc_ms, self.collections = [], 0.0, 0
        return out


def tally(table: dict[str, list[float]], name: str, ms: float) -> None:
    """One compile of ``name`` that took ``ms``, added to ``table`` ([times, ms in all])."""
    kept = table.setdefault(name, [0, 0.0])
    kept[0] += 1
    kept[1] = round(kept[1] + ms, 3)


def totals_grown(
    before: dict[str, list[float]], after: dict[str, list[float]]
) -> dict[str, list[float]]:
    """The kernels ``Stalls.totals`` gained between two copies of it: [times, ms]."""
    grown = {}
    for name, (times, ms) in after.items():
        was = before.get(name, [0, 0.0])
        if times > was[0]:
            grown[name] = [times - was[0], round(ms - was[1], 3)]
    return grown


def stall_kind(stalls: dict[str, Any]) -> str:
    """How a step's ``Stalls.take`` files it: ``compile`` where a Triton kernel was compiled in
    it, else ``gc`` where a collection ran, else ``none``."""
    if stalls.get("compiled"):
        return "compile"
    return "gc" if stalls.get("collections") else "none"


@dataclass(frozen=True)
class Watch:
    """The three, installed on one started engine (its target's dispatcher told apart)."""

    dispatches: Dispatches
    joins: Joins
    stalls: Stalls

    @classmethod
    def installed(cls, target_dispatcher: Any) -> Watch:
        watch = cls(Dispatches(), Joins(), Stalls())
        watch.dispatches.target = target_dispatcher
        for one in (watch.dispatches, watch.joins, watch.stalls):
            one.install()
        return watch

    def compiled_so_far(self) -> dict[str, list[float]]:
        return copy.deepcopy(self.stalls.totals)
