"""The speed run's planning, its trace reading and its report (``tooling.trained.speed``,
``tooling.trained.serving.trace_split``); the engines themselves run only on a GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR
from tooling.trained import speed, speed_engines
from tooling.trained.serving import trace_split
from tooling.trained.serving.sustained import Window

STEP = "engine step"


def _cpu(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(ts: float, correlation: int, name: str = "cudaLaunchKernel", dur: float = 5.0) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": 1,
        "args": {"correlation": correlation},
    }


def _kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": 7,
        "args": {"correlation": correlation},
    }


def _two_steps() -> list[dict]:
    """Two engine steps of 1000 us: the forward launches a GDN kernel and a GEMM, the drafter
    one kernel, and the second step waits 200 us on a stream."""
    events = []
    for i, begin in enumerate((0.0, 1000.0)):
        events += [
            _cpu(STEP, begin, 1000.0),
            _cpu("gpu_model_runner: forward", begin + 100, 300),
            _launch(begin + 150, 10 * i + 1),
            _launch(begin + 200, 10 * i + 2),
            _kernel("fused_sigmoid_gating_delta_rule_update_kernel", begin + 160, 400, 10 * i + 1),
            _kernel("nvjet_sm90_gemm", begin + 560, 100, 10 * i + 2),
            _cpu("gpu_model_runner: draft", begin + 500, 400),
            _cpu("drafter: context kv", begin + 520, 50),
            _launch(begin + 530, 10 * i + 3),
            _kernel("some_gemm", begin + 700, 50, 10 * i + 3),
        ]
    events.append(_launch(1950, 99, name="cudaStreamSynchronize", dur=200.0))
    # Launched before the window: not counted.
    events.append(_kernel("early", -50, 40, 1234))
    return events


def test_a_kernel_counts_under_the_innermost_region_that_launched_it():
    events = _two_steps()
    steps, window = trace_split.step_window(events, STEP)
    assert (steps, window) == (2, (0.0, 2000.0))
    figures = trace_split.split(events, steps, window).per_step()
    assert figures["step_ms"] == 1.0
    # GDN apart from the rest of the forward, the drafter's context KV apart from it.
    assert figures["gpu_ms"] == {
        "target forward: GDN": 0.4,
        "target forward": 0.1,
        "drafter context KV": 0.05,
    }
    # 400 + 100 (overlapping 0) + 50 us busy a step.
    assert figures["gpu_busy_ms"] == 0.55
    assert figures["gpu_idle_ms"] == 0.45
    assert figures["kernels"] == 3.0
    assert figures["cpu_ms"]["gpu_model_runner: draft"] == 0.4
    assert figures["sync_ms"] == {trace_split.UNNAMED: 0.1}
    assert figures["top_kernels"][0]["name"].startswith("fused_sigmoid_gating")


def test_the_forwards_cpu_time_splits_by_its_outermost_operations():
    """An op's own runtime calls count inside it; a launch outside any op counts alone; what
    no op covers is the forward's Python; operations outside the forward are not its."""
    events = _two_steps()
    for begin in (0.0, 1000.0):
        op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": begin + 140, "dur": 50.0}
        events += [{**op, "tid": 1}, {**op, "name": "aten::copy_", "ts": begin + 600, "tid": 1}]
    steps, window = trace_split.step_window(events, STEP)
    ops = trace_split.split(events, steps, window).per_step()["forward_ops"]
    assert ops == {
        trace_split.BETWEEN_OPS: 0.245,
        "aten::mm": 0.05,
        "cudaLaunchKernel": 0.005,
    }


def test_the_allocators_calls_count_apart_and_the_slowest_forward_is_kept_event_by_event():
    events = _two_steps()
    # The second step's forward runs longer and frees device memory inside it.
    events += [
        _launch(1200, 98, name="cudaFree", dur=40.0),
        _cpu("gpu_model_runner: forward", 1000 + 100, 350),
    ]
    events = [e for e in events if not (e.get("ts") == 1100 and e.get("dur") == 300)]
    steps, window = trace_split.step_window(events, STEP)
    figures = trace_split.split(events, steps, window).per_step()
    assert figures["alloc_calls"] == 0.5
    assert figures["alloc_ms"] == {"gpu_model_runner: forward": 0.02}
    slowest = trace_split.slowest_forward(events, window)
    assert slowest["ms"] == 0.35 and slowest["events"] == 3
    assert [row[3] for row in slowest["rows"]] == [
        "cudaLaunchKernel",
        "cudaLaunchKernel",
        "cudaFree",
    ]
    assert slowest["rows"][2][:3] == [100.0, 40.0, "cuda_runtime"]
    assert trace_split.slowest_forward(events, (5000.0, 6000.0)) == {}


def test_a_trace_without_marked_steps_is_refused():
    with pytest.raises(ValueError, match="engine step"):
        trace_split.step_window([_cpu("gpu_model_runner: forward", 0, 1)], STEP)


@pytest.mark.slow
def test_a_real_profiler_trace_is_read(tmp_path, probe_python):
    """torch's own Chrome trace (CPU only here), with the regions the speed run opens."""
    script = f"""
import json, time, torch
from torch.profiler import profile, ProfilerActivity, record_function
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        with record_function({STEP!r}):
            with record_function("gpu_model_runner: forward"):
                torch.ones(64, 64) @ torch.ones(64, 64)
            with record_function("gpu_model_runner: draft"):
                time.sleep(0.003)
prof.export_chrome_trace({str(tmp_path / "trace.json")!r})
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    subprocess.run([str(probe_python), "-c", script], check=True, env=env, timeout=300)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    steps, window = trace_split.step_window(events, STEP)
    figures = trace_split.split(events, steps, window).per_step()
    assert steps == 3
    assert figures["cpu_ms"]["gpu_model_runner: draft"] >= 3.0
    assert figures["step_ms"] >= figures["cpu_ms"]["gpu_model_runner: draft"]
    assert "aten::matmul" in figures["forward_ops"]
    assert figures["gpu_ms"] == {}


def test_each_engine_is_planned_with_its_own_k_and_cache(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash-k7"], speed.Settings(k=15, levels=(1, 16)))
    plain = json.loads((work / "plain.in.json").read_text())
    k7 = json.loads((work / "dflash-k7.in.json").read_text())
    assert plain["engine"]["drafter"] is None and plain["engine"]["num_speculative_tokens"] == 0
    assert k7["engine"]["drafter"] == "/p/drafter" and k7["engine"]["num_speculative_tokens"] == 7
    assert (
        k7["engine"]["engine_args"]["compilation_config"]
        == speed_engines.GRAPHS_1024["compilation_config"]
    )
    assert k7["barrier_count"] == 2 and k7["profile_levels"] == [1, 16]
    # Prompts are drawn from the pair's vocabulary and seed: the same each time.
    assert all(8 <= t < 504 for p in k7["prompts"] for t in p)
    again = speed.read_pair(tiny_pair).prompts
    assert again == k7["prompts"]
    # A later run in the same folder keeps the earlier engines listed.
    speed.plan(tiny_pair, work, ["dflash"], speed.Settings(k=15))
    listed = [e["name"] for e in json.loads((work / "engines.json").read_text())]
    assert listed == ["plain", "dflash-k7", "dflash"]
    # A run that measures plain again sets the earlier run's figures aside whole, so that no
    # report takes a ratio against another run's plain.
    (work / "plain.out.json").write_text("{}")
    (work / "dflash-k7.partial.json").write_text("{}")
    speed.plan(tiny_pair, work, ["plain", "dflash-hold"], speed.Settings(k=15))
    listed = [e["name"] for e in json.loads((work / "engines.json").read_text())]
    assert listed == ["plain", "dflash-hold"] and not (work / "plain.out.json").exists()
    aside = work / "earlier-1"
    assert (aside / "plain.out.json").is_file() and (aside / "dflash-k7.partial.json").is_file()
    earlier = [e["name"] for e in json.loads((aside / "engines.json").read_text())]
    assert earlier == ["plain", "dflash-k7", "dflash"]


def test_a_random_pair_drafts_the_seeds_k_and_a_seed_run_can_go_one_engine_at_a_time(
    tiny_pair, tmp_path
):
    work = tmp_path / "work"
    settings = speed.Settings(levels=(1, 8, 32), one_at_a_time=True)
    speed.plan(tiny_pair, work, ["seed-plain", "seed-dflash"], settings)
    drafted = json.loads((work / "seed-dflash.in.json").read_text())
    assert drafted["engine"]["num_speculative_tokens"] == speed.RANDOM_PAIR_K == 15
    # Each engine alone: no barrier waits for the other.
    assert drafted["barrier_count"] == 1 and drafted["constant_logits"] is True


def test_a_level_the_engine_could_not_hold_at_once_is_named_not_left_blank(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain"], speed.Settings(k=15, levels=(32,)))
    steps = {"32": {"steps": 0, "step_ms_median": None, "at_once": 31}}
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "steps": steps}))
    text, _ = speed.report(work)
    assert "| 32 | - (**31 of 32 at once**) |" in text


def _steps(*ms: float) -> dict:
    return {
        str(lv): {"step_ms_median": m, "tokens_per_step": 1.0}
        for lv, m in zip((1, 8), ms, strict=True)
    }


def test_the_projection_reads_the_drafted_step_between_its_two_measured_ends():
    plain = {"steps": _steps(10.0, 20.0)}
    drafted = {"steps": _steps(20.0, 40.0), "constant_logits": {"steps": _steps(35.0, 55.0)}}
    lines = speed.projection(plain, drafted, 15, range(2, 4))
    # Acceptance length 2: 20 + 15 * 1/15 = 21 ms against 10 ms plain: 2 * 10 / 21.
    assert lines[-2] == "| 2 | 0.95x | 0.98x |"
    assert lines[-1] == "| 3 | 1.36x | 1.43x |"


def test_the_report_gives_ratios_pass_by_pass_and_keeps_a_cut_short_engine(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(1,)))
    passes = [
        {"tokens": 100, "seconds": s, "most_running": 1, "acceptance_length": None}
        for s in (1.0, 2.0)
    ]
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "speed": {"1": passes}}))
    drafted = [{**p, "acceptance_length": 3.0} for p in passes[:1]]
    (work / "dflash.partial.json").write_text(
        json.dumps({"ok": False, "error": "cut short", "speed": {"1": drafted}})
    )
    text, ok = speed.report(work)
    assert not ok
    assert "| 1 | 75 (1.00) | 100 (1.00, AL 3.00) |" in text
    assert "cut short" in text


def test_where_the_fixed_wheels_plain_engine_failed_the_ratios_are_to_stocks(tiny_pair, tmp_path):
    """2026-12-05: the fixed wheel's plain engine died at start-up and every ratio read "-";
    the report then takes plain stock as the reference, and says so in its header."""
    work = tmp_path / "work"
    engines = ["plain-stock", "plain", "dflash"]
    speed.plan(tiny_pair, work, engines, speed.Settings(k=15, levels=(1,)))
    passes = [{"tokens": 100, "seconds": 1.0, "most_running": 1} for _ in range(3)]
    (work / "plain-stock.out.json").write_text(json.dumps({"ok": True, "speed": {"1": passes}}))
    (work / "plain.out.json").write_text(json.dumps({"ok": False, "error": "AttributeError"}))
    drafted = [{**p, "seconds": 2.0, "acceptance_length": 1.0} for p in passes]
    (work / "dflash.out.json").write_text(json.dumps({"ok": True, "speed": {"1": drafted}}))
    text, ok = speed.report(work)
    assert not ok
    assert "| concurrent | plain-stock tok/s (x plain-stock) |" in text
    assert "| 1 | 100 (1.00) | - (-) | 50 (0.50, AL 1.00) |" in text


def test_the_host_step_refuses_an_unknown_pair_kind_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "tooling", "host", "speed", "draw", "nope", "dir"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: tooling host speed: draw needs ARCH (trained-shape, seed) and DIR"
    ]


@pytest.mark.parametrize("step", ["start", "run"])
def test_a_folder_with_no_pair_is_refused_in_one_line_before_a_run_starts(step, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tooling", "host", "speed", step, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=60,
        env={**os.environ, "WORK": str(tmp_path / "work")},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: tooling host speed: {step}: {tmp_path} holds no pair: "
        "neither prompts.json nor tiny.json"
    ]
    assert not (tmp_path / "work" / "speed").exists()


def test_the_speed_run_itself_refuses_a_folder_with_no_pair(tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "tooling.trained.speed", "run", str(tmp_path), str(work)]
    done = subprocess.run(
        [*cmd, "--engines-root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=60,
    )
    assert done.returncode == speed.SmokeError.exit_code != 0
    assert f"error: {tmp_path} holds no pair" in done.stderr
    assert not work.exists()


def _passes(*rates: float) -> dict:
    return {
        "speed": {str(lv): [{"tokens": r, "seconds": 1.0} for r in rates] for lv in (1, 16, 64)}
    }


def test_the_bench_judges_the_bar_on_a_runs_figures(tmp_path):
    """bench/bench_dflash_speed.py: the median of per-pass ratios against each goal, on
    batches and, where the run has them, on windows with the batch kept full."""
    bench = REPO_DIR / "bench" / "bench_dflash_speed.py"
    (tmp_path / "plain.out.json").write_text(json.dumps(_passes(100, 100, 100, 100, 100)))
    (tmp_path / "plain-stock.out.json").write_text(json.dumps(_passes(101, 99, 100, 100, 100)))
    (tmp_path / "dflash.out.json").write_text(json.dumps(_passes(300, 260, 240, 250, 90)))

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(bench), str(tmp_path)], capture_output=True, text=True, timeout=60
        )

    done = run()
    assert done.returncode == 0, done.stdout
    assert "dflash at 1, batch passes: 2.50x plain over 5 (goal 2.5)" in done.stdout
    (tmp_path / "dflash.out.json").write_text(json.dumps(_passes(300, 240, 240, 250, 90)))
    done = run()
    assert done.returncode == 1
    assert "missed: dflash at 1, batch passes: 2.40x < 2.5" in done.stdout
    # Sustained windows are judged too: the batches pass, the windows fall short.
    drafted = _passes(300, 260, 240, 250, 90)
    drafted["sustained"] = _passes(200, 200, 200, 200, 200)["speed"]
    (tmp_path / "dflash.out.json").write_text(json.dumps(drafted))
    done = run()
    assert done.returncode == 1
    # Plain has no windows in this run: nothing to take a ratio to, named as such.
    assert "missed: dflash at 1, batch kept full: 0 passes, fewer than 5" in done.stdout
    for name in ("plain", "plain-stock"):
        floor = json.loads((tmp_path / f"{name}.out.json").read_text())
        floor["sustained"] = _passes(100, 100, 100, 100, 100)["speed"]
        (tmp_path / f"{name}.out.json").write_text(json.dumps(floor))
    done = run()
    assert done.returncode == 1
    assert "missed: dflash at 1, batch kept full: 2.00x < 2.5" in done.stdout
    assert "dflash at 16, batch kept full: 2.00x plain over 5 (goal 1.0)" in done.stdout
    (tmp_path / "plain.out.json").unlink()
    assert run().returncode == 2


def test_the_bench_holds_plain_to_stock_on_steady_windows_where_the_run_has_them(tmp_path):
    """Single passes of one engine spread far more than 2% on the GPU host (2026-12-05), so
    plain against stock is judged on the steady windows taken in turns."""
    bench = REPO_DIR / "bench" / "bench_dflash_speed.py"
    drafted = _passes(300, 300, 300, 300, 300)
    noisy = _passes(100, 100, 100, 100, 100)
    (tmp_path / "dflash.out.json").write_text(json.dumps(drafted))
    (tmp_path / "plain-stock.out.json").write_text(json.dumps(_passes(80, 130, 90, 120, 70)))

    def run(plain_steady: list[float], stock_steady: list[float]) -> str:
        plain = {**noisy, "steady": _passes(*plain_steady)["speed"]}
        stock = json.loads((tmp_path / "plain-stock.out.json").read_text())
        stock["steady"] = _passes(*stock_steady)["speed"]
        (tmp_path / "plain.out.json").write_text(json.dumps(plain))
        (tmp_path / "plain-stock.out.json").write_text(json.dumps(stock))
        done = subprocess.run(
            [sys.executable, str(bench), str(tmp_path)], capture_output=True, text=True, timeout=60
        )
        return done.stdout

    out = run([100, 101, 99, 100, 100], [100, 100, 100, 101, 100])
    assert "plain at 64, steady windows: 1.000x stock over 5" in out
    passes = [line for line in out.splitlines() if "plain at" in line and "batch passes" in line]
    assert passes and all(line.endswith("(shown, not judged)") for line in passes)
    assert "missed: plain" not in out
    out = run([96, 97, 96, 96, 97], [100, 100, 100, 100, 100])
    assert "missed: plain at 16, steady windows: 0.960x stock, slower by more than 2%" in out
    # Faster than stock is no miss: the series' shared code speeds plain serving too.
    out = run([104, 105, 104, 104, 106], [100, 100, 100, 100, 100])
    assert "plain at 16, steady windows: 1.040x stock over 5" in out
    assert "missed: plain" not in out
    out = run([100, 100], [100, 100])
    assert "missed: plain at 1, steady windows: 2 windows, fewer than 5" in out
    # A run of plain and stock alone (``speed-stock``) is judged on that alone.
    (tmp_path / "dflash.out.json").unlink()
    run([100, 101, 99, 100, 100], [100, 100, 100, 101, 100])
    done = subprocess.run(
        [sys.executable, str(bench), str(tmp_path), "--plain-only"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout
    assert "dflash" not in done.stdout and "plain at 64, steady windows: 1.000x" in done.stdout


def _kept_full(*decode_ms: float, steps: int = 9) -> dict:
    """Windows with the batch kept full, one a pass: each pass's decode steps (no prompt
    joined) around its median ``decode_ms``, and a joined step far slower."""
    windows = [
        {
            "tokens": 100,
            "seconds": 1.0,
            "joined_ms": {
                "0": [ms * (1 + (i - steps // 2) / 100) for i in range(steps)],
                "1": [30.0 * ms],
            },
        }
        for ms in decode_ms
    ]
    return {"sustained": {str(lv): windows for lv in (1, 16, 64)}}


def test_the_bench_holds_plain_to_stock_on_decode_steps_where_the_batch_was_kept_full(tmp_path):
    """A run that kept the batch full is judged on each pass's median decode step (hundreds
    of steps a pass, where a steady window has 40): the steps a prompt joined, far slower
    and as many on both, are left out; the steady windows are shown, not judged."""
    bench = REPO_DIR / "bench" / "bench_dflash_speed.py"

    def run(plain_ms: list[float], stock_ms: list[float]) -> subprocess.CompletedProcess:
        plain = {**_kept_full(*plain_ms), "steady": _passes(50, 50, 50, 50, 50)["speed"]}
        stock = {**_kept_full(*stock_ms), "steady": _passes(100, 100, 100, 100, 100)["speed"]}
        (tmp_path / "plain.out.json").write_text(json.dumps(plain))
        (tmp_path / "plain-stock.out.json").write_text(json.dumps(stock))
        cmd = [sys.executable, str(bench), str(tmp_path), "--plain-only"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    done = run([2.0, 2.1, 2.0, 2.0, 2.2], [2.0, 2.0, 2.1, 2.0, 2.2])
    assert done.returncode == 0, done.stdout
    assert "plain at 16, decode steps, batch kept full: 1.000x stock over 5" in done.stdout
    assert "plain at 16, steady windows: 0.500x stock over 5 (shown, not judged)" in done.stdout
    done = run([2.1, 2.1, 2.1, 2.1, 2.1], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert done.returncode == 1
    assert "missed: plain at 64, decode steps, batch kept full: 0.952x stock, slower" in done.stdout


def test_an_interleaved_run_gives_each_engine_its_place_in_the_turns(tiny_pair, tmp_path):
    work = tmp_path / "work"
    settings = speed.Settings(k=15, levels=(1,), interleave=True, sustained=True)
    speed.plan(tiny_pair, work, ["plain-stock", "plain", "dflash"], settings)
    places = [json.loads((work / f"{n}.in.json").read_text()) for n in ("plain", "dflash")]
    assert [p["turns"] for p in places] == [
        {"folder": str(work / "turns"), "index": i, "count": 3} for i in (1, 2)
    ]
    assert all(p["sustained"] for p in places)
    speed.plan(tiny_pair, work, ["plain"], speed.Settings(k=15))
    assert json.loads((work / "plain.in.json").read_text())["turns"] is None


@pytest.mark.parametrize("size", ["0", "-4", "1.5"])
def test_a_drafted_kv_size_that_is_no_whole_gib_is_refused_before_any_work(
    tiny_pair, tmp_path, size
):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "tooling.trained.speed", "run", str(tiny_pair), str(work)]
    done = subprocess.run(
        [*cmd, "--engines-root", str(tmp_path), f"--drafted-kv-gib={size}"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"{size!r} is not a whole number of GiB above 0" in done.stderr
    assert not work.exists()


def test_turns_need_the_engines_served_together(tiny_pair, tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "tooling.trained.speed", "run", str(tiny_pair), str(work)]
    done = subprocess.run(
        [*cmd, "--engines-root", str(tmp_path), "--interleave", "--one-at-a-time"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        timeout=60,
    )
    assert done.returncode == speed.SmokeError.exit_code != 0
    assert done.stderr.strip().splitlines() == [
        "error: --interleave needs the engines served together, not one at a time"
    ]
    assert not work.exists()


def test_the_report_gives_the_sustained_windows_their_own_table(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    windows = {"16": [{"tokens": 3000, "seconds": 1.0, "acceptance_length": None}]}
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "sustained": windows}))
    drafted = {"16": [{"tokens": 4500, "seconds": 1.0, "acceptance_length": 5.5}]}
    (work / "dflash.out.json").write_text(json.dumps({"ok": True, "sustained": drafted}))
    text, ok = speed.report(work)
    assert ok
    table = text.split("## Decode tokens/s, batch kept full")[1]
    assert "| 16 | 3000 (1.00) | 4500 (1.50, AL 5.50) |" in table
    assert "| 16 | - | - |" in table.split("by the mode of the target's CUDA graph")[1]


def test_staggered_lengths_end_a_windows_requests_at_different_steps_alike_for_every_engine(
    tiny_pair, tmp_path
):
    """Each length from half the mean to one and a half once in every mean + 1 requests, the
    mean the run's; the option reaches every engine's request and the report's heading."""
    from tooling.trained.serving.sustained import staggered_length

    for mean in (128, 256):
        lengths = [staggered_length(i, mean) for i in range(mean + 1)]
        assert sorted(lengths) == list(range(mean // 2, mean // 2 + mean + 1))
        assert sum(lengths) / len(lengths) == mean
        # Neighbours differ: a window's first requests do not end together.
        assert len(set(lengths[:16])) == 16
    work = tmp_path / "work"
    settings = speed.Settings(k=15, levels=(16,), sustained=True, staggered=True)
    speed.plan(tiny_pair, work, ["plain", "dflash"], settings)
    for name in ("plain", "dflash"):
        assert json.loads((work / f"{name}.in.json").read_text())["staggered"] is True
        windows = {"16": [{"tokens": 3000, "seconds": 1.0, "acceptance_length": None}]}
        (work / f"{name}.out.json").write_text(json.dumps({"ok": True, "sustained": windows}))
    text, _ = speed.report(work)
    assert "## Decode tokens/s, batch kept full, requests of staggered lengths" in text


def test_the_report_sums_what_each_caching_allocator_did_in_its_windows(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    counts = {"num_alloc_retries": 2, "num_device_alloc": 5, "num_device_free": 3, "num_ooms": 0}
    window = {"tokens": 3000, "seconds": 1.0, "allocator": counts}
    (work / "dflash.out.json").write_text(
        json.dumps({"ok": True, "sustained": {"16": [window, window]}})
    )
    # An engine whose windows predate the counts shows none.
    (work / "plain.out.json").write_text(
        json.dumps({"ok": True, "sustained": {"16": [{"tokens": 3000, "seconds": 1.0}]}})
    )
    text, _ = speed.report(work)
    table = text.split("The caching allocator during those windows:")[1]
    assert "| 16 | - | 10 mallocs, 6 frees, 4 retries |" in table


def test_the_report_gives_each_engines_time_to_a_first_token_in_its_windows(tiny_pair, tmp_path):
    """Median and 90th percentile over every window's requests, so a setting that holds
    prompts back (patch 33) shows what its requests waited."""
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    first = [{"tokens": 1, "seconds": 1.0, "first_token_ms": [float(m) for m in range(1, 11)]}]
    second = [{"tokens": 1, "seconds": 1.0, "first_token_ms": [100.0]}]
    (work / "dflash.out.json").write_text(
        json.dumps({"ok": True, "sustained": {"16": first + second}})
    )
    (work / "plain.out.json").write_text(
        json.dumps({"ok": True, "sustained": {"16": [{"tokens": 3000, "seconds": 1.0}]}})
    )
    text, _ = speed.report(work)
    table = text.split("Time to a request's first token in those windows")[1]
    assert "| 16 | - | 6.0 / 10.0 (11 requests) |" in table


def test_a_window_times_the_first_token_of_the_requests_added_inside_it():
    window = Window(level=1, warm=1, measured=2)
    window.made = {"a": 0}  # added before the window opened: not timed
    window.began = 1.0
    window.made["b"] = 0
    window.added_at["b"] = time.perf_counter()
    window.take("a", 1, False)
    window.take("b", 0, False)  # no token yet
    assert window.first_token_ms == []
    window.take("b", 2, False)
    window.take("b", 3, False)
    assert len(window.first_token_ms) == 1 and window.first_token_ms[0] >= 0
    assert window.added_at == {}


@pytest.mark.slow
def test_the_allocators_counts_are_none_without_a_gpu(probe_python):
    code = (
        "from tooling.trained.serving.speed_run import allocator_counts; "
        "assert allocator_counts() == {}, allocator_counts(); print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    done = subprocess.run(
        [str(probe_python), "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_report_gives_the_steady_windows_their_own_table(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    for name, tokens in (("plain", 640), ("dflash", 2560)):
        windows = {"16": [{"tokens": tokens, "seconds": 0.16, "steps": 40}] * 5}
        (work / f"{name}.out.json").write_text(json.dumps({"ok": True, "steady": windows}))
    text, ok = speed.report(work)
    assert ok
    table = text.split("## Decode tokens/s, steady windows (every request decoding)")[1]
    assert "| 16 | 4000 (1.00) | 16000 (4.00) |" in table
    # No level profiled: the run timed no region, and the report says so.
    assert "No level was profiled, so no region was timed." in text


def test_a_profile_with_the_batch_kept_full_gets_its_own_table(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    steady = {str(n): {"step_ms": 8.5, "cpu_ms": {"drafter: propose": 3.0}} for n in (1, 16)}
    kept = {str(n): {"step_ms": 30.0, "cpu_ms": {"drafter: propose": 9.0}} for n in (1, 16)}
    figures = {"ok": True, "profile": steady, "profile_sustained": kept}
    (work / "dflash.out.json").write_text(json.dumps(figures))
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "profile": steady}))
    text, _ = speed.report(work)
    assert text.count("### 1 concurrent: ms per engine step") == 1
    first, kept_full = text.split("### 16 concurrent, batch kept full: ms per engine step")
    assert "### 16 concurrent: ms per engine step" in first
    assert "### 1 concurrent, batch kept full: ms per engine step" in first
    assert "| step_ms | 8.50 | 8.50 |" in first
    assert "| step_ms | - | 30.00 |" in kept_full
    assert "| CPU: drafter: propose | - | 9.000 |" in kept_full
    assert "No level was profiled" not in text


def test_the_report_reads_the_slowest_forward_off_its_events(tiny_pair, tmp_path):
    """Outermost events by length (an event inside another is not counted again) and the
    widest gaps between them, in ms."""
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    rows = [
        [0.0, 2000.0, "cpu_op", "vllm::gdn_attention_core"],
        [10.0, 5.0, "cuda_runtime", "cudaLaunchKernel"],
        [9000.0, 500.0, "cuda_runtime", "cudaFree"],
        [9600.0, 300.0, "cpu_op", "aten::copy_"],
    ]
    slowest = {"ms": 12.5, "events": 4, "rows": rows}
    kept = {"16": {"step_ms": 30.0, "slowest_forward": slowest}}
    (work / "dflash.out.json").write_text(json.dumps({"ok": True, "profile_sustained": kept}))
    (work / "plain.out.json").write_text(json.dumps({"ok": True}))
    text, _ = speed.report(work)
    section = text.split("### The slowest forward with the batch kept full, event by event")[1]
    line = section.strip().splitlines()[0]
    assert line.startswith("- `dflash` at 16: 12.5 ms, 4 events, 3 outermost; longest: ")
    assert "vllm::gdn_attention_core (cpu_op) 2.00 ms, cudaFree (cuda_runtime) 0.50 ms" in line
    assert line.endswith("widest gaps before: cudaFree 7.00 ms, aten::copy_ 0.10 ms")


def _methods(source_dir: Path, module: str) -> dict[str | None, tuple[set[str], list[str]]]:
    """Each class of ``module`` in a vLLM tree: its own methods and its bases' names; under
    None, the functions the module defines or imports, which its code calls by name."""
    import ast

    tree = ast.parse((source_dir / (module.replace(".", "/") + ".py")).read_text())
    found: dict[str | None, tuple[set[str], list[str]]] = {None: (set(), [])}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            found[node.name] = (names, [ast.unparse(b) for b in node.bases])
        elif isinstance(node, ast.FunctionDef):
            found[None][0].add(node.name)
        elif isinstance(node, ast.ImportFrom):
            found[None][0].update(a.asname or a.name for a in node.names)
    return found


@pytest.mark.slow
def test_every_profiled_region_names_a_method_the_release_has(patched_0201) -> None:
    """A region whose method is gone is only listed as missing in a profile, which a GPU
    session finds out too late: each is read here in the fixed 0.20.1 tree's source (some are
    the series' own, as drafting off's), the class's own or one of its bases' in the same
    module (a module's function: one it defines or imports), and has a category in the
    split."""
    from tooling.trained.serving.regions import REGIONS

    assert patched_0201.ok
    for module, cls, method, region in REGIONS:
        classes = _methods(Path(patched_0201.work_dir), module)
        own, bases = classes[cls]
        inherited = set().union(*(classes[b][0] for b in bases if b in classes))
        assert method in own | inherited, f"{cls}.{method} ({region})"
        assert region in trace_split.REGION_CATEGORIES, region
