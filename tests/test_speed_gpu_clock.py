"""A speed run reads the GPU's SM clock around each unit and reports it beside the engines'
figures: plain on the fixed wheel read 4% slower than stock at 64 in decode steps whose
kernels, a GEMM the series leaves alone among them, ran 3.4-3.8% slower in its window
(docs/notebook/2026-12-07-one-and-stock.md)."""

from __future__ import annotations

import json
from pathlib import Path

from tooling.trained import speed
from tooling.trained.serving import gpu_clock


def test_a_units_clock_is_its_samples_and_the_time_it_was_capped():
    before = gpu_clock.Mark(wall_us=1_000_000, power_ns=5_000_000_000, thermal_ns=0)
    after = gpu_clock.Mark(wall_us=9_000_000, power_ns=6_500_000_000, thermal_ns=250_000_000)
    assert gpu_clock.summary([1980, 1755, 1980, 1785], before, after) == {
        "sm_mhz_mean": 1875.0,
        "sm_mhz_min": 1755.0,
        "sm_samples": 4.0,
        "power_capped_s": 1.5,
        "thermal_capped_s": 0.25,
    }
    # No sample taken during the unit is no figure, not a clock of zero.
    assert gpu_clock.summary([], before, after) is None


def test_a_host_without_an_nvidia_driver_records_no_clock_and_the_unit_is_measured(tmp_path):
    from tooling.trained.serving.speed_run import run_unit
    from tooling.trained.serving.turns import Turns

    # This machine has no NVIDIA driver (nor, in the test interpreter, vLLM): nothing to read.
    assert gpu_clock.mark() is None
    assert gpu_clock.since(None) is None
    figures: dict = {}
    ran = []
    run_unit("pass at 1", lambda: ran.append(1), figures, Turns(tmp_path / "turns", 0, 1))
    assert ran == [1]
    (unit,) = figures["beside"]
    assert unit["unit"] == "pass at 1" and "other_cpu_s" in unit
    assert not any(key.startswith("sm_") for key in unit)


def _clocked(unit: str, mhz: float, lowest: float, capped: float = 0.0) -> dict:
    return {
        "unit": unit,
        "wall_s": 2.0,
        "own_cpu_s": 2.0,
        "other_cpu_s": 0.0,
        "sm_mhz_mean": mhz,
        "sm_mhz_min": lowest,
        "sm_samples": 12.0,
        "power_capped_s": capped,
        "thermal_capped_s": 0.0,
    }


def test_the_report_gives_each_engines_clock_unit_by_unit(tiny_pair: Path, tmp_path: Path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain-stock", "plain"], speed.Settings(k=15, levels=(64,)))
    stock = [_clocked("sustained window at 64", m, m - 30) for m in (1980, 1980, 1965)]
    fixed = [_clocked("sustained window at 64", m, 1755, 0.4) for m in (1890, 1905, 1875)]
    fixed.append(_clocked("steps at 64", 1980, 1980))
    for name, units in (("plain-stock", stock), ("plain", fixed)):
        figures = {"ok": True, "speed": {}, "beside": units}
        (work / f"{name}.out.json").write_text(json.dumps(figures))
    text, _ = speed.report(work)
    section = text.split("## The GPU's SM clock while each unit measured")[1]
    section = section.split("## Decode tokens/s")[0]
    assert (
        "| unit | plain-stock: MHz (lowest; capped s) | plain: MHz (lowest; capped s) |"
    ) in section
    assert "| sustained window at 64 | 1980 (1935; 0.0) | 1890 (1755; 1.2) |" in section
    assert "| steps at 64 | - | 1980 (1980; 0.0) |" in section


def test_a_run_that_read_no_clock_has_no_clock_section(tiny_pair: Path, tmp_path: Path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain"], speed.Settings(k=15, levels=(1,)))
    unit = {"unit": "pass at 1", "wall_s": 4.0, "own_cpu_s": 4.0, "other_cpu_s": 0.2}
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "speed": {}, "beside": [unit]}))
    text, _ = speed.report(work)
    assert "SM clock" not in text
    assert "## Other work on the host while each unit measured" in text


def test_the_bench_shows_the_clock_beside_plains_verdict_and_decides_nothing(tmp_path):
    import subprocess
    import sys

    from tooling.paths import REPO_DIR

    def figures(step_ms: float, mhz: float) -> dict:
        windows = [{"joined_ms": {"0": [step_ms] * 40}} for _ in range(5)]
        units = [_clocked("sustained window at 64", mhz, mhz - 100) for _ in range(5)]
        return {"ok": True, "speed": {}, "sustained": {"64": windows}, "beside": units}

    (tmp_path / "plain.out.json").write_text(json.dumps(figures(4.92, 1890)))
    (tmp_path / "plain-stock.out.json").write_text(json.dumps(figures(4.72, 1980)))
    bench = REPO_DIR / "bench" / "bench_dflash_speed.py"
    done = subprocess.run(
        [sys.executable, str(bench), str(tmp_path), "--plain-only"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout.splitlines()
    at_64 = out.index("plain at 64, decode steps, batch kept full: 0.959x stock over 5")
    assert out[at_64 + 1] == (
        "  GPU clock in 'sustained window at 64': 1890 against 1980 MHz (-4.5%)"
    )
    # The verdict is the measure's alone: 4% slower is a miss whatever the clock says.
    assert (
        "missed: plain at 64, decode steps, batch kept full: 0.959x stock, slower by more than 2%"
        in out
    )
    assert done.returncode == 1
