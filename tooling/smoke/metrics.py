"""Read vLLM's Prometheus ``/metrics`` text: prefix-cache and speculative-decoding counters.

Names are those vLLM 0.20.1 registers (``v1/metrics/loggers.py``,
``v1/spec_decode/metrics.py``). prometheus_client exposes a counter ``vllm:x``
as ``vllm:x_total`` (plus ``vllm:x_created``); both spellings are accepted.
Values are summed over engines (label ``engine``), as a server with one engine
has one series per counter.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_fd_to_metric_families

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class _NumberedLines(io.StringIO):
    """The text, line by line, remembering the line the parser read last (its errors do
    not say which)."""

    number = 0
    line = ""

    # typeshed gives StringIO both IOBase's bytes and TextIOBase's str here.
    def __next__(self) -> str:  # type: ignore[override]
        self.line = super().__next__()
        self.number += 1
        return self.line


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, parsed by prometheus_client (what
    vLLM exports its metrics with).

    Raises ValueError naming the first line that is not Prometheus text.
    """
    lines = _NumberedLines(text)
    try:
        return [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_fd_to_metric_families(lines)
            for s in family.samples
        ]
    except ValueError:
        raise ValueError(
            f"line {lines.number}: not Prometheus text: {lines.line.strip()[:120]}"
        ) from None


def _counter(samples: list[Sample], name: str) -> list[Sample]:
    # Counters appear as name_total; older clients and gauges as the bare name.
    total = [s for s in samples if s.name == f"{name}_total"]
    return total or [s for s in samples if s.name == name]


def counter_value(samples: list[Sample], name: str) -> float | None:
    """Sum of counter ``name`` over all its series; None when the server does not export it."""
    series = _counter(samples, name)
    if not series:
        return None
    return sum(s.value for s in series)


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Cumulative prefix-cache counters, in tokens."""

    queries: float
    hits: float

    def minus(self, earlier: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - earlier.queries, self.hits - earlier.hits)


def prefix_cache_counters(samples: list[Sample]) -> PrefixCacheCounters | None:
    """The prefix-cache counters, or None when the server exports none."""
    queries = counter_value(samples, PREFIX_CACHE_QUERIES)
    hits = counter_value(samples, PREFIX_CACHE_HITS)
    if queries is None or hits is None:
        return None
    return PrefixCacheCounters(queries=queries, hits=hits)


@dataclass(frozen=True)
class SpecDecodeStats:
    """Cumulative speculative-decoding counters and what they imply."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: list[float] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per target step: 1 + accepted / drafts (None before any draft)."""
        if self.num_drafts <= 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens over drafted tokens."""
        if self.num_draft_tokens <= 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def per_position_rate(self) -> list[float]:
        """Share of drafts whose token at each position was accepted."""
        if self.num_drafts <= 0:
            return [0.0 for _ in self.accepted_per_position]
        return [a / self.num_drafts for a in self.accepted_per_position]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_rate": self.per_position_rate(),
        }


def spec_decode_stats(samples: list[Sample]) -> SpecDecodeStats | None:
    """The speculative-decoding counters, or None on a server without speculation."""
    drafts = counter_value(samples, SPEC_DRAFTS)
    accepted = counter_value(samples, SPEC_ACCEPTED)
    if drafts is None or accepted is None:
        return None
    per_pos: dict[int, float] = {}
    for s in _counter(samples, SPEC_ACCEPTED_PER_POS):
        position = int(s.labels.get("position", "0"))
        per_pos[position] = per_pos.get(position, 0.0) + s.value
    return SpecDecodeStats(
        num_drafts=drafts,
        num_draft_tokens=counter_value(samples, SPEC_DRAFT_TOKENS) or 0.0,
        num_accepted_tokens=accepted,
        accepted_per_position=[per_pos[p] for p in sorted(per_pos)],
    )
