"""The liveness and slot-safety fuzzer over vLLM's real Scheduler: draw, run, shrink.

Usage (inside the probed interpreter): ``python -m <pkg>._schedfuzz JOB.json OUT.json``.

JOB holds ``seed``, ``first`` and ``cases`` (the campaign's case numbers ``first ..
first + cases - 1``, each drawn from ``seed`` and its number alone), ``seconds`` (a time
limit, or null), ``shrink`` (minimize each finding) and ``replay`` (a list of cases to run
as they are instead of drawing). OUT is rewritten, whole and atomically, after every
finding and every few seconds, so a run stopped by a signal leaves what it found: the
outcomes counted by kind, and the findings, each with its case and its shrunk case.

Settings are drawn from what users set on ``vllm serve`` (vLLM's defaults included), the
workload from the engine's own figures once built (its attention block B, its step
budget T, K, max_model_len): prompt lengths concentrate on B +- 1, 2B +- 1, K, K + 1,
K + 2, T +- 1, T +- (K + 1) and max_model_len less a few tokens, over shared prefixes.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ._schedsim import Case, Engine, Outcome, Req, Settings, build_engine, h200_platform
from ._schedstep import run_case

#: At most this many findings of one kind are kept (shrunk) per run; more are counted.
KEEP_PER_KIND = 2
WRITE_EVERY_S = 5.0
#: A shrink stops trying after this long, keeping the smallest failing case so far.
SHRINK_SECONDS = 60.0
#: ``join_hold_steps`` (fix 33) as drawn (the GPU fuzzer's too); 0, unset, weighs double: a
#: tree with the hold is still fuzzed as most users run it, without.
JOIN_HOLDS = (0, 0, 1, 4, 16)


def draw_settings(rng: random.Random, hold: bool = False) -> Settings:
    """A case's settings. ``hold``: the tree has fix 33's ``join_hold_steps``, drawn last so
    that a tree without it draws every other setting and workload as before."""
    # K = 5: a verify width of 6, no power of two as every other K + 1 here is.
    k = rng.choice((0, 1, 3, 5, 7, 7, 15, 15, 15))
    seqs = rng.choice((None, None, 1, 2, 4, 8, 16, 16, 32, 64, 128, 256, 1024))
    drawn: int | str | None = rng.choice(
        (None, None, "tight", 256, 384, 480, 512, 512, 768, 1024, 2048, 8192, "any")
    )
    tokens = drawn if not isinstance(drawn, str) else None
    if drawn == "tight":  # around the smallest budget a step of this K and max_num_seqs has
        tokens = max(1, k + 1 + max(k - 1, 0) * (seqs or 1) + rng.randint(-2, 64))
    elif drawn == "any":
        tokens = rng.randint(16, 8192)
    return Settings(
        k=k,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        prefix_caching=rng.choice((None, True, True, False)),
        async_scheduling=rng.choice((None, None, True, False)),
        max_model_len=rng.choice((256, 512, 700, 1024, 1500, 2048, 4096)),
        long_prefill_token_threshold=rng.choice((0, 0, 0, 0, 16, 100, 400, 480, 1000)),
        kv_cache_dtype=rng.choice(("auto", "auto", "auto", "fp8")),
        gdn_state_dtype=rng.choice(("auto", "auto", "auto", "float32")),
        kv_memory_factor=rng.choice((1.0, 1.1, 1.5, 2.0, 4.0, 64.0, 64.0)),
        join_hold_steps=rng.choice(JOIN_HOLDS) if hold and k else 0,
    )


def has_join_hold() -> bool:
    """Whether the vLLM under test takes ``join_hold_steps`` in its speculative config."""
    from vllm.config import SpeculativeConfig

    return "join_hold_steps" in getattr(SpeculativeConfig, "__dataclass_fields__", {})


class Figures(Protocol):
    """What the workload is drawn from of a built engine: its attention block and its
    ``facts`` (the step budget under "budget"). The CPU engine's, or one a GPU engine
    reported."""

    @property
    def block_size(self) -> int: ...

    @property
    def facts(self) -> dict[str, Any]: ...


class Shape(Protocol):
    """What the workload is drawn from of the settings: K and max_model_len."""

    @property
    def k(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...


def boundary_lengths(engine: Figures, settings: Shape) -> list[int]:
    """The prompt lengths where chunking, blocks and drafting meet, for this engine."""
    block, budget, k = engine.block_size, engine.facts["budget"], settings.k
    top = settings.max_model_len - 1
    near = [
        k,
        k + 1,
        k + 2,
        block - 1,
        block,
        block + 1,
        2 * block - 1,
        2 * block,
        2 * block + 1,
        budget - 1,
        budget,
        budget + 1,
        budget - k - 1,
        budget + k + 1,
        top,
        top - 1,
        top - k,
        top - k - 1,
        top - k - 2,
        1,
        2,
    ]
    return sorted({n for n in near if 1 <= n <= top})


def draw_workload(rng: random.Random, engine: Figures, settings: Shape) -> tuple[Req, ...]:
    lengths = boundary_lengths(engine, settings)
    top = settings.max_model_len - 1
    prefixes = [rng.choice([*lengths, engine.block_size, 2 * engine.block_size]) for _ in range(3)]
    reqs = []
    for _ in range(rng.choice((1, 1, 2, 3, 5, 8, 16, 24))):
        prompt = rng.choice(lengths) if rng.random() < 0.8 else rng.randint(1, top)
        prefix, prefix_len = -1, 0
        if rng.random() < 0.4:
            prefix = rng.randrange(len(prefixes))
            prefix_len = min(prefixes[prefix], top - 1)
            prompt = min(prefix_len + rng.choice([*lengths[:8], 1, 2]), top)
        room = max(1, settings.max_model_len - prompt)
        max_tokens = min(room, rng.choice((1, 2, settings.k + 1, 8, 32, 100, room)))
        arrival = 0 if rng.random() < 0.4 else rng.randint(0, 24)
        reqs.append(
            Req(
                arrival=arrival,
                prompt_len=max(1, prompt),
                max_tokens=max(1, max_tokens),
                prefix=prefix,
                prefix_len=min(prefix_len, prompt),
                min_tokens=rng.choice((0, 0, 0, 1, max_tokens)),
                stop=rng.random() < 0.3,
                abort_at=arrival + rng.randint(0, 30) if rng.random() < 0.1 else -1,
            )
        )
    return tuple(reqs)


def draw_case(seed: int, number: int, root: Path) -> tuple[Case, Engine | Outcome]:
    """Case ``number`` of the campaign ``seed``, and its engine (or the refusal)."""
    rng = random.Random(f"{seed}:{number}")
    settings = draw_settings(rng, hold=has_join_hold())
    built = build_engine(settings, root)
    if isinstance(built, Outcome):
        return Case(settings, (), seed=number), built
    return Case(settings, draw_workload(rng, built, settings), seed=number), built


def shrink(case: Case, kind: str, root: Path, seconds: float = SHRINK_SECONDS) -> Case:
    """The smallest case found that still fails with ``kind``: fewer requests, shorter and
    plainer ones, and settings back at vLLM's defaults where the failure allows."""
    deadline = time.monotonic() + seconds

    def fails(candidate: Case) -> bool:
        return run_case(candidate, root).outcome == kind

    best = case
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for candidate in _smaller(best):
            if time.monotonic() >= deadline:
                break
            if fails(candidate):
                best, changed = candidate, True
                break
    return best


def smaller_workloads(reqs: tuple[Req, ...]) -> list[tuple[Req, ...]]:
    """Workloads one step simpler than ``reqs``, the boldest first: a request fewer, or one
    request arriving at once, never aborted, without its stop token or min_tokens, with
    half its max_tokens, without its shared prefix, or with a shorter prompt. Requests keep
    their class (the GPU fuzzer's carry more fields)."""
    out = [reqs[:i] + reqs[i + 1 :] for i in range(len(reqs))]
    for i, r in enumerate(reqs):
        simpler = [
            replace(r, arrival=0),
            replace(r, abort_at=-1),
            replace(r, stop=False),
            replace(r, min_tokens=0),
            replace(r, max_tokens=max(1, r.max_tokens // 2)),
            replace(r, prefix=-1, prefix_len=0),
        ]
        if r.prompt_len > 1 and r.prefix_len < r.prompt_len:
            simpler.append(replace(r, prompt_len=max(r.prefix_len + 1, r.prompt_len // 2)))
            simpler.append(replace(r, prompt_len=r.prompt_len - 1))
        out += [(*reqs[:i], x, *reqs[i + 1 :]) for x in simpler if x != r]
    return out


def _smaller(case: Case) -> list[Case]:
    """Cases one step simpler than ``case``, the boldest first."""
    s = case.settings
    out = [replace(case, requests=w) for w in smaller_workloads(case.requests)]
    plain = [
        replace(s, async_scheduling=None),
        replace(s, long_prefill_token_threshold=0),
        replace(s, kv_cache_dtype="auto"),
        replace(s, gdn_state_dtype="auto"),
        replace(s, kv_memory_factor=64.0),
        replace(s, prefix_caching=False),
        replace(s, join_hold_steps=0),
    ]
    out += [replace(case, settings=x) for x in plain if x != s]
    if case.seed:
        out.append(replace(case, seed=0))
    return out


class Campaign:
    """Counts and findings of one run, written to ``out`` as they come."""

    def __init__(self, out: Path, shrink_findings: bool, root: Path) -> None:
        self.out = out
        self.shrink = shrink_findings
        self.root = root
        self.counts: dict[str, int] = {}
        self.findings: list[dict[str, Any]] = []
        self.replayed: list[dict[str, Any]] = []
        """Each replayed case's outcome, in the order given."""
        self.cases = 0
        self.started = time.monotonic()
        self.written = 0.0

    def record(self, case: Case, outcome: Outcome, number: int | None) -> None:
        self.cases += 1
        self.counts[outcome.outcome] = self.counts.get(outcome.outcome, 0) + 1
        if outcome.is_finding:
            kept = sum(1 for f in self.findings if f["kind"] == outcome.outcome)
            if kept < KEEP_PER_KIND or self.replayed:
                self._keep(case, outcome, number)
        if outcome.is_finding or time.monotonic() - self.written > WRITE_EVERY_S:
            self.write()

    def _keep(self, case: Case, outcome: Outcome, number: int | None) -> None:
        entry: dict[str, Any] = {
            "kind": outcome.outcome,
            "detail": outcome.detail,
            "number": number,
            "facts": outcome.facts,
            "case": case.to_json(),
        }
        self.findings.append(entry)
        self.write()  # the finding survives a signal during its shrink
        if self.shrink:
            small = shrink(case, outcome.outcome, self.root)
            again = run_case(small, self.root)
            entry.update(
                shrunk=small.to_json(), shrunk_detail=again.detail, shrunk_facts=again.facts
            )

    def write(self) -> None:
        data = {
            "cases": self.cases,
            "seconds": round(time.monotonic() - self.started, 3),
            "outcomes": self.counts,
            "findings": self.findings,
            "replayed": self.replayed,
        }
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out)
        self.written = time.monotonic()


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "schedfuzz-pair"
    campaign = Campaign(out, bool(job.get("shrink", True)), root)
    deadline = time.monotonic() + job["seconds"] if job.get("seconds") else None
    with h200_platform():
        if job.get("replay") is not None:
            for index, data in enumerate(job["replay"]):
                case = Case.from_json(data)
                outcome = run_case(case, root)
                campaign.replayed.append(
                    {
                        "outcome": outcome.outcome,
                        "detail": outcome.detail,
                        "steps": outcome.steps,
                        "facts": outcome.facts,
                    }
                )
                campaign.record(case, outcome, index)
        else:
            for number in range(job["first"], job["first"] + job["cases"]):
                if deadline is not None and time.monotonic() > deadline:
                    break
                case, built = draw_case(job["seed"], number, root)
                outcome = built if isinstance(built, Outcome) else run_case(case, root, built)
                campaign.record(case, outcome, number)
    campaign.write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
