"""A speed run reads what else the host did while each unit measured, reports it, and the bar
is not judged on a run whose unit shared the host with other work: a short kernel check beside
an engine spoiled a comparison on the GPU host (2026-12-07)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR
from tooling.trained import speed
from tooling.trained.serving import beside

#: CPU seconds the child below burns on its own clock, whatever the machine's speed.
BURN_S = 0.5
BURN = (
    f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN_S}:\n    pass\n"
)


def test_another_process_on_the_host_counts_beside_the_unit_and_the_engine_does_not():
    before = beside.sample()
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120)
    between = beside.sample()
    t = time.process_time()
    while time.process_time() - t < BURN_S:
        pass
    after = beside.sample()
    child = beside.beside(before, between)
    own = beside.beside(between, after)
    assert child is not None and own is not None
    # The host's busy time holds the child's half second; the engine's own clock does not.
    # (The kernel counts the host's time in ticks: a tenth of the half second is allowed.)
    assert child["other_cpu_s"] >= 0.9 * BURN_S
    assert child["own_cpu_s"] < BURN_S / 2
    # Work the engine does itself is its own, never counted beside it.
    assert own["own_cpu_s"] >= BURN_S


def test_each_unit_of_a_run_keeps_what_was_beside_it_taken_in_its_turn(tmp_path):
    from tooling.trained.serving.speed_run import run_unit
    from tooling.trained.serving.turns import Turns

    figures: dict = {}
    turns = Turns(tmp_path / "turns", 0, 1)
    run_unit("pass at 1", lambda: None, figures, turns)
    run_unit(
        "pass at 16",
        lambda: subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120),
        figures,
        turns,
    )
    assert [u["unit"] for u in figures["beside"]] == ["pass at 1", "pass at 16"]
    assert figures["beside"][1]["other_cpu_s"] >= 0.9 * BURN_S
    assert (tmp_path / "turns" / "next").read_text() == "0\n"  # the turn was taken and given


def test_a_unit_is_crowded_above_half_a_core_of_other_work_a_second(tmp_path):
    quiet = beside.beside(beside.Sample(0.0, 10.0, 1.0), beside.Sample(2.0, 11.6, 2.0))
    busy = beside.beside(beside.Sample(0.0, 10.0, 1.0), beside.Sample(2.0, 13.5, 2.0))
    assert quiet == {"wall_s": 2.0, "own_cpu_s": 1.0, "other_cpu_s": pytest.approx(0.6)}
    assert busy is not None and beside.share(busy) == 1.25
    result = {
        "name": "dflash",
        "beside": [{"unit": "pass at 1", **quiet}, {"unit": "pass at 16", **busy}],
    }
    assert beside.crowded(result) == [
        "dflash: pass at 16 had 1.25 CPU-s a second of other work beside it (2.5 s over 2.0 s)"
    ]
    # A host with nothing to read (or files of another form) gives no figure, not zero.
    (_, read_group), (_, read_stat) = beside.SOURCES
    nowhere = ((tmp_path / "cpu.stat", read_group), (tmp_path / "stat", read_stat))
    assert beside.sample(nowhere) is None
    (tmp_path / "cpu.stat").write_text("user_usec 1\n")
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert beside.sample(nowhere) is None
    assert beside.beside(None, beside.sample()) is None
    # A control group's own time comes first: in a container, the machine's other tenants
    # are not the host's work beside a unit.
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    (tmp_path / "stat").write_text("cpu  100 0 100 900 0 0 0 0 0 0\n")
    taken = beside.sample(nowhere)
    assert taken is not None and taken.host_cpu_s == 2.5
    taken = beside.sample(nowhere[1:])
    assert taken is not None and taken.host_cpu_s == 200 / os.sysconf("SC_CLK_TCK")


def _figures(rates: tuple[float, ...], units: list[dict]) -> dict:
    passes = {str(lv): [{"tokens": r, "seconds": 1.0} for r in rates] for lv in (1, 16, 64)}
    return {"ok": True, "name": "", "speed": passes, "beside": units}


def test_the_bar_is_not_judged_on_a_run_whose_unit_shared_the_host(tmp_path):
    bench = REPO_DIR / "bench" / "bench_dflash_speed.py"
    quiet = {"unit": "pass at 1", "wall_s": 10.0, "own_cpu_s": 9.0, "other_cpu_s": 0.4}
    for name, rates in (
        ("plain", (100,) * 5),
        ("plain-stock", (100,) * 5),
        ("dflash", (300,) * 5),
    ):
        (tmp_path / f"{name}.out.json").write_text(
            json.dumps({**_figures(rates, [quiet]), "name": name})
        )

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(bench), str(tmp_path)], capture_output=True, text=True, timeout=60
        )

    assert run().returncode == 0
    crowded = {"unit": "pass at 16", "wall_s": 10.0, "own_cpu_s": 9.0, "other_cpu_s": 12.0}
    (tmp_path / "plain.out.json").write_text(
        json.dumps({**_figures((100,) * 5, [quiet, crowded]), "name": "plain"})
    )
    done = run()
    assert done.returncode == 1
    assert (
        "missed: not measured alone: plain: pass at 16 had 1.20 CPU-s a second of other work "
        "beside it (12.0 s over 10.0 s)"
    ) in done.stdout


def test_the_report_says_what_was_beside_each_engines_units(tiny_pair: Path, tmp_path: Path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(1,)))
    units = [
        {"unit": "pass at 1", "wall_s": 4.0, "own_cpu_s": 4.0, "other_cpu_s": 0.2},
        {"unit": "steps at 1", "wall_s": 2.0, "own_cpu_s": 2.0, "other_cpu_s": 3.0},
    ]
    (work / "dflash.out.json").write_text(json.dumps(_figures((300,), units)))
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "speed": {}}))
    text, _ = speed.report(work)
    section = text.split("## Other work on the host while each unit measured")[1]
    section = section.split("## Decode tokens/s")[0]
    assert "- `plain`: not read (no unit, or no /proc/stat on the host)" in section
    assert (
        "- `dflash`: 2 units; at most 1.50 CPU-s a second of other work beside one (steps at 1)"
    ) in section
    assert "**Not measured alone** (above 0.5 CPU-s a second):" in section
    assert "- dflash: steps at 1 had 1.50 CPU-s a second" in section
