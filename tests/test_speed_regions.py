"""The speed run's clock (``tooling.trained.serving.regions.timed``): engine steps timed with
no profiler, each region's time and the host's waits by the region they happen in. Driven
here with vLLM's own profiling scopes and its CPU runner's event; the engines themselves run
only on a GPU host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.trained import speed

from .helpers import run_on_tree

SCRIPT = """
import concurrent.futures, json, sys, time, torch
import vllm.v1.utils as vutils
from vllm.v1.utils import record_function_or_nullcontext as scope
from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper
from tooling.trained.serving import regions

class Runner:
    pass

runner = Runner()
before = (
    vutils._PROFILER_FUNC, concurrent.futures.Future.result, torch.Tensor.item, json.dumps
)
pool = concurrent.futures.ThreadPoolExecutor(1)

def step():
    with scope("gpu_model_runner: preprocess"):
        runner.prepare_inputs_event.synchronize()
        # Made again the way patch 30 makes its copy's event: timed as well.
        type(runner.prepare_inputs_event)().synchronize()
        torch.ones(1).item()  # a host tensor's: no wait
        json.loads("[1]")
        json.dumps([1])
        time.sleep(0.004)
    pool.submit(time.sleep, 0.002).result(timeout=60)

def measure(mark):
    step()  # before the window: not counted
    for _ in range(3):
        with mark():
            step()
    step()
    return {"steps": 3}

with _torch_cuda_wrapper():
    runner.prepare_inputs_event = torch.Event()
    # A method of a class, and a function of a module (no class).
    figures = regions.timed(
        runner,
        measure,
        (
            ("json.decoder", "JSONDecoder", "decode", "json: decode"),
            ("json", None, "dumps", "json: dumps"),
            ("json", None, "no_such_function", "json: none"),
        ),
    )
after = (
    vutils._PROFILER_FUNC, concurrent.futures.Future.result, torch.Tensor.item, json.dumps
)
json.dump({
    "figures": figures,
    "event": type(runner.prepare_inputs_event).__name__,
    "restored": [a is b for a, b in zip(before, after)],
}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_the_clock_times_regions_and_waits_in_the_marked_steps_alone(
    probe_python, upstream_0201, tmp_path
):
    seen = run_on_tree(
        probe_python, Path(upstream_0201.source_dir), tmp_path, SCRIPT, "", timeout=600
    )
    figures = seen["figures"]
    assert figures["regions_missing"] == ["json.no_such_function"]
    # Two event waits in the region, the engine's wait for the output; the host tensor's
    # .item() is none, and nor is anything of the steps outside the window.
    assert figures["sync_calls"] == 3.0
    assert set(figures["sync_ms"]) == {"gpu_model_runner: preprocess", "engine: a step's output"}
    assert figures["cpu_ms"]["gpu_model_runner: preprocess"] >= 4.0
    assert "json: decode" in figures["cpu_ms"] and "json: dumps" in figures["cpu_ms"]
    assert figures["step_ms"] >= figures["cpu_ms"]["gpu_model_runner: preprocess"]
    # Everything is put back: vLLM's scopes, the future, the tensor method, the module's
    # function.
    assert seen["restored"] == [True, True, True, True]
    assert seen["event"] == "_EventPlaceholder"


def test_the_report_gives_the_timed_steps_their_own_tables(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    timed = {"16": {"step_ms": 5.5, "sync_ms": {"gpu_model_runner: draft": 1.25}}}
    kept = {"16": {"step_ms": 5.25, "cpu_ms": {"gpu_model_runner: draft": 0.5}}}
    figures = {"ok": True, "timed": timed, "timed_sustained": kept}
    (work / "dflash.out.json").write_text(json.dumps(figures))
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "timed": timed}))
    text, _ = speed.report(work)
    section = text.split("## The same steps, no profiler: CPU by region and the host's waits")[1]
    steady, kept_full = section.split(
        "### 16 concurrent, batch kept full, no profiler: ms per engine step"
    )
    assert "### 16 concurrent, no profiler: ms per engine step" in steady
    assert "| wait: gpu_model_runner: draft | 1.250 | 1.250 |" in steady
    assert "| CPU: gpu_model_runner: draft | - | 0.500 |" in kept_full
