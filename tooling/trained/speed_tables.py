"""The speed report's tables of engine steps, of profiles and of the sustained windows'
steps (``tooling.trained.speed``), each a list of Markdown lines from the run's results, one
column per engine."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

from .serving import beside, gpu_clock
from .serving.trace_split import outermost


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def step_table(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """Median engine step time and tokens per step once every request is decoding."""
    levels = sorted({int(lv) for r in results.values() for lv in r.get("steps", {})})
    lines = [
        "| concurrent | " + " | ".join(f"{name} ms/step (tok/step)" for name in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for level in levels:
        cells = []
        for name in names:
            s = results.get(name, {}).get("steps", {}).get(str(level), {})
            if not s.get("steps") and s.get("at_once", level) < level:
                cells.append(f"- (**{s['at_once']} of {level} at once**)")
                continue
            cells.append(
                f"{fmt(s.get('step_ms_median'), '.2f')} ({fmt(s.get('tokens_per_step'), '.1f')})"
            )
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


#: A profile's figures, and its groups of ms by region or operation, as the table labels them.
FIGURES = ("step_ms", "gpu_busy_ms", "gpu_idle_ms", "kernels", "sync_calls", "alloc_calls")
GROUPS = (
    ("gpu_ms", "GPU"),
    ("cpu_ms", "CPU"),
    ("sync_ms", "wait"),
    ("alloc_ms", "alloc"),
    ("forward_ops", "forward op"),
)


def profile_table(
    names: list[str], results: dict[str, dict[str, Any]], key: str = "profile"
) -> list[str]:
    """Per profiled level (``profile``: steady decode; ``profile_sustained``: the batch kept
    full; ``profile_joining``: prompts joining one at a time, each from its arrival to its
    first token; ``timed``, ``timed_sustained`` and ``timed_joining``: the same with no
    profiler): GPU ms per step (or per prompt joining) by what launched it, the GPU's idle
    time, CPU ms per region and host waits."""
    lines: list[str] = []
    joining = key.endswith("_joining")
    kind = ", batch kept full" if key.endswith("_sustained") else ""
    kind += ", a prompt joining" if joining else ""
    kind += ", no profiler" if key.startswith("timed") else ""
    unit = "ms from its arrival to its first token" if joining else "ms per engine step"
    levels = sorted({int(lv) for r in results.values() for lv in r.get(key, {})})
    for level in levels:
        profiles = {name: results.get(name, {}).get(key, {}).get(str(level), {}) for name in names}
        rows: dict[str, dict[str, str]] = {}
        for name, p in profiles.items():
            if "error" in p:
                rows.setdefault("profile failed", {})[name] = p["error"][:60]
                continue
            for figure in FIGURES:
                if figure in p:
                    rows.setdefault(figure, {})[name] = fmt(p[figure], ".2f")
            for group, label in GROUPS:
                for category, ms in p.get(group, {}).items():
                    rows.setdefault(f"{label}: {category}", {})[name] = fmt(ms, ".3f")
        if not rows:
            continue
        lines += [
            "",
            f"### {level} concurrent{kind}: {unit}",
            "",
            "| | " + " | ".join(profiles) + " |",
            "|---" * (len(profiles) + 1) + "|",
        ]
        lines += [
            f"| {row} | " + " | ".join(cells.get(n, "-") for n in profiles) + " |"
            for row, cells in rows.items()
        ]
    return lines


def dispatch_table(
    names: list[str], results: dict[str, dict[str, Any]], filed: str = "step_ms"
) -> list[str]:
    """The steps of every sustained window at each level, by the target forward's mode
    (``step_ms``) or by the prompts joining them (``joined_ms``): how many, their median ms
    and their share of the windows' step time."""
    levels = sorted({int(lv) for r in results.values() for lv in r.get("sustained", {})})
    lines = ["| concurrent | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for level in levels:
        cells = []
        for name in names:
            merged: dict[str, list[float]] = {}
            for w in results.get(name, {}).get("sustained", {}).get(str(level), []):
                for mode, ms in w.get(filed, {}).items():
                    merged.setdefault(mode, []).extend(ms)
            total = sum(sum(ms) for ms in merged.values()) or 1.0
            cells.append(
                "; ".join(
                    f"{mode} {len(ms)} × {statistics.median(ms):.2f} ms ({sum(ms) / total:.0%})"
                    for mode, ms in sorted(merged.items())
                )
                or "-"
            )
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


def _compiled(kernels: dict[str, list[float]] | None) -> str:
    if kernels is None:
        return "not counted"
    if not kernels:
        return "none"
    times = sum(int(n) for n, _ in kernels.values())
    ms = sum(m for _, m in kernels.values())
    top = max(kernels.items(), key=lambda kv: kv[1][1])
    return f"{times} in {ms:.0f} ms (most: {top[0].rsplit('.', 1)[-1]}, {top[1][1]:.0f} ms)"


def _window_ms(window: dict[str, Any]) -> float | None:
    if not window.get("steps") or "seconds" not in window:
        return None
    return window["seconds"] * 1000.0 / window["steps"]


def compile_table(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """The Triton kernels each engine compiled (or loaded from Triton's disk cache) in each
    level's warm-up, with the ms a step of its cold window (the batch kept full, before any
    measured window), then in every measured unit after the warm-ups; and the measured
    sustained windows' ms a step, first to last."""
    levels = sorted({int(lv) for r in results.values() for lv in r.get("warm", {})})
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for level in levels:
        cells = []
        for name in names:
            warm = results.get(name, {}).get("warm", {}).get(str(level), {})
            cold = _window_ms(warm.get("sustained_cold", {}))
            cells.append(
                _compiled(warm.get("triton_compiled"))
                + ("" if cold is None else f"; cold window {cold:.1f} ms a step")
            )
        lines.append(f"| warm-up at {level} | " + " | ".join(cells) + " |")
    lines.append(
        "| measured units | "
        + " | ".join(_compiled(results.get(n, {}).get("triton_compiled")) for n in names)
        + " |"
    )
    sustained = sorted({int(lv) for r in results.values() for lv in r.get("sustained", {})})
    for level in sustained:
        cells = []
        for name in names:
            windows = results.get(name, {}).get("sustained", {}).get(str(level), [])
            ms = [_window_ms(w) for w in windows]
            cells.append(", ".join(fmt(m, ".1f") for m in ms) or "-")
        lines.append(f"| windows at {level}, ms a step in order | " + " | ".join(cells) + " |")
    return lines


def _windows_table(
    names: list[str], results: dict[str, dict[str, Any]], cell: Callable[[list[dict]], str]
) -> list[str]:
    """A row per level of the windows with the batch kept full, a cell per engine: ``cell``
    of that engine's windows at that level ("-" where it gives nothing)."""
    levels = sorted({int(lv) for r in results.values() for lv in r.get("sustained", {})})
    lines = ["| concurrent | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for level in levels:
        cells = [
            cell(results.get(name, {}).get("sustained", {}).get(str(level), [])) or "-"
            for name in names
        ]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


def _allocator_cell(windows: list[dict]) -> str:
    counts = [w["allocator"] for w in windows if w.get("allocator")]
    if not counts:
        return ""
    total = {k: sum(c.get(k, 0) for c in counts) for k in counts[0]}
    return (
        f"{total.get('num_device_alloc', 0)} mallocs, {total.get('num_device_free', 0)} "
        f"frees, {total.get('num_alloc_retries', 0)} retries"
    )


def allocator_table(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """Per level, what each engine's caching allocator did during its windows with the batch
    kept full (summed over them): device allocations, frees, and retries after freeing its
    cache."""
    return _windows_table(names, results, _allocator_cell)


def _first_token_cell(windows: list[dict]) -> str:
    ms = sorted(m for w in windows for m in w.get("first_token_ms") or [])
    if not ms:
        return ""
    p90 = ms[min(len(ms) - 1, (9 * len(ms)) // 10)]
    return f"{statistics.median(ms):.1f} / {p90:.1f} ({len(ms)} requests)"


def first_token_table(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """Per level, each engine's time from a request's add to its first token over its windows
    with the batch kept full (requests added inside them): median and 90th percentile, ms."""
    return _windows_table(names, results, _first_token_cell)


def slowest_forward_lines(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """For each engine's profile with the batch kept full, its slowest forward read off event
    by event: its outermost events by length, and the longest gaps between them (the host in
    Python, or waiting in nothing the trace records)."""
    lines: list[str] = []
    for name in names:
        for level, p in sorted(results.get(name, {}).get("profile_sustained", {}).items()):
            slowest = p.get("slowest_forward") or {}
            rows = slowest.get("rows") or []
            if not rows:
                continue
            outer = outermost((start, dur, (cat, op)) for start, dur, cat, op in rows)
            gaps = [
                (start - (before + took), op)
                for (before, took, _), (start, _, (_, op)) in itertools.pairwise(outer)
            ]
            longest = sorted(((dur, *kind) for _, dur, kind in outer), key=lambda o: -o[0])[:6]
            widest = sorted(gaps, key=lambda g: -g[0])[:3]
            lines += [
                f"- `{name}` at {level}: {fmt(slowest.get('ms'), '.1f')} ms, "
                f"{slowest.get('events')} events, {len(outer)} outermost; longest: "
                + ", ".join(f"{op} ({cat}) {dur / 1000:.2f} ms" for dur, cat, op in longest)
                + "; widest gaps before: "
                + ", ".join(f"{op} {gap / 1000:.2f} ms" for gap, op in widest)
            ]
    return lines


def beside_lines(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """Each engine's units and the most other work the host did beside one, then every unit
    that was not measured alone (``serving.beside``)."""
    lines = []
    for name in names:
        units = results[name].get("beside") or []
        if not units:
            lines.append(f"- `{name}`: not read (no unit, or no /proc/stat on the host)")
            continue
        most = max(units, key=beside.share)
        lines.append(
            f"- `{name}`: {len(units)} units; at most {beside.share(most):.2f} CPU-s a second "
            f"of other work beside one ({most['unit']})"
        )
    crowded = [line for name in names for line in beside.crowded({**results[name], "name": name})]
    if crowded:
        lines += ["", f"**Not measured alone** (above {beside.LIMIT} CPU-s a second):", ""]
        lines += [f"- {line}" for line in crowded]
    return lines


def clock_lines(names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """The GPU's SM clock while each kind of unit measured, one column per engine: the median
    of its units' mean clocks, their lowest sample and the time capped by power or heat
    (``serving.gpu_clock``); nothing where no unit of the run read the clock."""
    by_unit: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in names:
        for unit in gpu_clock.clocked(results[name]):
            by_unit.setdefault(unit["unit"], {}).setdefault(name, []).append(unit)
    if not by_unit:
        return []
    lines = [
        "| unit | " + " | ".join(f"{name}: MHz (lowest; capped s)" for name in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for unit_name, engines in by_unit.items():
        cells = []
        for name in names:
            units = engines.get(name, [])
            if not units:
                cells.append("-")
                continue
            mean = statistics.median(u["sm_mhz_mean"] for u in units)
            lowest = min(u["sm_mhz_min"] for u in units)
            capped = sum(u.get("power_capped_s", 0.0) for u in units)
            capped += sum(u.get("thermal_capped_s", 0.0) for u in units)
            cells.append(f"{mean:.0f} ({lowest:.0f}; {capped:.1f})")
        lines.append(f"| {unit_name} | " + " | ".join(cells) + " |")
    return lines
