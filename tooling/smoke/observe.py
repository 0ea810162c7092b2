"""What the smoke observes through a running server: completions, the prefix cache, the
spec-decode counters on /metrics, and the concurrent bursts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import SmokeError
from . import client, load, metrics
from .checks import PrefixObservation, prefix_prompt_tokens
from .config import LOSSLESS_PROMPTS, PREFIX_MAX_TOKENS, PREFIX_PROMPT_TEXT, PREFIX_PROMPT_TOKENS
from .logscan import block_size_from_log, read_log
from .server import SERVED_MODEL_NAME, RunningServer

logger = logging.getLogger(__name__)

START = "start"
REQUEST = "request"
LOAD = "load"


class Budget(Protocol):
    """The run's time limits as a server's observation asks for them."""

    def limit(self, what: str) -> float:
        """Seconds for the next ``what`` (START, REQUEST, LOAD), cut to what the run leaves
        (SmokeError once it leaves nothing)."""
        ...

    def started(self, seconds: float, message: str) -> None:
        """An engine was ready ``seconds`` after its start (``message`` says so to people)."""
        ...


@dataclass
class ServerObservations:
    """What one server run saw; ``errors`` says which observations failed and why."""

    log: Path
    completions: list[client.Completion] = field(default_factory=list)
    prefix: PrefixObservation | None = None
    spec_stats: metrics.SpecDecodeStats | None = None
    aux_layers: tuple[int, ...] | None = None
    errors: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None
    stop: str | None = None
    """How the server's process group ended (procs.StopOutcome.how)."""
    load: dict[str, Any] | None = None
    """The concurrent bursts: ``first`` and ``measured`` summaries, acceptance under load."""
    prompt_ids: list[list[int]] | None = None
    """The lossless prompts as this server tokenized them for /v1/completions."""

    def summary(self) -> dict[str, Any]:
        return {
            "startup_s": self.startup_s,
            "stop": self.stop,
            "errors": self.errors,
            "load": self.load,
        }


def read_metrics(base_url: str, timeout_s: float = 10.0) -> list[metrics.Sample]:
    """The server's /metrics, parsed."""
    text = client.get_text(f"{base_url}/metrics", timeout_s)
    try:
        return metrics.parse_prometheus(text)
    except ValueError as e:
        raise SmokeError(f"{base_url}/metrics: {e}") from None


def _prefix_counters(base_url: str) -> metrics.PrefixCacheCounters:
    counters = metrics.prefix_cache_counters(read_metrics(base_url))
    if counters is None:
        raise SmokeError(f"{base_url}/metrics has no {metrics.PREFIX_CACHE_QUERIES} counter")
    return counters


def _wait_for_queries(
    base_url: str, at_least: float, timeout_s: float
) -> metrics.PrefixCacheCounters:
    # The server updates its counters after it answers; wait until the request shows.
    deadline = time.monotonic() + timeout_s
    while True:
        counters = _prefix_counters(base_url)
        if counters.queries >= at_least or time.monotonic() >= deadline:
            return counters
        time.sleep(0.2)


def settled_spec_stats(base_url: str, timeout_s: float = 5.0) -> metrics.SpecDecodeStats | None:
    """Spec-decode counters once two reads half a second apart agree."""
    deadline = time.monotonic() + timeout_s
    previous = metrics.spec_decode_stats(read_metrics(base_url))
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = metrics.spec_decode_stats(read_metrics(base_url))
        if current == previous:
            break
        previous = current
    return previous


def repeated_to(ids: list[int], tokens: int) -> list[int]:
    """``ids`` repeated and cut to exactly ``tokens`` ids."""
    return (ids * -(-tokens // len(ids)))[:tokens]


def prefix_prompt_ids(base_url: str, model: str, timeout_s: float) -> list[int]:
    """Exactly PREFIX_PROMPT_TOKENS token ids of the prefix text, by the server's tokenizer."""
    ids = client.tokenize(base_url, model, PREFIX_PROMPT_TEXT, timeout_s=timeout_s)
    if not ids:
        raise SmokeError("the server tokenized the prefix prompt to nothing")
    return repeated_to(ids, PREFIX_PROMPT_TOKENS)


def observe_prefix_cache(
    base_url: str, model: str, ids: list[int], *, timeout_s: float, block_size: int | None
) -> PrefixObservation:
    """Send ``ids`` twice; what the second request got from the prefix cache."""
    before = _prefix_counters(base_url)
    client.complete(base_url, model, ids, max_tokens=PREFIX_MAX_TOKENS, timeout_s=timeout_s)
    middle = _wait_for_queries(base_url, before.queries + len(ids), timeout_s=10.0)
    second = client.complete(
        base_url, model, ids, max_tokens=PREFIX_MAX_TOKENS, timeout_s=timeout_s
    )
    after = _wait_for_queries(base_url, middle.queries + len(ids), timeout_s=10.0)
    delta = after.minus(middle)
    return PrefixObservation(
        prompt_tokens=len(ids),
        hits=delta.hits,
        queries=delta.queries,
        cached_tokens=second.cached_tokens,
        block_size=block_size,
    )


def observe_server(
    budget: Budget,
    server: RunningServer,
    drafter: str | None,
    prefix_ids: list[int] | None,
    *,
    max_tokens: int,
    max_model_len: int,
    load: bool,
) -> tuple[ServerObservations, list[int] | None]:
    """Wait for a started server, then every request of the server checks against it.

    ``prefix_ids`` (the prefix text's PREFIX_PROMPT_TOKENS ids, None: tokenize them here)
    are returned for the next server: the load bursts share them."""
    log = server.log
    logger.debug("observe the server at %s (drafter: %s, load: %s)", server.base_url, drafter, load)
    obs = ServerObservations(log=log)
    model = SERVED_MODEL_NAME
    try:
        obs.startup_s = server.wait_healthy(budget.limit(START))
        url = server.base_url
        budget.started(obs.startup_s, f"server ready {obs.startup_s:.0f}s after its start at {url}")
        try:
            for prompt in LOSSLESS_PROMPTS:
                obs.completions.append(
                    client.complete(
                        url, model, prompt, max_tokens=max_tokens, timeout_s=budget.limit(REQUEST)
                    )
                )
        except SmokeError as e:
            obs.errors["lossless"] = str(e)
        if drafter is not None:
            try:
                limit = budget.limit(REQUEST)
                obs.prompt_ids = [
                    client.tokenize(url, model, p, timeout_s=limit, add_special_tokens=True)
                    for p in LOSSLESS_PROMPTS
                ]
            except SmokeError:
                obs.prompt_ids = None  # only the lossless check's tie margins need them
        try:
            limit = budget.limit(REQUEST)
            prefix_ids = prefix_ids or prefix_prompt_ids(url, model, limit)
            # The engine states an enlarged block size before it answers: the prompt must
            # fill two of its blocks, whatever the other server's are.
            block = block_size_from_log(read_log(log))
            repeated = repeated_to(prefix_ids, prefix_prompt_tokens(block, max_model_len))
            obs.prefix = observe_prefix_cache(
                url, model, repeated, timeout_s=limit, block_size=block
            )
        except SmokeError as e:
            obs.errors["prefix"] = str(e)
        if drafter is not None:
            try:
                obs.spec_stats = settled_spec_stats(url)
            except SmokeError as e:
                obs.errors["metrics"] = str(e)
        if load and prefix_ids:
            try:
                obs.load = _load_bursts(budget.limit(LOAD), url, model, prefix_ids, drafter)
            except SmokeError as e:
                obs.errors["load"] = str(e)
    except SmokeError as e:
        for key in ("lossless", "prefix", "metrics", "load"):
            obs.errors.setdefault(key, str(e))
    return obs, prefix_ids


LOAD_FIRST = 32
LOAD_MEASURED = 64


def _load_bursts(
    limit: float, url: str, model: str, prefix_ids: list[int], drafter: str | None
) -> dict[str, Any]:
    """A first burst (first traffic, timed on its own) then the measured burst, each
    within ``limit`` seconds.

    The shared prefixes are sent once, one at a time, before the bursts, so both
    servers start the bursts with the same cache content and the reuse compares.
    """
    vocab = (10, 1000)
    warm = load.load_items(prefix_ids, len(load.PREFIX_LENGTHS), seed=99, vocab=vocab)
    for item in warm:
        client.complete(url, model, list(item.prompt), max_tokens=1, timeout_s=limit)
    first = load.burst(
        url, model, load.load_items(prefix_ids, LOAD_FIRST, seed=1, vocab=vocab), timeout_s=limit
    )
    before = metrics.spec_decode_stats(read_metrics(url)) if drafter else None
    measured = load.burst(
        url,
        model,
        load.load_items(prefix_ids, LOAD_MEASURED, seed=2, vocab=vocab),
        timeout_s=limit,
    )
    result: dict[str, Any] = {"first": first.summary(), "measured": measured.summary()}
    if drafter and before is not None:
        after = settled_spec_stats(url)
        if after is not None:
            drafts = after.num_drafts - before.num_drafts
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            result["acceptance_length"] = 1 + accepted / drafts if drafts else None
    return result
