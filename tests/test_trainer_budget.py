"""A training phase's limits (``trainer.common.Budget``): pure arithmetic over a clock the
tests set, so no assertion depends on how fast this machine is."""

from __future__ import annotations

import time
from dataclasses import replace

from tooling.trainer.common import Budget
from tooling.trainer.config import PRESETS


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


def test_a_recipe_with_an_acceptance_floor_gives_its_drafter_the_whole_cap() -> None:
    """The hybrid recipe on a slower GPU reached its drafter with the wall budget spent: cut
    to a quarter of its cap the drafter trained its 300 minimum steps and fell short of the
    floor, and the run wrote no pair. With a floor the drafter trains its cap, over the
    budget; without one it still yields to the budget, down to a quarter."""
    hybrid = PRESETS["hybrid"]
    assert hybrid.min_acceptance_length > 0
    cap = hybrid.drafter_time_cap_s
    assert [hybrid.drafter_cap_s(left) for left in (-200.0, 10.0, 1e6)] == [cap] * 3
    free = replace(hybrid, min_acceptance_length=0.0, floor_speculative_tokens=0)
    assert [free.drafter_cap_s(left) for left in (-200.0, 40.0, 1e6)] == [cap / 4, 40.0, cap]
