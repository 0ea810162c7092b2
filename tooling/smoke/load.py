"""Concurrent load against a real ``vllm serve``: shared-prefix prompts, uneven output lengths.

The prompts share prefixes of several lengths (so the prefix cache serves part
of each) and ask for different output lengths (so requests finish out of
order). A first burst is timed on its own: it pays for shapes the server has
not compiled or captured yet ("first traffic"). The measured burst follows.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import SmokeError
from . import client

logger = logging.getLogger(__name__)

PREFIX_LENGTHS = (16, 48, 96, 160)
SUFFIX_TOKENS = (4, 40)
OUTPUT_TOKENS = (4, 60)


@dataclass(frozen=True)
class LoadItem:
    prompt: tuple[int, ...]
    max_tokens: int


def load_items(base: list[int], count: int, seed: int, vocab: tuple[int, int]) -> list[LoadItem]:
    """``count`` distinct prompts: a prefix of ``base`` of a PREFIX_LENGTHS length, then a
    seeded random suffix; seeded output lengths. Distinct, so every answer is attributable."""
    rng = random.Random(seed)
    items: list[LoadItem] = []
    seen: set[tuple[int, ...]] = set()
    while len(items) < count:
        prefix = base[: PREFIX_LENGTHS[len(items) % len(PREFIX_LENGTHS)]]
        suffix = [rng.randrange(*vocab) for _ in range(rng.randint(*SUFFIX_TOKENS))]
        prompt = tuple(prefix + suffix)
        if prompt in seen:
            continue
        seen.add(prompt)
        items.append(LoadItem(prompt, rng.randint(*OUTPUT_TOKENS)))
    return items


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass
class BurstResult:
    """One burst: every answer (None where the request failed) and the timing."""

    wall_s: float
    latencies: list[float] = field(default_factory=list)
    completions: list[client.Completion | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        tokens = sum(len(c.token_ids or ()) for c in self.completions if c is not None)
        return {
            "requests": len(self.completions),
            "failed": len(self.errors),
            "first_errors": self.errors[:3],
            "wall_s": self.wall_s,
            "output_tokens": tokens,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else None,
            "p50_latency_s": percentile(self.latencies, 50),
            "p99_latency_s": percentile(self.latencies, 99),
            "cached_tokens": sum(c.cached_tokens or 0 for c in self.completions if c is not None),
        }


def burst(base_url: str, model: str, items: list[LoadItem], *, timeout_s: float) -> BurstResult:
    """Send every item at once (one thread each) and wait for all answers."""

    def one(item: LoadItem) -> tuple[float, client.Completion | None, str | None]:
        start = time.monotonic()
        try:
            answer = client.complete(
                base_url, model, list(item.prompt), max_tokens=item.max_tokens, timeout_s=timeout_s
            )
        except SmokeError as e:
            return time.monotonic() - start, None, str(e)
        return time.monotonic() - start, answer, None

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(len(items), 1)) as pool:
        answers = list(pool.map(one, items))
    result = BurstResult(wall_s=time.monotonic() - start)
    logger.debug("burst of %d requests to %s in %.1fs", len(items), base_url, result.wall_s)
    for latency, answer, error in answers:
        result.completions.append(answer)
        if error is None:
            result.latencies.append(latency)
        else:
            result.errors.append(error)
    return result
