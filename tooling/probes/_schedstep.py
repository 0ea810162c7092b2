"""Stepping one case through vLLM's Scheduler as the engine core does, with the oracles.

The engine core's two loops are followed: ``EngineCore.step`` (schedule, execute, update,
then the drafts for the next step) and, with asynchronous scheduling,
``step_with_batch_queue`` (up to two scheduled batches in flight, the older one's output
applied while the newer one runs; drafts are placeholders the worker fills). The model
is the one part stood in for: a request that finished its prompt in a step samples a
bonus token after a drawn number of accepted drafts.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _harness
from ._schedsim import (
    OUTCOME_PASS,
    STOP_TOKEN,
    Case,
    Engine,
    Finding,
    Outcome,
    build_engine,
    engine_request,
)

#: Consecutive steps that pass over a prefilling request with budget, a slot and the blocks of
#: a whole request to spare, after which it is starved (a deferral lasts a step, not this many).
STARVE_STEPS = 32
#: Consecutive steps that schedule nothing, with work unfinished and none in flight, after
#: which the engine is stuck (a preemption can leave one such step; it never leaves three).
STALL_STEPS = 3


@dataclass
class Scheduled:
    """What one scheduled step gave each request, read right after ``schedule()``."""

    output: Any
    blocks: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    """num_computed_tokens after the step's tokens (the scheduler counts them at once)."""
    prefill_chunk: dict[str, bool] = field(default_factory=dict)


def run_case(
    case: Case,
    root: Path,
    engine: Engine | None = None,
    observe: Callable[[Any, Any], None] | None = None,
) -> Outcome:
    """``case`` served by vLLM's scheduler for the seed's geometry: its outcome. ``engine``:
    one built for the case's settings and not yet stepped (else it is built here);
    ``observe(scheduler, output)``, called with every step's ``schedule()`` output."""
    built = engine or build_engine(case.settings, root)
    if isinstance(built, Outcome):
        return built
    driver = _Driver(built, case, observe)
    try:
        driver.drive()
    except Finding as f:
        return Outcome(f.kind, f.detail, steps=driver.step, facts=built.facts)
    except Exception as e:  # vLLM's code raised: the engine would have died
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{frame.filename.rsplit('/vllm/', 1)[-1]}:{frame.lineno}"
        detail = f"{type(e).__name__} at {where}: {' '.join(str(e).split())}"[:300]
        return Outcome("crash", detail, steps=driver.step, facts=built.facts)
    return Outcome(OUTCOME_PASS, steps=driver.step, facts=built.facts)


def worker_fills_drafts_from_last_batch() -> bool:
    """Whether the release's worker fills the scheduler's draft placeholders from its previous
    batch: the V1 model runner does. A release without it (0.34.0) serves DFlash on the V2
    runner, whose input batch takes each request's drafts from its own persistent row
    (``vllm/v1/worker/gpu/input_batch.py``)."""
    return _harness.has_v1_runner()


class _Driver:
    def __init__(
        self, engine: Engine, case: Case, observe: Callable[[Any, Any], None] | None = None
    ) -> None:
        self.engine = engine
        self.observe = observe
        self.case = case
        self.k = case.settings.k
        self.rng = random.Random(case.seed)
        self.step = 0
        self.scheduler = engine.scheduler
        # What vLLM resolved, not what the case asked: left unset, 0.20.1 schedules
        # asynchronously wherever it can.
        self.depth = 2 if engine.config.scheduler_config.async_scheduling else 1
        self.last_batch: set[str] = set()
        self.fills_from_last_batch = worker_fills_drafts_from_last_batch()
        self.in_flight: deque[Scheduled] = deque()
        work = sum(r.prompt_len + r.max_tokens for r in case.requests)
        last = max((r.arrival for r in case.requests), default=0)
        # Every step that schedules anything computes at least one token of some request;
        # four times the workload's tokens leaves room for every preemption's recompute.
        self.bound = last + 64 + 4 * work
        null = self.scheduler.kv_cache_manager.block_pool.null_block
        self.null_id = null.block_id
        self.draft_group = self._draft_group()
        self.passed_over: dict[str, int] = {}
        self.request_blocks = self._request_blocks()

    def _request_blocks(self) -> int:
        """The blocks one request of max_model_len can hold at once, over every group."""
        config = self.engine.config
        return sum(
            -(-g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes)
            for g in self.scheduler.kv_cache_config.kv_cache_groups
        )

    def _draft_group(self) -> int | None:
        groups = self.scheduler.kv_cache_config.kv_cache_groups
        for i in self.engine.attention_groups:
            if any(n.startswith("draft_model.") for n in groups[i].layer_names):
                return i
        return None

    def drive(self) -> None:
        from vllm.v1.request import RequestStatus

        arrivals = sorted(
            range(len(self.case.requests)), key=lambda i: (self.case.requests[i].arrival, i)
        )
        pending = deque(arrivals)
        idle = 0
        while True:
            while pending and self.case.requests[pending[0]].arrival <= self.step:
                self._add(pending.popleft())
            aborts = [
                f"r{i}"
                for i, r in enumerate(self.case.requests)
                if r.abort_at == self.step and f"r{i}" in self.scheduler.requests
            ]
            if aborts:
                self.scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
            if not pending and not self.scheduler.has_requests() and not self.in_flight:
                break
            if self.step > self.bound:
                raise Finding(
                    "livelock", f"unfinished after {self.step} steps ({self._unfinished()})"
                )
            scheduled = self._engine_step()
            unfinished = self.scheduler.get_num_unfinished_requests()
            if scheduled or self.in_flight or not unfinished:
                idle = 0
            else:
                idle += 1
                if idle >= STALL_STEPS:
                    raise Finding(
                        "stall",
                        f"step {self.step} schedules nothing for "
                        f"{STALL_STEPS} steps; {self._unfinished()}",
                    )
            self.step += 1
        self._check_blocks_returned()

    def _engine_step(self) -> bool:
        """One call of the engine core's loop; whether it scheduled any token."""
        scheduled = False
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            if self.observe is not None:
                self.observe(self.scheduler, out)
            scheduled = out.total_num_scheduled_tokens > 0
            self._check_starvation(out)
            self._check_drafts_in_hand(out)
            self.in_flight.appendleft(self._record(out))
            if scheduled and len(self.in_flight) < self.depth:
                return True  # the batch queue takes another before waiting on this one
        if not self.in_flight:
            return scheduled
        done = self.in_flight.pop()
        output, accepted = self._model_output(done)
        self._audit_writes(done, accepted)
        self.scheduler.update_from_output(done.output, output)
        if self.k and self.depth == 1 and done.output.total_num_scheduled_tokens:
            self._propose(done)
        return scheduled

    def _add(self, index: int) -> None:
        req = engine_request(index, self.case.requests[index], self.engine.hasher)
        self.scheduler.add_request(req)

    def _check_starvation(self, out: Any) -> None:
        """A prompt still prefilling must be scheduled in a step that has room for it: budget
        left over, a sequence slot, and free blocks for a whole request of max_model_len."""
        sched = self.scheduler
        spare = sched.max_num_scheduled_tokens - out.total_num_scheduled_tokens
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        room = (
            spare > 0
            and len(sched.running) < sched.max_num_running_reqs
            and free > self.request_blocks
        )
        for rid, request in sched.requests.items():
            prefilling = (
                not request.is_finished()
                and request.num_computed_tokens < request.num_prompt_tokens
            )
            if not room or not prefilling or rid in out.num_scheduled_tokens:
                self.passed_over.pop(rid, None)
                continue
            self.passed_over[rid] = self.passed_over.get(rid, 0) + 1
            if self.passed_over[rid] >= STARVE_STEPS:
                raise Finding(
                    "starve",
                    f"step {self.step}: {rid} ({request.num_computed_tokens}/"
                    f"{request.num_prompt_tokens} prompt tokens) passed over for "
                    f"{STARVE_STEPS} steps with {spare} tokens of the budget unused",
                )

    def _check_drafts_in_hand(self, out: Any) -> None:
        """With asynchronous scheduling the scheduler's drafts are placeholders (-1) that
        the worker fills from its previous batch. A request scheduled with drafts that was
        not in that batch verifies placeholders the worker cannot fill: they reach the
        model as token ids (on a GPU, a device-side assert in the embedding). A worker that
        keeps each request's drafts in a row of its own (0.34.0's V2 runner) fills them
        whatever batch the request was last in: there a placeholder is no defect."""
        if self.depth == 1 or not out.total_num_scheduled_tokens or not self.fills_from_last_batch:
            return
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            if drafts and rid not in self.last_batch:
                raise Finding(
                    "stale-drafts",
                    f"step {self.step}: {rid} verifies {len(drafts)} drafts though it was "
                    "not in the previous batch, whose drafts the worker fills",
                )
        self.last_batch = set(out.num_scheduled_tokens)

    def _record(self, out: Any) -> Scheduled:
        rec = Scheduled(out)
        manager = self.scheduler.kv_cache_manager
        for rid in out.num_scheduled_tokens:
            request = self.scheduler.requests[rid]
            rec.blocks[rid] = tuple(list(b) for b in manager.get_block_ids(rid))
            rec.computed[rid] = request.num_computed_tokens
            rec.prefill_chunk[rid] = request.is_prefill_chunk
        return rec

    def _model_output(self, done: Scheduled) -> tuple[Any, dict[str, int]]:
        """What the model returns for ``done``: per request, the accepted drafts and a bonus
        token (nothing for a prefill chunk), and how many drafts each accepted."""
        out = done.output
        rids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        accepted: dict[str, int] = {}
        for rid in rids:
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if done.prefill_chunk[rid]:
                sampled.append([])
                accepted[rid] = 0
                continue
            roll = self.rng.random()
            n = drafts if roll < 0.3 else 0 if roll < 0.5 else self.rng.randint(0, drafts)
            accepted[rid] = n
            sampled.append([self._token() for _ in range(n + 1)])
        return _harness.model_outputs(dict(zip(rids, sampled, strict=True))), accepted

    def _token(self) -> int:
        return STOP_TOKEN if self.rng.random() < 0.03 else self.rng.randrange(100, 240000)

    def _propose(self, done: Scheduled) -> None:
        """The drafts the runner hands the scheduler after a step (``take_draft_token_ids``):
        K for every request of the batch; the scheduler keeps those of live decodes."""
        from vllm.v1.outputs import DraftTokenIds

        rids = list(done.output.num_scheduled_tokens)
        drafts = [[self._token() for _ in range(self.k)] for _ in rids]
        self.scheduler.update_draft_token_ids(DraftTokenIds(rids, drafts))

    def _audit_writes(self, done: Scheduled, accepted: dict[str, int]) -> None:
        """Every KV slot the step writes lies in a block the request held for the step:
        the target's tokens in every attention group, and DFlash's first drafter pass
        (the bonus token and K masks after the last valid position) in the drafter's."""
        out = done.output
        block = self.engine.block_size
        max_len = self.case.settings.max_model_len
        seq_lens = [done.computed[r] for r in out.num_scheduled_tokens]
        # The runner drafts only while the batch's first pass stays within max_model_len.
        drafts_run = bool(self.k) and bool(seq_lens) and max(seq_lens) + self.k + 1 <= max_len
        align = self.engine.config.cache_config.mamba_cache_mode == "align"
        for rid, n in out.num_scheduled_tokens.items():
            end = done.computed[rid]
            blocks = done.blocks[rid]
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if align and not drafts:
                self._check_chunk(rid, end - n, end, block)
            for gid in self.engine.attention_groups:
                self._covered(rid, blocks[gid], range(end - n, end), gid, "target", block)
            if drafts_run and self.draft_group is not None:
                last = end - 1 - (drafts - accepted[rid])
                positions = range(last + 1, last + 2 + self.k)
                self._covered(
                    rid, blocks[self.draft_group], positions, self.draft_group, "first-pass", block
                )

    def _check_chunk(self, rid: str, start: int, end: int, block: int) -> None:
        """A prefill chunk in Mamba cache mode "align" leaves every block it fills holding
        the state at the block's end: it ends on a boundary or inside the block it started
        in, and one that starts inside a block goes no further than that block's end."""
        crosses = (end - 1) // block > start // block
        if crosses and (end % block or start % block):
            raise Finding(
                "mamba-state",
                f"step {self.step}: {rid}'s prefill chunk "
                f"{start}..{end} crosses a {block}-token block boundary "
                f"{'from inside a block' if start % block else 'without ending on one'}",
            )

    def _covered(
        self, rid: str, blocks: list[int], positions: range, gid: int, what: str, block: int
    ) -> None:
        for pos in positions:
            index = pos // block
            if index >= len(blocks) or blocks[index] == self.null_id:
                raise Finding(
                    "slot",
                    f"step {self.step}: {rid}'s {what} position {pos} has "
                    f"no block of its own in group {gid} ({len(blocks)} blocks of "
                    f"{block})",
                )

    def _unfinished(self) -> str:
        reqs = self.scheduler.requests
        shown = [
            f"{rid} {r.status.name.lower()} {r.num_computed_tokens}/{r.num_tokens}"
            for rid, r in list(reqs.items())[:4]
            if not r.is_finished()
        ]
        return f"{self.scheduler.get_num_unfinished_requests()} unfinished: " + ", ".join(shown)

    def _check_blocks_returned(self) -> None:
        manager = self.scheduler.kv_cache_manager
        for group, single in enumerate(manager.coordinator.single_type_managers):
            held = {r: len(b) for r, b in single.req_to_blocks.items() if b}
            if held:
                raise Finding("leak", f"group {group} still holds blocks for {held}")
        pool = manager.block_pool
        counted = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
        if counted:
            raise Finding("leak", f"blocks {counted[:8]} keep a reference at the end")
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        if len(free) != len(set(free)):
            raise Finding("leak", "a block is on the free list twice (freed twice)")
        expected = pool.num_gpu_blocks - 1  # all but the null block
        if len(free) != expected:
            raise Finding("leak", f"{len(free)} blocks free at the end, {expected} expected")
