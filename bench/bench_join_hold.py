"""What patch 33's ``join_hold_steps`` does to a server's steps: vLLM's real Scheduler for the
seed's geometry with DFlash at K, the batch kept full with requests of staggered lengths, each
ended request replaced at once, as the GPU speed run's windows serve the trained pair.

For each hold N (0 is vLLM's behaviour, the floor) it counts, over the same traffic:

- the share of steps in which a prompt is prefilled (a prompt joins, or a chunk of one runs);
- the tokens a step makes (the drafts accepted are drawn from the trained pair's per-position
  acceptance, given as ``--acceptance``);
- the steps a request waits from its arrival to its first scheduled step (median and most);
- with ``--decode-ms`` and ``--join-ms`` (a verify step's and a step with a prefill's time
  measured on a GPU), the tokens a millisecond those times give, as a ratio to N = 0.

The ratio is a projection from the scheduler's own decisions and two measured step times, not
a measurement of speed: the GPU speed run (``speed-hold``) measures it.

Run (the probe interpreter, with the tree to measure on its path):
  PYTHONPATH=build/work/vllm-0.20.1:. $(.venv/bin/tooling probe-env) \\
      bench/bench_join_hold.py --concurrent 64 --acceptance 0.74,0.55,... \\
      [--decode-ms 15.9 --join-ms 83] [--holds 0,2,4,8] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tooling.probes._schedsim import (
    Engine,
    Req,
    Settings,
    build_engine,
    engine_request,
    h200_platform,
)
from tooling.trained.serving.sustained import staggered_length

#: The trained pair's held-out prompts are this long; the speed run's mean output length.
PROMPT_LEN = 256
MEAN_TOKENS = 128


@dataclass(frozen=True)
class Row:
    hold: int
    steps: int
    prefill_share: float
    """Share of steps that prefilled any prompt tokens."""
    tokens_per_step: float
    wait_median: float
    wait_most: int
    """Steps from a request's arrival to its first scheduled step."""


def _accepted(rng: random.Random, rates: list[float], k: int) -> int:
    """Drafts accepted in a row, position i accepted with the unconditional rate ``rates[i]``."""
    n, before = 0, 1.0
    for rate in rates[:k]:
        if before <= 0 or rng.random() >= rate / before:
            break
        n, before = n + 1, rate
    return n


class _Traffic:
    """The batch kept full: ``level`` requests in flight, each ended one replaced at once."""

    def __init__(self, engine: Engine, level: int) -> None:
        self.engine = engine
        self.added = 0
        self.step = 0
        self.arrived: dict[str, int] = {}
        self.waits: list[int] = []
        for _ in range(level):
            self.add()

    def add(self) -> None:
        tokens = staggered_length(self.added, MEAN_TOKENS)
        req = Req(arrival=0, prompt_len=PROMPT_LEN, max_tokens=tokens)
        request = engine_request(self.added, req, self.engine.hasher)
        self.engine.scheduler.add_request(request)
        self.arrived[request.request_id] = self.step
        self.added += 1

    def run_step(self, k: int, rates: list[float], rng: random.Random) -> tuple[bool, int]:
        """One engine-core step with the model's output made up: (whether it prefilled, the
        tokens it made)."""
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        scheduler = self.engine.scheduler
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.waits.append(self.step - self.arrived.pop(new.req_id, self.step))
        rids = list(out.num_scheduled_tokens)
        prefilled, sampled = False, []
        for rid in rids:
            request = scheduler.requests[rid]
            # schedule() has counted the step's tokens as computed already.
            start = request.num_computed_tokens - out.num_scheduled_tokens[rid]
            if start < request.num_prompt_tokens:
                prefilled = True
                if request.num_computed_tokens < request.num_prompt_tokens:
                    sampled.append([])  # a chunk short of the prompt's end samples nothing
                    continue
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            n = min(drafts, _accepted(rng, rates, k))
            sampled.append([rng.randrange(100, 240000) for _ in range(n + 1)])
        output = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=sampled,
        )
        before = set(scheduler.requests)
        scheduler.update_from_output(out, output)
        scheduler.update_draft_token_ids(
            DraftTokenIds(rids, [[rng.randrange(100, 240000) for _ in range(k)] for _ in rids])
        )
        self.step += 1
        for _ in before - set(scheduler.requests):
            self.add()
        return prefilled, sum(len(s) for s in sampled)


def measure(hold: int, level: int, k: int, rates: list[float], steps: int, root: Path) -> Row:
    settings = Settings(
        k=k,
        max_num_seqs=max(level, 16),
        max_model_len=4096,
        kv_memory_factor=4.0 * level,
        async_scheduling=False,
        join_hold_steps=hold,
    )
    engine = build_engine(settings, root)
    if not isinstance(engine, Engine):
        raise SystemExit(f"hold {hold}: the engine did not build: {engine.outcome} {engine.detail}")
    traffic = _Traffic(engine, level)
    rng = random.Random(0)
    # Until the first requests have ended and the arrivals are staggered.
    for _ in range(steps // 4):
        traffic.run_step(k, rates, rng)
    traffic.waits.clear()
    drawn = [traffic.run_step(k, rates, rng) for _ in range(steps)]
    return Row(
        hold,
        steps,
        sum(p for p, _ in drawn) / steps,
        sum(t for _, t in drawn) / steps,
        statistics.median(traffic.waits) if traffic.waits else 0.0,
        max(traffic.waits, default=0),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--holds", default="0,2,4,8")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--acceptance",
        required=True,
        help="per-position acceptance, comma-separated (the trained report's 'per position')",
    )
    parser.add_argument("--decode-ms", type=float, help="a verify step's time on the GPU")
    parser.add_argument("--join-ms", type=float, help="a step with a prefill's time on the GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = [float(x) for x in args.acceptance.split(",")]
    holds = [int(h) for h in args.holds.split(",")]
    with tempfile.TemporaryDirectory() as tmp, h200_platform():
        rows = [measure(h, args.concurrent, args.k, rates, args.steps, Path(tmp)) for h in holds]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    timed = args.decode_ms is not None and args.join_ms is not None
    print(
        "| hold | steps with a prefill | tokens a step | wait, steps (median / most) |"
        + (" tokens a ms | x hold 0 |" if timed else "")
    )
    print("|---|---|---|---|" + ("---|---|" if timed else ""))
    floor = None
    for r in rows:
        line = (
            f"| {r.hold} | {r.prefill_share:.0%} | {r.tokens_per_step:.1f} | "
            f"{r.wait_median:.0f} / {r.wait_most} |"
        )
        if timed:
            ms = r.prefill_share * args.join_ms + (1 - r.prefill_share) * args.decode_ms
            rate = r.tokens_per_step / ms
            floor = floor or rate
            line += f" {rate:.2f} | {rate / floor:.2f} |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
