"""How a speed run's engines share one GPU (``serving.turns``: in turns, unit by unit, across
real processes), and how a window with the batch kept full counts its tokens
(``serving.sustained``); the run's options for both are in test_speed.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR
from tooling.trained.serving.sustained import Window, dispatch_mode, measured_completions
from tooling.trained.serving.turns import Turns
from tooling.trained.speed_tables import dispatch_table

ENGINE = textwrap.dedent(
    """
    import json, sys, time
    from tooling.trained.serving.turns import Turns

    index, count, units, log = *map(int, sys.argv[2:5]), sys.argv[5]
    # As the speed run's engine gets them: its request's JSON, the folder as text.
    turns = Turns(**json.loads(json.dumps({"folder": sys.argv[1], "index": index, "count": count})))
    try:
        for _ in range(units):
            with turns.turn():
                with open(log, "a") as out:
                    out.write(f"start {index}\\n")
                time.sleep(0.05)
                with open(log, "a") as out:
                    out.write(f"end {index}\\n")
    finally:
        turns.finish()
    """
)


def _engines(folder: Path, log: Path, units: dict[int, int], count: int) -> list[subprocess.Popen]:
    """Engine ``i`` of ``count`` doing ``units[i]`` units, started last index first (the order
    of the turns is theirs, not the starts')."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", ENGINE, str(folder), str(i), str(count), str(n), str(log)],
            cwd=REPO_DIR,
        )
        for i, n in sorted(units.items(), reverse=True)
    ]


def test_engines_take_turns_one_unit_each_and_skip_one_that_is_done(tmp_path):
    log = tmp_path / "log"
    engines = _engines(tmp_path / "turns", log, {0: 4, 1: 2, 2: 4}, 3)
    for engine in engines:
        assert engine.wait(timeout=120) == 0
    lines = log.read_text().split("\n")[:-1]
    # No two units overlap: each start is followed by its own end.
    assert all(s == f"start {e.split()[1]}" for s, e in zip(lines[::2], lines[1::2], strict=True))
    order = [int(line.split()[1]) for line in lines[::2]]
    assert order == [0, 1, 2, 0, 1, 2, 0, 2, 0, 2]


def test_an_engine_that_failed_before_its_first_turn_holds_no_one(tmp_path):
    folder = tmp_path / "turns"
    Turns(folder, 1, 2).finish()
    log = tmp_path / "log"
    (engine,) = _engines(folder, log, {0: 3}, 2)
    assert engine.wait(timeout=120) == 0
    assert log.read_text().count("start 0") == 3


def test_waiting_for_an_engine_that_never_comes_ends_naming_it(tmp_path):
    turns = Turns(tmp_path, 0, 2, timeout_s=0.3)
    with turns.turn():
        pass
    with pytest.raises(TimeoutError, match="engine 0 waited 0s for engine 1"), turns.turn():
        pass


def test_an_engine_index_outside_the_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="engine 2 is not one of 2"):
        Turns(tmp_path, 2, 2)


def test_a_sustained_window_counts_only_tokens_made_between_its_bounds():
    window = Window(level=2, warm=2, measured=2)
    window.made = {"a": 0, "b": 0}
    # Step 1: both decode; a finishes (the first of the two warm completions).
    assert window.take("a", 5, True) is True
    window.take("b", 5, False)
    window.made["c"] = 0
    window.after_step(1.0)
    assert window.began is None
    # Step 2: b finishes, the second warm completion: the window opens after this step.
    window.take("b", 9, True)
    window.take("c", 3, False)
    window.made["d"] = 0
    window.after_step(2.0)
    assert window.began == 2.0 and window.tokens == 0
    # Steps 3-4: everything made now counts, a request of an earlier step too.
    window.take("c", 7, True)
    window.take("d", 4, False)
    window.take("other", 99, False)  # not the window's request
    window.made["e"] = 0
    window.after_step(3.0)
    window.take("d", 10, True)
    window.take("e", 6, False)
    window.after_step(5.0)
    assert window.done and window.ended == 5.0
    assert window.tokens == (7 - 3) + 4 + (10 - 4) + 6
    assert window.ended_step - window.began_step == 2


def test_a_window_measures_twice_its_batch_and_at_least_sixteen_requests():
    assert [measured_completions(n) for n in (1, 8, 16, 64)] == [16, 16, 32, 128]


def test_a_windows_steps_are_filed_by_the_targets_graph_mode_and_only_inside_it():
    """With the batch kept full a DFlash step took several times its steady step on the
    trained pair (2026-12-05); the steps a prompt joins are told apart from the decode steps."""
    window = Window(level=1, warm=1, measured=1)
    assert not window.inside
    window.began = 1.0
    assert window.inside
    window.file_step(8.5, {"target FULL 256->256": 1, "drafter PIECEWISE 16->16": 1})
    window.file_step(31.0, {"target PIECEWISE 496->512": 1, "drafter PIECEWISE 16->16": 1}, 1)
    window.file_step(9.0, {"target FULL 256->256": 1})
    window.file_step(0.4, {})  # a step that ran no forward (only outputs)
    window.file_step(40.0, {"target NONE 1792->1792": 1}, 5)
    window.ended = 2.0
    assert not window.inside
    assert window.step_ms == {"FULL": [8.5, 9.0], "PIECEWISE": [31.0], "-": [0.4], "NONE": [40.0]}
    assert window.joined_ms == {"0": [8.5, 9.0, 0.4], "1": [31.0], "3+": [40.0]}
    assert dispatch_mode({"target FULL 16->16": 1, "target NONE 4096->4096": 1}) == "FULL+NONE"


def test_the_table_by_prompts_joining_reads_its_own_filing():
    windows = [{"step_ms": {"FULL": [8.0]}, "joined_ms": {"0": [8.0], "1": [30.0, 34.0]}}]
    results = {"dflash": {"sustained": {"64": windows}}}
    assert dispatch_table(["dflash"], results, "joined_ms")[-1] == (
        "| 64 | 0 1 × 8.00 ms (11%); 1 2 × 32.00 ms (89%) |"
    )


def test_the_dispatch_table_merges_every_window_of_a_level():
    windows = [
        {"step_ms": {"FULL": [8.0, 10.0], "PIECEWISE": [30.0]}},
        {"step_ms": {"FULL": [9.0]}},
    ]
    results = {"dflash": {"sustained": {"16": windows}}, "plain": {"sustained": {}}}
    assert dispatch_table(["plain", "dflash"], results) == [
        "| concurrent | plain | dflash |",
        "|---|---|---|",
        "| 16 | - | FULL 3 × 9.00 ms (47%); PIECEWISE 1 × 30.00 ms (53%) |",
    ]
