"""What steady traffic compiled, captured or autotuned again: vLLM's compilation counter,
Dynamo's counters and the entries of every Triton autotuner, read before and after (the
speed run's ``steady_changes``). Runs in the interpreter of the vLLM under test."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

logger = logging.getLogger(__name__)


def autotune_entries() -> int:
    import warnings

    from triton.runtime.autotuner import Autotuner

    def tuner(o: Any) -> bool:
        try:
            return isinstance(o, Autotuner)
        except ReferenceError:  # a weak proxy whose object is gone
            return False

    with warnings.catch_warnings():
        # isinstance on some of the process's objects warns (lazy modules).
        warnings.simplefilter("ignore")
        tuners = [o for o in gc.get_objects() if tuner(o)]
    return sum(len(getattr(o, "cache", {})) for o in tuners)


def compiles() -> dict[str, int]:
    """vLLM's compilation counter, Dynamo's counters and Triton's autotune entries, now."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    now = {f"vllm.{k}": int(v) for k, v in dataclasses.asdict(compilation_counter).items()}
    for group in ("stats", "frames", "recompiles"):
        now.update({f"dynamo.{group}.{k}": int(v) for k, v in counters.get(group, {}).items()})
    now["triton.autotune_entries"] = autotune_entries()
    logger.debug(
        "compile counters read: %d, Triton autotune entries %d",
        len(now),
        now["triton.autotune_entries"],
    )
    return now


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What grew between two readings of ``compiles``, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
