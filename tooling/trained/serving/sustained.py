"""Decode tokens/s under sustained load: ``level`` requests kept in flight, each finished one
replaced by the next prompt at once, as a server under steady traffic keeps its batch full.

A batch's pass (``speed_run``'s passes) ends with its slowest request, so with DFlash it
measures the worst prompt's acceptance: the last steps run with a few requests left. Here
the window opens once ``level`` requests have finished (the batch then holds requests of
every age) and closes when ``measured`` more have; every token any request made inside the
window counts, finished or not, so no request's tail weighs on the figure. Both bounds are
counts of requests, never seconds, so the window is the same on any machine.

Each step inside the window is also timed and filed three ways: under the CUDA-graph mode of
the target forward it dispatched, under how many prompts the scheduler admitted in it
(``watch.Joins``), and under what stalled it, if anything (``watch.Stalls``: a Triton kernel
compiled, a garbage collection). A request that joins a batch verifying drafts makes a mixed
step, which no steady decode step shows, and the first mixed steps of each shape meet
kernels no warm-up compiled. Under asynchronous scheduling a step's time holds the launch of
its own batch and the wait for the batch before it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .watch import stall_kind, tally

logger = logging.getLogger(__name__)

#: A window never runs more engine steps than this (a request that cannot finish must not
#: hang the run; the figure then says it was cut).
STEP_CAP = 200_000


def staggered_length(index: int, mean: int) -> int:
    """The tokens the ``index``-th request of a window makes with staggered lengths: every
    length from ``mean // 2`` to ``mean // 2 + mean`` once in each ``mean + 1`` requests, in
    an order that is the same for every engine, so the requests end at different steps as a
    server's do, plain's as well as DFlash's."""
    # 61 and mean + 1 share no factor for the means used (128, 256), so the order is a
    # permutation; any other mean still gets lengths within the range.
    return mean // 2 + (index * 61) % (mean + 1)


def measured_completions(level: int) -> int:
    """How many requests finish inside one window: twice the batch, at least 16."""
    return max(2 * level, 16)


@dataclass
class Window:
    """What happened between the window's opening and its close."""

    level: int
    warm: int
    measured: int
    completed: int = 0
    tokens: int = 0
    steps: int = 0
    began: float | None = None
    ended: float | None = None
    began_step: int = 0
    ended_step: int = 0
    made: dict[str, int] = field(default_factory=dict)
    #: ms of each step inside the window, by the mode of the target forward it dispatched.
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    #: The same steps by how many prompts joined them (``JOINED_BUCKETS``).
    joined_ms: dict[str, list[float]] = field(default_factory=dict)
    #: The same steps by what stalled them (``watch.stall_kind``).
    stalled_ms: dict[str, list[float]] = field(default_factory=dict)
    #: Each Triton kernel compiled inside the window: [times, ms in all].
    compiles: dict[str, list[float]] = field(default_factory=dict)
    gc_ms: float = 0.0
    #: When each request added inside the window was added, until its first token.
    added_at: dict[str, float] = field(default_factory=dict)
    #: ms from a request's add to its first token, of the requests added inside the window:
    #: what waiting to join (a full batch, a held prompt) costs a request.
    first_token_ms: list[float] = field(default_factory=list)

    def take(self, request_id: str, tokens_so_far: int, finished: bool) -> bool:
        """One request's output of a step; True when it finished (a slot to refill)."""
        if request_id not in self.made:
            return False
        if tokens_so_far and request_id in self.added_at:
            if self.inside:
                ms = (time.perf_counter() - self.added_at[request_id]) * 1000.0
                self.first_token_ms.append(round(ms, 3))
            del self.added_at[request_id]
        if self.began is not None and self.ended is None:
            self.tokens += tokens_so_far - self.made[request_id]
        self.made[request_id] = tokens_so_far
        if finished:
            del self.made[request_id]
            self.completed += 1
        return finished

    def after_step(self, now: float) -> None:
        self.steps += 1
        if self.began is None and self.completed >= self.warm:
            self.began, self.began_step = now, self.steps
        elif self.ended is None and self.all_completed:
            self.ended, self.ended_step = now, self.steps

    @property
    def all_completed(self) -> bool:
        """Whether the window has had every completion it measures."""
        return self.completed >= self.warm + self.measured

    @property
    def done(self) -> bool:
        return self.ended is not None or self.steps >= STEP_CAP

    @property
    def inside(self) -> bool:
        """Whether the next step falls inside the window."""
        return self.began is not None and self.ended is None

    def file_step(
        self,
        ms: float,
        dispatched: dict[str, int],
        joined: int = 0,
        stalls: dict[str, Any] | None = None,
    ) -> None:
        self.step_ms.setdefault(dispatch_mode(dispatched), []).append(round(ms, 3))
        bucket = str(joined) if joined < JOINED_BUCKETS else f"{JOINED_BUCKETS}+"
        self.joined_ms.setdefault(bucket, []).append(round(ms, 3))
        if stalls is None:
            return
        self.stalled_ms.setdefault(stall_kind(stalls), []).append(round(ms, 3))
        for name, compile_ms in stalls.get("compiled", []):
            tally(self.compiles, name, compile_ms)
        self.gc_ms = round(self.gc_ms + stalls.get("gc_ms", 0.0), 3)


#: Steps with this many prompts joining or more are filed together.
JOINED_BUCKETS = 3


def dispatch_mode(dispatched: dict[str, int]) -> str:
    """The CUDA-graph mode of the target forwards a step dispatched (``Dispatches`` keys,
    ``"target FULL 16->16"``): ``FULL``, ``PIECEWISE``, ``NONE``, joined if several, ``-``
    if none."""
    modes = sorted({key.split()[1] for key in dispatched if key.startswith("target ")})
    return "+".join(modes) or "-"


def run_window(
    llm: Any,
    prompts: list[list[int]],
    level: int,
    max_new_tokens: int,
    dispatched: Callable[[], dict[str, int]] = dict,
    marker: Callable[[], AbstractContextManager[Any]] | None = None,
    measured: int | None = None,
    joined: Callable[[], int] = int,
    stalls: Callable[[], dict[str, Any]] | None = None,
    staggered: bool = False,
    joins: bool = False,
) -> dict:
    """One window at ``level`` on ``llm`` (vLLM's offline ``LLM``, in-process engine).
    ``dispatched`` gives the forwards dispatched since it was last called (``Dispatches.take``),
    ``joined`` the prompts admitted (``Joins.take``), ``stalls`` what stalled a step
    (``Stalls.take``; None: not filed so); with ``marker``, each step inside the
    window runs inside ``marker()`` (a profiler's region, a clock's step), or with ``joins``
    each prompt that joins inside it, from its arrival to its first token, one at a time
    (``JoinMarks``); ``measured``: requests to finish inside it, if not
    ``measured_completions``; ``staggered``: each request makes ``staggered_length`` tokens,
    not ``max_new_tokens``."""
    from vllm.inputs import TokensPrompt

    from ...smoke.serving.distribution import greedy_params
    from .trained_run import _spec

    engine = llm.llm_engine
    window = Window(level, warm=level, measured=measured or measured_completions(level))
    marks = JoinMarks(window, marker if joins else None)
    step_marker = None if joins else marker
    added = 0

    def add() -> None:
        nonlocal added
        rid = f"sustained-{level}-{time.monotonic_ns()}-{added}"
        prompt = prompts[added % len(prompts)]
        length = staggered_length(added, max_new_tokens) if staggered else max_new_tokens
        params = greedy_params(length, None)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        window.made[rid] = 0
        if window.inside:
            window.added_at[rid] = time.perf_counter()
            marks.arrived(rid)
        added += 1

    for _ in range(level):
        add()
    before = after = None
    while not window.done:
        inside = window.inside
        if inside:
            dispatched()
            joined()
            if stalls is not None:
                stalls()
        begin = time.perf_counter()
        with step_marker() if step_marker is not None and inside else contextlib.nullcontext():
            outputs = engine.step()
        now = time.perf_counter()
        if inside:
            window.file_step(
                (now - begin) * 1000.0,
                dispatched(),
                joined(),
                stalls() if stalls is not None else None,
            )
        for out in outputs:
            if window.take(out.request_id, len(out.outputs[0].token_ids), out.finished):
                add()
        marks.settle()
        opened = window.began is None
        window.after_step(now)
        if opened and window.began is not None:
            before = _spec(llm)
        if window.ended is not None:
            after = _spec(llm)
    marks.close()
    engine.abort_request(list(window.made))
    while engine.has_unfinished_requests():
        engine.step()
    figures = _figures(window, before, after)
    return {**figures, "joins_marked": marks.joins} if joins else figures


class JoinMarks:
    """A window's prompts joining, each marked (``marker``: a profiler's region, a clock's
    step) from its arrival to its first token: what a prompt joining costs, apart from the
    decode steps around it. One at a time, so that no two marks overlap; a prompt that
    arrives once the window has all its completions is not marked (its first token would
    fall outside the window). No marker: nothing is marked."""

    def __init__(
        self, window: Window, marker: Callable[[], AbstractContextManager[Any]] | None
    ) -> None:
        self.window = window
        self.marker = marker
        self.open: str | None = None
        self.joins = 0
        self._mark = contextlib.ExitStack()

    def arrived(self, request_id: str) -> None:
        if self.marker is None or self.open is not None or self.window.all_completed:
            return
        self._mark.enter_context(self.marker())
        self.open = request_id

    def settle(self) -> None:
        """Close the mark of the prompt that has had its first token since."""
        if self.open is not None and self.open not in self.window.added_at:
            self._mark.close()
            self.open = None
            self.joins += 1

    def close(self) -> None:
        self._mark.close()
        self.open = None


def acceptance_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted / drafts between two readings of vLLM's spec-decode counters."""
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0
    )
    return 1.0 + accepted / drafts if drafts else None


def _figures(window: Window, before: dict | None, after: dict | None) -> dict[str, Any]:
    if window.began is None or window.ended is None:
        return {"error": f"cut at {window.steps} steps: {window.completed} requests finished"}
    return {
        "seconds": window.ended - window.began,
        "tokens": window.tokens,
        "completions": window.measured,
        "steps": window.ended_step - window.began_step,
        "acceptance_length": (
            acceptance_length(before, after) if before is not None and after is not None else None
        ),
        "step_ms": window.step_ms,
        "joined_ms": window.joined_ms,
        "first_token_ms": window.first_token_ms,
        **(
            {"stalled_ms": window.stalled_ms, "compiles": window.compiles, "gc_ms": window.gc_ms}
            if window.stalled_ms
            else {}
        ),
    }
