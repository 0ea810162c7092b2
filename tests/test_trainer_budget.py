"""A training phase's limits (``trainer.common.Budget``): pure arithmetic over a clock the
tests set, so no assertion depends on how fast this machine is."""

from __future__ import annotations

import time

from tooling.trainer.common import Budget


def _spent(max_steps: int, min_steps: int = 0) -> Budget:
    """A phase of 10 s whose clock ran out long ago."""
    return Budget(max_steps, 10.0, min_steps, started=time.perf_counter() - 1000.0)


def test_the_clock_ends_a_phase_before_its_step_count() -> None:
    budget = _spent(100)
    assert budget.done(0) and budget.progress(0) >= 1.0
    assert budget.time_capped(0)


def test_a_phase_out_of_time_still_runs_its_minimum_steps_and_anneals_over_them() -> None:
    budget = _spent(100, min_steps=4)
    assert [budget.done(s) for s in range(6)] == [False] * 4 + [True] * 2
    assert [budget.progress(s) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert budget.time_capped(4)


def test_the_minimum_never_exceeds_the_step_count() -> None:
    budget = _spent(3, min_steps=10)
    assert [budget.done(s) for s in range(4)] == [False, False, False, True]


def test_with_time_left_the_minimum_changes_nothing() -> None:
    plain = Budget(8, 1e6, started=time.perf_counter())
    floored = Budget(8, 1e6, min_steps=4, started=plain.started)
    assert [floored.done(s) for s in range(9)] == [plain.done(s) for s in range(9)]
    assert floored.progress(2) == 0.25 and floored.done(8)
