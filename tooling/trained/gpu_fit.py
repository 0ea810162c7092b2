"""Whether engines fit the GPU together: each holds its fixed KV cache and, beside it, its
weights, activations and CUDA graphs. Engines that do not fit are served in turns (a speed run's
one at a time, a trained call's in as few turns as fit), said in one line, rather than started
together to fail for memory: the GPU lent may be an H100 (80 GB) where a run was planned on an
H200 (141 GB)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from collections.abc import Iterable
from typing import Protocol, TypeVar

from .. import procs

logger = logging.getLogger(__name__)

#: What an engine of the trained pair holds beside its KV cache, GiB, at most: as much as the
#: first trained call's engines left themselves when they ran together on one H200
#: (docs/notebook/2026-12-04-fuzz-findings.md, call 1).
ENGINE_OVERHEAD_GIB = 5
MIB_PER_GIB = 1024


class _Engine(Protocol):
    @property
    def kv_cache_gib(self) -> int: ...


class _Settings(Protocol):
    @property
    def one_at_a_time(self) -> bool: ...

    @property
    def interleave(self) -> bool: ...


S = TypeVar("S", bound=_Settings)
E = TypeVar("E", bound=_Engine)


def gpu_memory_gib() -> float | None:
    """The first GPU's memory, GiB (``nvidia-smi``); None where there is none to ask."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        done = procs.run(query, timeout_s=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = done.stdout.split()
    if done.returncode != 0 or not fields or not fields[0].isdigit():
        return None
    return int(fields[0]) / MIB_PER_GIB


def needed_gib(engines: Iterable[_Engine]) -> int:
    return sum(e.kv_cache_gib + ENGINE_OVERHEAD_GIB for e in engines)


def fitted(settings: S, engines: Iterable[_Engine], gpu_gib: float | None) -> S:
    """``settings`` as they are where the engines fit ``gpu_gib`` together (or it is not
    known, or they are served one at a time already); else one at a time, not interleaved."""
    engines = list(engines)
    need = needed_gib(engines)
    if settings.one_at_a_time or gpu_gib is None or need <= gpu_gib:
        return settings
    logger.warning(
        "speed run: %d engines need about %d GiB together and the GPU has %.0f GiB: "
        "each is served alone, in turn",
        len(engines),
        need,
        gpu_gib,
    )
    return dataclasses.replace(settings, one_at_a_time=True, interleave=False)  # type: ignore[type-var]


def turns(engines: list[E], gpu_gib: float | None, what: str) -> list[list[E]]:
    """``engines`` in turns that each fit ``gpu_gib``, in their order (each turn takes the next
    engines while they fit; one too large for the GPU alone is a turn of its own, to fail for
    memory as it would have); all at once where they fit or the GPU is not known."""
    need = needed_gib(engines)
    if gpu_gib is None or need <= gpu_gib:
        return [engines] if engines else []
    out: list[list[E]] = []
    for engine in engines:
        if out and needed_gib([*out[-1], engine]) <= gpu_gib:
            out[-1].append(engine)
        else:
            out.append([engine])
    logger.warning(
        "%s: %d engines need about %d GiB together and the GPU has %.0f GiB: served in %d turns",
        what,
        len(engines),
        need,
        gpu_gib,
        len(out),
    )
    return out
