"""A call's host time on the GPU host: what a step's critical path pays for it (launches
and Python), not what the device spends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def drain() -> None:
    """Wait for CUDA's queue; nothing where the checks run on the CPU (in Triton's
    interpreter, every launch has finished when it returns)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(call: Callable[[], None], repeats: int = 50) -> float:
    """Microseconds of host time a call, the device drained before and after, never between."""
    call()
    drain()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    spent = time.perf_counter() - start
    drain()
    logger.debug("%d calls of %s: %.6f s of host time", repeats, call, spent)
    return spent / repeats * 1e6
