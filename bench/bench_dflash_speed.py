"""DFlash's decode speed as a ratio to plain vLLM measured in the same run: issue 45's bar.

The floor is the plain engine of the run (the fixed wheel without a drafter), and plain on
stock 0.20.1 beside it, since the series touches code plain serving runs. The figures come
from a speed run (``tooling host speed start PAIR --engines plain-stock,plain,dflash`` on a
GPU host with the trained pair; ``python -m tooling.trained.speed`` writes them, one
``NAME.out.json`` an engine); this script reads them anywhere and judges:

- DFlash at the run's K, decode tokens/s: the median over the run's passes of each pass's
  ratio to plain's pass, at least ``GOALS`` at each concurrency; on batches timed to their
  last token and, where the run has them (``--sustained``), on windows with the batch kept
  full;
- plain on the fixed wheel no slower than plain on stock by more than ``PLAIN_TOLERANCE`` at
  each concurrency. Faster passes: the series' shared code (patch 19's one Gated DeltaNet
  metadata build for every group) also speeds plain serving of a hybrid target, and the bar
  is there to catch what the series costs plain. Judged on the most precise measure the run
  has: where it kept the batch full (``--sustained``), the decode steps no prompt joined,
  each pass's median step (hundreds of steps a pass where a steady window has 40, in turns
  with the other engines); else the steady windows (every request decoding, taken in
  turns); else every measure it has. Single passes and windows with prompts joining spread far more
  than 2% on a shared host (docs/notebook/2026-12-05-trained-speed.md).

Where the run read the GPU's SM clock (``serving.gpu_clock``), plain's judged lines are each
followed by the clock in the two engines' units: a few percent between them can be the
clock, not the code. It decides nothing.

A run in which any engine's unit had other work beside it on the host (more than
``serving.beside.LIMIT`` CPU-s a second) is not judged: each such unit is named as missed.

Exit 0 when every goal is met, 1 when one is not (each named), 2 when a figure is missing.
With ``--plain-only`` (a run of plain and plain-stock alone, ``speed-stock``) only plain
against stock is judged.

  .venv/bin/python bench/bench_dflash_speed.py RUN_DIR [--drafted dflash | --plain-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tooling.trained.serving import gpu_clock
from tooling.trained.serving.beside import crowded

#: Concurrency -> the least ratio to plain DFlash must reach (issue 45).
GOALS = {1: 2.5, 16: 1.0, 64: 1.0}
#: How much slower than stock 0.20.1 plain serving on the fixed wheel may be.
PLAIN_TOLERANCE = 0.02
#: The bar is the median of at least this many steady passes.
MIN_PASSES = 5


#: What a run measures its tokens/s on: batches timed to their last token, and (a run with
#: ``--sustained``) windows with the batch kept full, as a server under steady traffic.
MEASURES = {"speed": "batch passes", "sustained": "batch kept full"}
#: Where plain on the fixed wheel is held to stock's, the first the run has: the decode
#: steps of the windows with the batch kept full, then steady decode windows, in turns.
DECODE = ("decode", "decode steps, batch kept full")
STEADY = ("steady", "steady windows")
#: The speed run's unit each measure is taken in, at a level (``serving.speed_run``).
UNITS = {
    "speed": "pass at {}",
    "sustained": "sustained window at {}",
    DECODE[0]: "sustained window at {}",
    STEADY[0]: "steps at {}",
}


def rates(result: dict[str, Any], level: int, key: str = "speed") -> list[float]:
    passes = result.get(key, {}).get(str(level), [])
    return [p["tokens"] / p["seconds"] for p in passes if "seconds" in p]


def decode_rates(result: dict[str, Any], level: int) -> list[float]:
    """Each kept-full window's decode steps (those no prompt joined) as a rate: the inverse
    of their median step, ms."""
    windows = result.get("sustained", {}).get(str(level), [])
    steps = [w.get("joined_ms", {}).get("0", []) for w in windows]
    return [1.0 / statistics.median(s) for s in steps if s]


def median_ratio(
    ours: dict[str, Any], floor: dict[str, Any], level: int, key: str = "speed"
) -> tuple[float, int]:
    measured = decode_rates if key == DECODE[0] else lambda r, lv: rates(r, lv, key)
    pairs = list(zip(measured(ours, level), measured(floor, level), strict=False))
    return (statistics.median(a / b for a, b in pairs) if pairs else 0.0), len(pairs)


def judge(run: Path, drafted: str | None) -> tuple[list[str], list[str]]:
    """(lines of figures, goals missed): each goal on every measure the run has; with no
    ``drafted`` engine, plain against stock alone."""
    names = ("plain",) if drafted is None else ("plain", drafted)
    results = {n: json.loads((run / f"{n}.out.json").read_text()) for n in names}
    stock_file = run / "plain-stock.out.json"
    stock = json.loads(stock_file.read_text()) if stock_file.is_file() else None
    lines: list[str] = []
    # A unit measured beside other work on the host measured that work too: no bar is
    # judged on such a run (serving.beside).
    missed = [
        f"not measured alone: {line}"
        for result in (*results.values(), *([stock] if stock else []))
        for line in crowded(result)
    ]
    if drafted is not None:
        _judge_drafted(results, drafted, lines, missed)
    _judge_plain(results["plain"], stock, lines, missed)
    return lines, missed


def _judge_drafted(
    results: dict[str, Any], drafted: str, lines: list[str], missed: list[str]
) -> None:
    """DFlash against plain, each goal on every measure the run has."""
    for key, measure in MEASURES.items():
        if key != "speed" and not results[drafted].get(key):
            continue
        for level, goal in GOALS.items():
            ratio, passes = median_ratio(results[drafted], results["plain"], level, key)
            lines.append(
                f"{drafted} at {level}, {measure}: {ratio:.2f}x plain over {passes} (goal {goal})"
            )
            if passes < MIN_PASSES:
                missed.append(
                    f"{drafted} at {level}, {measure}: {passes} passes, fewer than {MIN_PASSES}"
                )
            elif ratio < goal:
                missed.append(f"{drafted} at {level}, {measure}: {ratio:.2f}x < {goal}")


def _judge_plain(
    plain_result: dict[str, Any], stock: dict[str, Any] | None, lines: list[str], missed: list[str]
) -> None:
    """Plain on the fixed wheel against plain on stock: at most ``PLAIN_TOLERANCE`` slower,
    on the first of ``DECODE`` and ``STEADY`` the run has (else on every measure); the
    others shown."""
    if stock is None:
        missed.append("no plain-stock engine in the run: plain against stock not judged")
        return
    measured = [(k, m) for k, m in MEASURES.items() if plain_result.get(k)]
    precise = [
        m
        for m in (DECODE, STEADY)
        if any(median_ratio(plain_result, stock, lv, m[0])[1] for lv in GOALS)
    ]
    held = precise[:1] or measured
    for key, measure in [*held, *(m for m in precise + measured if m not in held)]:
        for level in GOALS:
            plain, n = median_ratio(plain_result, stock, level, key)
            judged = (key, measure) in held
            shown = f"plain at {level}, {measure}: {plain:.3f}x stock over {n}"
            lines.append(shown if judged else f"{shown} (shown, not judged)")
            if not judged:
                continue
            lines += clock_lines(plain_result, stock, UNITS[key].format(level))
            if n < MIN_PASSES:
                missed.append(f"plain at {level}, {measure}: {n} windows, fewer than {MIN_PASSES}")
            elif plain < 1.0 - PLAIN_TOLERANCE:
                missed.append(
                    f"plain at {level}, {measure}: {plain:.3f}x stock, slower by more than 2%"
                )


def _clock_mhz(result: dict[str, Any], unit: str) -> float | None:
    means = [u["sm_mhz_mean"] for u in gpu_clock.clocked(result, unit)]
    return statistics.median(means) if means else None


def clock_lines(ours: dict[str, Any], floor: dict[str, Any], unit: str) -> list[str]:
    """The GPU's SM clock in the two engines' units the measure is taken in, where the run
    read it (``serving.gpu_clock``): shown beside the verdict, since the same kernels run
    slower at a lower clock whatever the code; it decides nothing."""
    a, b = _clock_mhz(ours, unit), _clock_mhz(floor, unit)
    if a is None or b is None:
        return []
    return [f"  GPU clock in '{unit}': {a:.0f} against {b:.0f} MHz ({(a / b - 1) * 100:+.1f}%)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a speed run's folder (NAME.out.json each)")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--drafted", default="dflash", help="the DFlash engine's name")
    chosen.add_argument("--plain-only", action="store_true", help="judge plain against stock alone")
    args = parser.parse_args()
    try:
        lines, missed = judge(args.run, None if args.plain_only else args.drafted)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {args.run}: no figures to judge ({e})", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for line in missed:
        print(f"missed: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
