"""A call's host time on the GPU host: what a step's critical path pays for it (launches
and Python), not what the device spends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def host_us(call: Callable[[], None], repeats: int = 50) -> float:
    """Microseconds of host time a call, the device drained before and after, never between."""
    import torch

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    logger.debug("%d calls of %s: %.6f s of host time", repeats, call, spent)
    return spent / repeats * 1e6
