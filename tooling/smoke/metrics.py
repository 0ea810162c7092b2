"""Read vLLM's Prometheus ``/metrics`` text: prefix-cache and speculative-decoding counters.

Names are those vLLM 0.20.1 registers (``v1/metrics/loggers.py``,
``v1/spec_decode/metrics.py``). prometheus_client exposes a counter ``vllm:x``
as ``vllm:x_total`` (plus ``vllm:x_created``); both spellings are accepted.
Values are summed over engines (label ``engine``), as a server with one engine
has one series per counter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if not match:
            raise ValueError(f"bad label set {{{text}}}")
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; comments and blank lines skipped.

    Raises ValueError on a line that is neither.
    """
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise ValueError(f"line {number}: not a Prometheus sample: {line[:120]}")
        raw = match.group("value")
        value = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(raw)
        samples.append(
            Sample(
                name=match.group("name"),
                labels=_parse_labels(match.group("labels") or ""),
                value=float(raw) if value is None else value,
            )
        )
    return samples


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
