"""``serving.watch.Stalls``: the Triton compiles and garbage collections that hold a step, which
a sustained window files each step under, and the report's table of them.

On the trained pair a DFlash window's steps ran 2.5 to 4 times its steady steps, and each
engine's five windows ran slower first to last (2026-12-05). A kernel specialization that no
warm-up met compiles in the first mixed steps of its shape; these say which steps met one.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from tooling.paths import REPO_DIR
from tooling.trained import speed
from tooling.trained.serving.sustained import Window, _figures
from tooling.trained.serving.watch import stall_kind, totals_grown
from tooling.trained.speed_tables import compile_table, dispatch_table

# Triton on this machine has no GPU driver, so it cannot compile; its runtime calls the two
# hooks with these keywords (triton/runtime/jit.py, ``_call_hook``, 3.6 as on the GPU host and
# 3.9 here), on the real ``knobs`` object, with its own ``JitFunctionInfo``.
HOOKS = textwrap.dedent(
    """
    import gc
    import json

    import triton
    import triton.language as tl
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from tooling.trained.serving.watch import Stalls, stall_kind

    @triton.jit
    def kern(x_ptr, n, BLOCK: tl.constexpr):
        pass

    asked = []

    def earlier(**kw):
        asked.append(kw["fn"].name)
        return True

    knobs.runtime.jit_cache_hook = earlier
    stalls = Stalls()
    stalls.install()
    info = JitFunctionInfo(kern.fn.__module__, kern.fn.__qualname__, kern)
    call = dict(repr="kern", fn=info, compile={}, is_manual_warmup=False, already_compiled=False)
    key = ("specialization", (16,))
    answer = knobs.runtime.jit_cache_hook(key=key, **call)
    none_after = knobs.runtime.jit_post_compile_hook(key=key, **call)
    gc.collect()
    first = stalls.take()
    second = stalls.take()
    print(json.dumps({
        "answer": answer, "asked": asked, "none_after": none_after, "hooked": stalls.hooked,
        "first": first, "kind": stall_kind(first), "second": second, "totals": stalls.totals,
    }))
    """
)


@pytest.mark.slow
def test_stalls_count_triton_compiles_through_its_hooks_and_keep_hooks_set_before(
    probe_python, tmp_path
):
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    script = tmp_path / "hooks.py"  # Triton reads a kernel's source from its file
    script.write_text(HOOKS)
    done = subprocess.run(
        [str(probe_python), str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["hooked"]
    # The hook set before still answers (a true answer skips the compile) and is still asked.
    assert seen["answer"] is True and seen["asked"] == ["kern"]
    assert seen["none_after"] is None
    [(name, ms)] = seen["first"]["compiled"]
    assert name == "__main__.kern" and ms >= 0.0
    assert seen["first"]["collections"] >= 1 and seen["first"]["gc_ms"] >= 0.0
    assert seen["kind"] == "compile"
    # Taken once: the next look starts empty, while the run's totals keep it.
    assert seen["second"] == {"compiled": [], "gc_ms": 0.0, "collections": 0}
    assert seen["totals"]["__main__.kern"][0] == 1


def test_a_step_is_filed_by_what_stalled_it_and_the_window_keeps_each_kernel():
    window = Window(level=16, warm=16, measured=32)
    window.began = 1.0
    window.file_step(8.5, {"target FULL 256->256": 1}, 0, {"compiled": [], "collections": 0})
    compiled = {"compiled": [("fla.chunk_fwd", 310.0), ("conv.update", 40.5)], "gc_ms": 0.0}
    window.file_step(400.0, {"target PIECEWISE 496->512": 1}, 1, compiled)
    window.file_step(12.0, {"target FULL 256->256": 1}, 0, {"collections": 1, "gc_ms": 3.25})
    window.file_step(9.0, {"target FULL 256->256": 1}, 0, {"compiled": [("conv.update", 20.0)]})
    window.ended, window.ended_step, window.began_step = 2.0, 4, 0
    assert window.stalled_ms == {"none": [8.5], "compile": [400.0, 9.0], "gc": [12.0]}
    assert window.compiles == {"fla.chunk_fwd": [1, 310.0], "conv.update": [2, 60.5]}
    assert window.gc_ms == 3.25
    figures = _figures(window, None, None)
    assert figures["stalled_ms"] == window.stalled_ms and figures["gc_ms"] == 3.25
    # A window nobody watched for stalls says nothing of them.
    unwatched = Window(level=16, warm=16, measured=32)
    unwatched.began = 1.0
    unwatched.file_step(8.5, {"target FULL 256->256": 1})
    unwatched.ended, unwatched.ended_step = 2.0, 1
    assert "stalled_ms" not in _figures(unwatched, None, None)


def test_a_compile_comes_before_a_collection_in_a_steps_filing():
    assert stall_kind({"compiled": [("k", 1.0)], "collections": 2}) == "compile"
    assert stall_kind({"compiled": [], "collections": 1}) == "gc"
    assert stall_kind({}) == "none"


def test_what_the_totals_gained_is_counted_per_kernel():
    before = {"a": [2, 100.0]}
    after = {"a": [3, 130.5], "b": [1, 9.0], "c": [0, 0.0]}
    assert totals_grown(before, after) == {"a": [1, 30.5], "b": [1, 9.0]}
    assert totals_grown(after, after) == {}


def test_the_compile_table_gives_each_levels_warm_up_the_measured_units_and_windows_in_order():
    dflash = {
        "warm": {
            "16": {
                "triton_compiled": {"m.chunk_fwd": [3, 900.0], "m.conv": [1, 50.0]},
                "sustained_cold": {"seconds": 2.0, "steps": 50},
            }
        },
        "triton_compiled": {},
        "sustained": {"16": [{"seconds": 1.0, "steps": 40}, {"seconds": 0.5, "steps": 50}]},
        "joined_ms": {},
    }
    plain = {"warm": {"16": {}}, "sustained": {"16": [{"seconds": 0.2, "steps": 50}]}}
    lines = compile_table(["plain", "dflash"], {"plain": plain, "dflash": dflash})
    assert lines[2] == (
        "| warm-up at 16 | not counted | 4 in 950 ms (most: chunk_fwd, 900 ms); "
        "cold window 40.0 ms a step |"
    )
    assert lines[3] == "| measured units | not counted | none |"
    assert lines[4] == "| windows at 16, ms a step in order | 4.0 | 25.0, 10.0 |"


def test_the_report_files_the_windows_steps_by_what_stalled_them(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(16,)))
    stalled = {"none": [8.0, 9.0], "compile": [300.0]}
    windows = {"16": [{"tokens": 4500, "seconds": 1.0, "steps": 3, "stalled_ms": stalled}]}
    warm = {"16": {"triton_compiled": {"m.k": [2, 20.0]}}}
    figures = {"ok": True, "sustained": windows, "warm": warm, "triton_compiled": {}}
    (work / "dflash.out.json").write_text(json.dumps(figures))
    plain = {"16": [{"tokens": 3000, "seconds": 1.0, "steps": 3}]}
    (work / "plain.out.json").write_text(json.dumps({"ok": True, "sustained": plain}))
    text, ok = speed.report(work)
    assert ok
    by_stall = text.split("by what stalled them")[1].split("##")[0]
    assert "| 16 | - | compile 1 × 300.00 ms (95%); none 2 × 8.50 ms (5%) |" in by_stall
    compiled = text.split("## Triton kernels compiled, warm-up and measured")[1]
    assert "| warm-up at 16 | not counted | 2 in 20 ms (most: k, 20 ms) |" in compiled
    assert dispatch_table(["dflash"], {"dflash": figures}, "stalled_ms")[-1].startswith("| 16 |")
