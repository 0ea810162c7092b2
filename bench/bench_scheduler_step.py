"""The scheduler's share of a step: vLLM's own Scheduler for the seed's geometry, steady
decode, DFlash at K against no drafter, at several concurrencies.

Issue 45 splits a DFlash step's time on the GPU; the scheduler's part is CPU code that
runs the same on any host, so it is measured here, on vLLM's real Scheduler, config and
KV-cache manager (the scheduler fuzzer's engine, ``tooling.probes._schedsim``). Each step
times ``schedule()``, ``update_from_output()`` and, with a drafter, the drafts handed
back (``update_draft_token_ids``): the engine core's side of a step, less the model.
The figure is CPU time of this process (``time.process_time``), so other work on the
machine does not count; the ratio DFlash / plain is the figure to read.

A second figure times the steps a prompt joins: before each, one running request ends and a
new ``JOIN_LEN``-token prompt arrives, as under a server's steady traffic, where on the GPU
such a step costs DFlash far more than a decode step and plain next to nothing
(docs/notebook/2026-12-05-trained-speed.md). It says how much of that the scheduler's side
of a step explains.

Run (the probe interpreter, with the tree to measure on its path):
  PYTHONPATH=build/work/vllm-0.20.1:. $(.venv/bin/tooling probe-env) \\
      bench/bench_scheduler_step.py [--k 15] [--steps 200] [--max-num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tooling.probes._schedsim import (
    Engine,
    Req,
    Settings,
    build_engine,
    engine_request,
    h200_platform,
)

PROMPT_LEN = 512
#: The prompt that joins: the trained pair's held-out prompts are this long.
JOIN_LEN = 256
#: Drafts accepted a step as a trained pair's: acceptance length about 3.5 at K = 15.
ACCEPTED = (1, 2, 2, 3, 3, 4)


@dataclass(frozen=True)
class Row:
    k: int
    concurrent: int
    steps: int
    ms_per_step: float
    """Median CPU milliseconds of one step's scheduler work."""
    tokens_per_step: float
    joining_ms_per_step: float
    """The same, of a step in which one request has ended and a prompt joins."""


def _add_requests(engine: Engine, concurrent: int) -> None:
    for i in range(concurrent):
        req = Req(arrival=0, prompt_len=PROMPT_LEN, max_tokens=1 << 20)
        engine.scheduler.add_request(engine_request(i, req, engine.hasher))


def _step(engine: Engine, k: int, rng: random.Random) -> tuple[float, int]:
    """One engine-core step with the model's output made up: (CPU seconds, tokens)."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    scheduler = engine.scheduler
    t0 = time.process_time()
    out = scheduler.schedule()
    spent = time.process_time() - t0
    rids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in rids:
        request = scheduler.requests[rid]
        if request.num_computed_tokens < request.num_prompt_tokens:
            sampled.append([])  # a prefill chunk samples nothing
            continue
        drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        n = min(drafts, rng.choice(ACCEPTED))
        sampled.append([rng.randrange(100, 240000) for _ in range(n + 1)])
    output = ModelRunnerOutput(
        req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)}, sampled_token_ids=sampled
    )
    drafts = DraftTokenIds(rids, [[rng.randrange(100, 240000) for _ in range(k)] for _ in rids])
    t0 = time.process_time()
    scheduler.update_from_output(out, output)
    if k:
        scheduler.update_draft_token_ids(drafts)
    spent += time.process_time() - t0
    return spent, out.total_num_scheduled_tokens


def measure(k: int, concurrent: int, steps: int, root: Path, max_num_seqs: int | None) -> Row:
    settings = Settings(
        k=k, max_num_seqs=max_num_seqs, max_model_len=1 << 16, kv_memory_factor=80.0
    )
    engine = build_engine(settings, root)
    if not isinstance(engine, Engine):
        raise SystemExit(f"k={k}: the engine did not build: {engine.outcome} {engine.detail}")
    _add_requests(engine, concurrent)
    rng = random.Random(0)
    # Until every prompt is in and decoding: that traffic is not the steady state.
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        _step(engine, k, rng)
    for _ in range(10):
        _step(engine, k, rng)
    times, tokens = zip(*(_step(engine, k, rng) for _ in range(steps)), strict=True)
    return Row(
        k,
        concurrent,
        steps,
        statistics.median(times) * 1e3,
        statistics.mean(tokens),
        statistics.median(_joining(engine, k, rng, concurrent, steps)) * 1e3,
    )


def _joining(engine: Engine, k: int, rng: random.Random, first: int, steps: int) -> list[float]:
    """CPU seconds of ``steps`` steps, each after one running request ended and a new prompt
    arrived (the ending timed too: the engine core does it between steps)."""
    from vllm.v1.request import RequestStatus

    scheduler = engine.scheduler
    spent = []
    for index in range(first, first + steps):
        t0 = time.process_time()
        ended = scheduler.running[0].request_id
        scheduler.finish_requests([ended], RequestStatus.FINISHED_LENGTH_CAPPED)
        req = Req(arrival=0, prompt_len=JOIN_LEN, max_tokens=1 << 20)
        scheduler.add_request(engine_request(index, req, engine.hasher))
        ended_s = time.process_time() - t0
        step_s, _ = _step(engine, k, rng)
        spent.append(ended_s + step_s)
    return spent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--concurrent", default="1,16,64")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="as on vllm serve (default: vLLM's; stock 0.20.1 cannot serve K = 15 at it)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, h200_platform():
        for concurrent in (int(c) for c in args.concurrent.split(",")):
            for k in (0, args.k):
                rows.append(measure(k, concurrent, args.steps, Path(tmp), args.max_num_seqs))
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
        return 0
    print(
        "| concurrent | plain ms/step | DFlash ms/step | ratio | tokens/step plain / DFlash "
        "| a prompt joining: plain / DFlash ms/step |"
    )
    print("|---|---|---|---|---|---|")
    by: dict[int, dict[int, Any]] = {}
    for r in rows:
        by.setdefault(r.concurrent, {})[r.k] = r
    for c, pair in by.items():
        plain, spec = pair[0], pair[args.k]
        print(
            f"| {c} | {plain.ms_per_step:.3f} | {spec.ms_per_step:.3f} | "
            f"{spec.ms_per_step / plain.ms_per_step:.2f} | "
            f"{plain.tokens_per_step:.0f} / {spec.tokens_per_step:.0f} | "
            f"{plain.joining_ms_per_step:.3f} / {spec.joining_ms_per_step:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
