"""The speed run's trace reading (``tooling.trained.serving.trace_split``): kernels, CPU time and
host waits split by region, on hand-made traces and on a real profiler's."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tooling.paths import REPO_DIR
from tooling.trained.serving import trace_split

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


def test_marked_steps_with_others_between_them_count_only_what_began_inside_a_mark():
    """Prompts joining, each marked to its first token, with unmarked decode steps between:
    a decode step's launches, kernels and regions are not the joins', nor is its time."""
    joins = _two_steps()
    # The second step moved on by 3000 us, and an unmarked decode step of 1000 us between.
    for e in joins[10:20]:
        e["ts"] += 3000.0
    between = [
        _cpu("gpu_model_runner: forward", 1500, 300),
        _launch(1550, 77),
        _kernel("decode_kernel", 1560, 300, 77),
        _cpu("gpu_model_runner: draft", 1900, 400),
    ]
    events = joins[:20] + between
    marks = trace_split.step_marks(events, STEP)
    assert marks == [(0.0, 1000.0), (4000.0, 5000.0)]
    steps, window = trace_split.step_window(events, STEP)
    figures = trace_split.split(events, steps, window, marks).per_step()
    assert figures["step_ms"] == 1.0
    assert figures["kernels"] == 3.0
    assert figures["cpu_ms"]["gpu_model_runner: draft"] == 0.4
    assert "decode_kernel" not in {k["name"] for k in figures["top_kernels"]}
    # Without the marks the decode step between counts as the joins' own.
    spanned = trace_split.split(events, steps, window).per_step()
    assert spanned["kernels"] == 3.5 and spanned["step_ms"] == 2.5


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
