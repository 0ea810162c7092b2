"""The speed run's planning and its report (``tooling.trained.speed``); its trace reading is
``test_speed_trace.py``'s, the bench's judgement ``test_speed_bench.py``'s; the engines
themselves run only on a GPU host."""

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


def test_prompts_joining_are_marked_one_at_a_time_from_arrival_to_first_token():
    """``JoinMarks`` in a window of one completion: a prompt arriving inside it is marked
    until its first token; one arriving while that mark is open is not (marks never overlap),
    nor one arriving with the window's completions all in (its first token would fall outside
    the window); without a marker nothing is marked."""
    from contextlib import contextmanager

    from tooling.trained.serving.sustained import JoinMarks

    seen: list[str] = []

    @contextmanager
    def mark():
        seen.append("open")
        yield
        seen.append("closed")

    window = Window(level=1, warm=1, measured=1)
    window.began, window.completed = 1.0, 1
    marks = JoinMarks(window, mark)
    for rid in ("a", "b"):
        window.made[rid] = 0
        window.added_at[rid] = time.perf_counter()
        marks.arrived(rid)
    assert seen == ["open"] and marks.open == "a"
    window.take("a", 0, False)
    marks.settle()  # no token yet: still open
    assert seen == ["open"]
    window.take("a", 1, False)
    marks.settle()
    assert seen == ["open", "closed"] and marks.joins == 1 and marks.open is None
    window.take("a", 2, True)  # the window's last completion
    window.made["c"] = 0
    window.added_at["c"] = time.perf_counter()
    marks.arrived("c")
    assert seen == ["open", "closed"] and marks.open is None
    marks.close()
    unmarked = JoinMarks(window, None)
    unmarked.arrived("c")
    unmarked.settle()
    assert unmarked.open is None and unmarked.joins == 0


def test_the_report_gives_prompts_joining_at_one_request_their_own_tables(tiny_pair, tmp_path):
    work = tmp_path / "work"
    speed.plan(tiny_pair, work, ["plain", "dflash"], speed.Settings(k=15, levels=(1,)))
    joining = {"1": {"step_ms": 21.5, "cpu_ms": {"gdn: metadata": 0.75}}}
    steady = {"1": {"step_ms": 2.0}}
    for name in ("plain", "dflash"):
        figures = {"ok": True, "profile": steady, "timed": steady}
        figures |= {"profile_joining": joining, "timed_joining": joining}
        (work / f"{name}.out.json").write_text(json.dumps(figures))
    text, _ = speed.report(work)
    profiled, timed = text.split("## The same steps, no profiler")
    heading = "### 1 concurrent, a prompt joining{}: ms from its arrival to its first token"
    assert heading.format("") in profiled and "| step_ms | 21.50 | 21.50 |" in profiled
    assert heading.format(", no profiler") in timed
    assert "| CPU: gdn: metadata | 0.750 | 0.750 |" in timed
