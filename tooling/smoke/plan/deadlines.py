"""The plan's time limits: the first engine start bounded from the pair's size, every later limit
a multiple of that measured start with a floor (a pair that starts slowly gets time in
proportion rather than a fixed total), and the run's overall ``Deadline``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...errors import SmokeError
from ..config import (
    Timeouts,
)
from ..pair import GIB

#: A first start is not measured yet: this many seconds per GiB of the largest engine's
#: weights on top of the start floor (loading and compiling grow with the model).
FIRST_START_S_PER_GIB = 8.0
#: Engines that start together compete for the CPU while they compile: each one more
#: adds this share to the first start's limit.
CONCURRENT_START_SHARE = 0.25
#: Later limits, as multiples of the first engine's measured start.
START_TIMES = 2.0
REQUEST_TIMES = 0.5
ENGINE_RUN_TIMES = 1.5
REFERENCE_TIMES = 2.0
LOAD_TIMES = 1.0


@dataclass(frozen=True)
class Limit:
    """A time limit: ``times`` the measured first engine start, at least ``floor_s``."""

    floor_s: float
    times: float

    def seconds(self, measured_start_s: float | None) -> float:
        if measured_start_s is None:
            return self.floor_s
        return max(self.floor_s, self.times * measured_start_s)


@dataclass(frozen=True)
class Deadlines:
    first_start_s: float
    """An engine start before any start was measured."""
    start: Limit
    """An engine start once one was measured."""
    request: Limit
    engine_run: Limit
    """An in-process child's work after its engine started."""
    reference: Limit
    load: Limit
    tiny_s: float
    server_stop_s: float
    total_s: float | None
    """The whole run (``--time-limit``); None: only each step's own limit."""

    def start_s(self, measured_start_s: float | None) -> float:
        if measured_start_s is None:
            return self.first_start_s
        return self.start.seconds(measured_start_s)

    def child_s(self, work: Limit, measured_start_s: float | None) -> float:
        """A child that starts an engine (or loads the models) and then works."""
        return self.start_s(measured_start_s) + work.seconds(measured_start_s)


def deadlines_for(
    timeouts: Timeouts, largest: int, together: int, tiny_s: float | None
) -> Deadlines:
    """The plan's limits: ``largest``, the largest engine's weights; ``together``, the engines
    that start in the first wave; ``tiny_s``, the generated pair's draw, where there is one."""
    t = timeouts
    return Deadlines(
        first_start_s=(t.server_start + FIRST_START_S_PER_GIB * largest / GIB)
        * (1 + CONCURRENT_START_SHARE * (together - 1)),
        start=Limit(t.server_start, START_TIMES),
        request=Limit(t.request, REQUEST_TIMES),
        engine_run=Limit(t.engine_run, ENGINE_RUN_TIMES),
        reference=Limit(t.reference, REFERENCE_TIMES),
        load=Limit(t.load, LOAD_TIMES),
        tiny_s=tiny_s if tiny_s is not None else t.tiny,
        server_stop_s=t.server_stop,
        total_s=t.total,
    )


class Deadline:
    """The overall time limit (None: none); each step's own limit is cut to what is left."""

    def __init__(self, total_s: float | None) -> None:
        self.end = None if total_s is None else time.monotonic() + total_s

    def remaining(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def limit(self, step_s: float, reserve_s: float = 0.0) -> float:
        """``step_s``, or less if the overall limit (minus ``reserve_s``) is closer."""
        left = self.remaining() - reserve_s
        if left < 1.0:
            raise SmokeError("the smoke's overall time limit is spent")
        return min(step_s, left)
