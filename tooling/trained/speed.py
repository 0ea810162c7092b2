"""DFlash's decode speed against plain vLLM on the trained pair, and where each step's time
goes (issue 45): ``plan`` writes one request per engine, ``run`` serves them all at once on one
GPU (each measures alone, in turns: ``serving.speed_run``), ``report`` writes the tables.

The engines: plain vLLM on stock 0.20.1 and on the fixed wheel (the series touches code plain
serving runs), and DFlash at the pair's largest K on the fixed wheel, as shipped and with each
candidate setting of ``CANDIDATES``. Every ratio is to the fixed wheel's plain engine of the
same run, pass by pass.

``python -m tooling.trained.speed run PAIR WORK --engines-root DIR`` on the GPU host
(``tooling host speed``); ``report WORK`` anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..entry import answer, entry_logging
from ..errors import SmokeError
from .gpu_fit import fitted, gpu_memory_gib
from .hybrid_plan import GIB
from .measure import serve_engines
from .speed_engines import DRAFTED, ENGINES, PLAIN, STOCK, SpeedEngine
from .speed_tables import (
    allocator_table,
    beside_lines,
    clock_lines,
    compile_table,
    dispatch_table,
    first_token_table,
    fmt,
    profile_table,
    slowest_forward_lines,
    step_table,
)

logger = logging.getLogger(__name__)

LEVELS = (1, 4, 16, 32, 64)
PROFILE_LEVELS = (1, 16, 64)
PASSES = 5
NEW_TOKENS = 128
WINDOW_STEPS = 40
PROFILE_STEPS = 10
MODULE = "tooling.trained.serving.speed_run"
#: A pair with random weights (``tooling.smoke.serving.tiny``) is served this long a context,
#: with this many prompts of PROMPT_LEN tokens drawn from its vocabulary.
TINY_MAX_MODEL_LEN = 2048
#: A pair with random weights has no trained K: it drafts the seed's.
RANDOM_PAIR_K = 15
TINY_PROMPTS = 16
PROMPT_LEN = 128


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...] = LEVELS
    passes: int = PASSES
    max_new_tokens: int = NEW_TOKENS
    window_steps: int = WINDOW_STEPS
    profile_levels: tuple[int, ...] = PROFILE_LEVELS
    profile_steps: int = PROFILE_STEPS
    k: int | None = None
    """None: the trained pair's largest K (prompts.json), or RANDOM_PAIR_K."""
    one_at_a_time: bool = False
    """Each engine served alone, in turn (a pair too large for two engines on one GPU)."""
    interleave: bool = False
    """The engines measure in turns, unit by unit (a pass, a window), not one engine's units
    all at once: a drift of the machine then lands on every engine alike."""
    sustained: bool = False
    """Also tokens/s with the batch kept full (``serving.sustained``)."""
    staggered: bool = False
    """The windows' requests of staggered lengths (``serving.sustained``)."""
    drafted_kv_gib: int | None = None
    """Each drafting engine's KV cache, GiB, in place of its own: a run whose levels need
    less than the engines' own sizes (64 requests at the seed's K), so that they fit one GPU
    together and measure interleaved."""


def sized(engine: SpeedEngine, settings: Settings) -> SpeedEngine:
    """``engine`` with the KV cache ``settings`` gives a drafting engine."""
    if engine.drafted and settings.drafted_kv_gib is not None:
        return dataclasses.replace(engine, kv_cache_gib=settings.drafted_kv_gib)
    return engine


@dataclass(frozen=True)
class Pair:
    target: Path
    drafter: Path
    prompts: list[list[int]]
    max_model_len: int
    max_num_seqs: int
    ks: tuple[int, ...]


#: What makes a folder a pair the run can serve: a trained pair's prompts, or a drawn pair's
#: manifest.
PAIR_FILES = ("prompts.json", "tiny.json")


def pair_problem(pair: Path) -> str | None:
    """Why ``pair`` is no pair a speed run can serve, or None."""
    if any((pair / name).is_file() for name in PAIR_FILES):
        return None
    return f"{pair} holds no pair: neither {' nor '.join(PAIR_FILES)}"


def read_pair(pair: Path) -> Pair:
    """The trained pair (its prompts.json), or a pair with random weights (tiny.json), whose
    prompts are drawn from its vocabulary."""
    if (pair / "prompts.json").is_file():
        prompts = json.loads((pair / "prompts.json").read_text())
        return Pair(
            pair / "target",
            pair / "drafter",
            [p["token_ids"] for p in prompts["prompts"]],
            prompts["engine"]["max_model_len"],
            prompts["engine"]["max_num_seqs"],
            tuple(prompts["speculative_tokens"]),
        )
    manifest = json.loads((pair / "tiny.json").read_text())
    vocab = int(manifest["spec"]["vocab_size"])
    draw = random.Random(int(manifest["spec"]["seed"]))
    # Below the mask token and clear of the first ids (EOS and padding).
    drawn = [[draw.randrange(8, vocab - 8) for _ in range(PROMPT_LEN)] for _ in range(TINY_PROMPTS)]
    return Pair(
        Path(manifest["target"]), Path(manifest["drafter"]), drawn, TINY_MAX_MODEL_LEN, 64, ()
    )


#: What one run writes in its folder, an engine's files and the list of engines.
RUN_FILES = ("*.in.json", "*.out.json", "*.partial.json", "engines.json")


def _set_aside_remeasured(work: Path, names: list[str]) -> None:
    """Move an earlier run's figures into ``work/earlier-N`` when this run measures one of
    its engines again: a report takes every ratio against the plain engine of the same run,
    and an engine re-measured here would pair the earlier run's figures with this one's.
    A run of new engines only adds to the folder."""
    if not any(
        (work / f"{n}.out.json").is_file() or (work / f"{n}.partial.json").is_file() for n in names
    ):
        return
    number = 1
    while (work / f"earlier-{number}").exists():
        number += 1
    aside = work / f"earlier-{number}"
    aside.mkdir()
    for pattern in RUN_FILES:
        for found in sorted(work.glob(pattern)):
            found.rename(aside / found.name)
    logger.info("the earlier run's figures, re-measured here, set aside in %s", aside)


def plan(pair_dir: Path, work: Path, names: list[str], settings: Settings) -> list[SpeedEngine]:
    """``work/NAME.in.json`` for each engine of ``names`` (``ENGINES``); ``work/engines.json``
    lists every engine planned in ``work`` so far, these last."""
    pair = read_pair(pair_dir)
    k = settings.k if settings.k is not None else max(pair.ks, default=RANDOM_PAIR_K)
    chosen = [sized(ENGINES[n], settings) for n in names]
    work.mkdir(parents=True, exist_ok=True)
    _set_aside_remeasured(work, names)
    barrier, turns = work / "barrier", work / "turns"
    for folder in (barrier, turns):
        shutil.rmtree(folder, ignore_errors=True)
    for index, e in enumerate(chosen):
        k_e = e.k if e.k is not None else k
        request = {
            "name": e.name,
            "engine": {
                "target": str(pair.target),
                "drafter": str(pair.drafter) if e.drafted else None,
                "num_speculative_tokens": k_e if e.drafted else 0,
                "vocab_size": 0,
                "max_model_len": pair.max_model_len,
                "max_num_seqs": max(pair.max_num_seqs, max(settings.levels)),
                "kv_cache_memory_bytes": e.kv_cache_gib * GIB,
                "engine_args": {"disable_log_stats": False, **e.engine_args},
                "speculative_args": e.speculative_args,
            },
            "prompts": pair.prompts,
            "levels": list(settings.levels),
            "passes": settings.passes,
            "max_new_tokens": settings.max_new_tokens,
            "window_steps": settings.window_steps,
            "profile_levels": [lv for lv in settings.profile_levels if lv in settings.levels],
            "profile_steps": settings.profile_steps,
            "lock": str(work / "speed.lock"),
            "barrier": str(barrier),
            "barrier_count": 1 if settings.one_at_a_time else len(chosen),
            "constant_logits": e.constant_logits,
            "partial": str(work / f"{e.name}.partial.json"),
            "sustained": settings.sustained,
            "staggered": settings.staggered,
            "turns": (
                {"folder": str(turns), "index": index, "count": len(chosen)}
                if settings.interleave
                else None
            ),
        }
        (work / f"{e.name}.in.json").write_text(json.dumps(request))
    listed = work / "engines.json"
    earlier = json.loads(listed.read_text()) if listed.is_file() else []
    kept = [e for e in earlier if e["name"] not in names]
    listed.write_text(json.dumps([*kept, *(asdict(e) for e in chosen)], indent=1))
    return chosen


def load(work: Path) -> tuple[list[SpeedEngine], dict[str, dict[str, Any]]]:
    chosen = [SpeedEngine(**e) for e in json.loads((work / "engines.json").read_text())]
    results = {}
    for e in chosen:
        out, partial = work / f"{e.name}.out.json", work / f"{e.name}.partial.json"
        found = out if out.is_file() else partial
        results[e.name] = json.loads(found.read_text()) if found.is_file() else {"ok": False}
        if found is partial and partial.is_file():
            results[e.name]["error"] = "cut short: the figures of the levels it finished"
        if found is out and not results[e.name].get("ok") and partial.is_file():
            # Failed after some levels: keep their figures beside the error.
            results[e.name] = {**json.loads(partial.read_text()), **results[e.name]}
    return chosen, results


def _rates(result: dict[str, Any], level: str, key: str = "speed") -> list[float]:
    """Tokens/s of each pass (``speed``) or each window (``sustained``) at ``level``."""
    return [
        p["tokens"] / p["seconds"] for p in result.get(key, {}).get(level, []) if "seconds" in p
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratios(
    result: dict[str, Any], base: dict[str, Any], level: str, key: str = "speed"
) -> list[float]:
    pairs = zip(_rates(result, level, key), _rates(base, level, key), strict=False)
    return [a / b for a, b in pairs]


def speed_table(
    chosen: list[SpeedEngine], results: dict[str, dict[str, Any]], key: str = "speed"
) -> list[str]:
    """Decode tokens/s per level: the median pass (or window: ``key``), and the median of
    per-pass ratios to plain: the fixed wheel's, or stock's where that gave none (failed)."""
    to = STOCK if results.get(STOCK, {}).get(key) and not results.get(PLAIN, {}).get(key) else PLAIN
    base = results.get(to, {})
    levels = sorted({int(lv) for r in results.values() for lv in r.get(key, {})})
    head = "| concurrent | " + " | ".join(f"{e.name} tok/s (x {to})" for e in chosen) + " |"
    lines = [head, "|---" * (len(chosen) + 1) + "|"]
    for level in levels:
        cells = []
        for e in chosen:
            r = results.get(e.name, {})
            passes = r.get(key, {}).get(str(level), [])
            rate = _median(_rates(r, str(level), key))
            ratio = _median(_ratios(r, base, str(level), key))
            lengths = [p["acceptance_length"] for p in passes if p.get("acceptance_length")]
            al = f", AL {statistics.fmean(lengths):.2f}" if lengths else ""
            most = min((p.get("most_running", level) for p in passes), default=0)
            cut = [p["error"] for p in passes if "error" in p]
            short = f", **{most} ran**" if r.get(key) and most < level else ""
            short += f", **{cut[0]}**" if cut else ""
            cells.append(f"{fmt(rate)} ({fmt(ratio, '.2f')}{al}{short})")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


def _window(result: dict[str, Any], level: int, constant: bool = False) -> float | None:
    steps = (result.get("constant_logits", {}) if constant else result).get("steps", {})
    return steps.get(str(level), {}).get("step_ms_median")


def projection(
    plain: dict[str, Any], drafted: dict[str, Any], k: int, lengths: range = range(2, 9)
) -> list[str]:
    """Projected decode speedup at each acceptance length: ``a * plain step / DFlash step``,
    the DFlash step read between its figure with every draft rejected (acceptance length 1)
    and with every draft accepted (K + 1), in proportion."""
    levels = sorted(int(lv) for lv in drafted.get("steps", {}))
    lines = [
        "| acceptance length | " + " | ".join(f"{lv} concurrent" for lv in levels) + " |",
        "|---" * (len(levels) + 1) + "|",
        "| plain step, ms | " + " | ".join(fmt(_window(plain, lv), ".2f") for lv in levels) + " |",
        "| DFlash step, AL 1, ms | "
        + " | ".join(fmt(_window(drafted, lv), ".2f") for lv in levels)
        + " |",
        f"| DFlash step, AL {k + 1}, ms | "
        + " | ".join(fmt(_window(drafted, lv, constant=True), ".2f") for lv in levels)
        + " |",
    ]
    for a in lengths:
        cells = []
        for lv in levels:
            base, low, high = _window(plain, lv), _window(drafted, lv), _window(drafted, lv, True)
            if None in (base, low, high) or k < 1:
                cells.append("-")
                continue
            step = low + (high - low) * (a - 1) / k  # type: ignore[operator]
            cells.append(f"{a * base / step:.2f}x")  # type: ignore[operator]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return lines


def report(work: Path) -> tuple[str, bool]:
    """The run's tables, and whether every engine returned its figures."""
    chosen, results = load(work)
    failed = [e.name for e in chosen if not results[e.name].get("ok")]
    lines = ["# DFlash against plain vLLM", ""]
    for e in chosen:
        r = results[e.name]
        lines.append(
            f"- `{e.name}` ({e.site}, K = {r.get('num_speculative_tokens', '?')}, "
            f"{({**e.engine_args, **e.speculative_args}) or 'defaults'}): "
            f"{r.get('cudagraph_mode')}, capture up to {r.get('max_cudagraph_capture_size')}, "
            f"async scheduling {r.get('async_scheduling')}, "
            f"started in {fmt(r.get('startup_s'), '.0f')} s; compiled or tuned again in steady "
            f"traffic: {r.get('steady_changes') or 'nothing'}"
            + (f"; **{r.get('error', 'no result')}**" if e.name in failed else "")
        )
    names = [e.name for e in chosen]
    lines += ["", "## Other work on the host while each unit measured", ""]
    lines += beside_lines(names, results)
    clocks = clock_lines(names, results)
    if clocks:
        lines += ["", "## The GPU's SM clock while each unit measured", "", *clocks]
    lines += ["", "## Decode tokens/s", "", *speed_table(chosen, results)]
    if any(r.get("sustained") for r in results.values()):
        asked = [work / f"{n}.in.json" for n in names]
        staggered = any(json.loads(p.read_text()).get("staggered") for p in asked if p.is_file())
        kind = ", requests of staggered lengths" if staggered else ""
        lines += ["", f"## Decode tokens/s, batch kept full{kind}", ""]
        lines += speed_table(chosen, results, "sustained")
        lines += ["", "Their steps, by the mode of the target's CUDA graph:", ""]
        lines += dispatch_table(names, results)
        lines += ["", "The same steps, by how many prompts joined them:", ""]
        lines += dispatch_table(names, results, "joined_ms")
        lines += ["", "The same steps, by what stalled them (a Triton compile, a collection):", ""]
        lines += dispatch_table(names, results, "stalled_ms")
        lines += ["", "The caching allocator during those windows:", ""]
        lines += allocator_table(names, results)
        lines += ["", "Time to a request's first token in those windows, ms (median / p90):", ""]
        lines += first_token_table(names, results)
    if any(r.get("warm") for r in results.values()):
        lines += ["", "## Triton kernels compiled, warm-up and measured", ""]
        lines += compile_table(names, results)
    if any(r.get("steady") for r in results.values()):
        lines += ["", "## Decode tokens/s, steady windows (every request decoding)", ""]
        lines += speed_table(chosen, results, "steady")
    lines += ["", "## Engine steps", "", *step_table(names, results)]
    lines += ["", "## Where a step's time goes", *profile_table(names, results)]
    lines += profile_table(names, results, "profile_sustained")
    lines += profile_table(names, results, "profile_joining")
    if not any(r.get("profile") or r.get("timed") for r in results.values()):
        # The run times its regions only at a level it profiles (--profile-levels).
        lines += ["", "No level was profiled, so no region was timed."]
    slowest = slowest_forward_lines(names, results)
    if slowest:
        lines += ["", "### The slowest forward with the batch kept full, event by event", ""]
        lines += slowest
    if any(r.get("timed") for r in results.values()):
        lines += ["", "## The same steps, no profiler: CPU by region and the host's waits", ""]
        lines += profile_table(names, results, "timed")
        lines += profile_table(names, results, "timed_sustained")
        lines += profile_table(names, results, "timed_joining")
    for e in chosen:
        constant = results[e.name].get("constant_logits")
        if not constant:
            continue
        # Its plain engine: the one of its name (seed-dflash: seed-plain), else any on its site.
        twin = e.name.replace(DRAFTED, PLAIN)
        plain = results.get(twin) or next(
            (results[o.name] for o in chosen if not o.drafted and o.site == e.site), {}
        )
        k = int(results[e.name].get("num_speculative_tokens") or 0)
        lines += [
            "",
            f"## Projected speedup, `{e.name}` "
            f"(LM heads zeroed: {constant.get('lm_heads_zeroed')})",
            "",
            *projection(plain, results[e.name], k),
        ]
    return "\n".join(lines) + "\n", not failed


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _gib(text: str) -> int:
    """A KV cache size, GiB: a whole number above 0."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of GiB above 0")
    return int(text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.trained.speed")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("pair", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("--engines-root", type=Path, required=True)
    p.add_argument("--engines", default=f"{PLAIN},{DRAFTED}", help="names of ENGINES")
    p.add_argument("--time-limit", type=float, default=900.0)
    p.add_argument("--levels", type=_ints, default=LEVELS)
    p.add_argument("--profile-levels", type=_ints, default=PROFILE_LEVELS)
    p.add_argument("--passes", type=int, default=PASSES)
    p.add_argument("--window-steps", type=int, default=WINDOW_STEPS)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--k", type=int)
    p.add_argument("--one-at-a-time", action="store_true", help="serve the engines in turn")
    p.add_argument("--interleave", action="store_true", help="measure in turns, pass by pass")
    p.add_argument("--sustained", action="store_true", help="also with the batch kept full")
    p.add_argument("--staggered", action="store_true", help="windows' requests of many lengths")
    p.add_argument("--drafted-kv-gib", type=_gib, help="each drafting engine's KV cache, GiB")
    r = sub.add_parser("report")
    r.add_argument("work", type=Path)
    args = parser.parse_args(argv)
    with entry_logging():
        if args.command == "run":
            problem = pair_problem(args.pair)
            if problem:
                logger.error("error: %s", problem)
                return SmokeError.exit_code
            if args.interleave and args.one_at_a_time:
                logger.error(
                    "error: --interleave needs the engines served together, not one at a time"
                )
                return SmokeError.exit_code
            names = [n for n in args.engines.split(",") if n]
            unknown = [n for n in names if n not in ENGINES]
            if unknown:
                logger.error("error: unknown engines %s (known: %s)", unknown, ", ".join(ENGINES))
                return SmokeError.exit_code
            root = args.engines_root
            engines = {d.name: d for d in root.iterdir() if d.is_dir()} if root.is_dir() else {}
            settings = Settings(
                levels=args.levels,
                passes=args.passes,
                window_steps=args.window_steps,
                max_new_tokens=args.new_tokens,
                profile_levels=args.profile_levels,
                k=args.k,
                one_at_a_time=args.one_at_a_time,
                interleave=args.interleave,
                sustained=args.sustained,
                staggered=args.staggered,
                drafted_kv_gib=args.drafted_kv_gib,
            )
            sizes = [sized(ENGINES[n], settings) for n in names]
            settings = fitted(settings, sizes, gpu_memory_gib())
            chosen = plan(args.pair, args.work, names, settings)
            missing = sorted({e.site for e in chosen} - set(engines))
            if missing:
                logger.error("error: %s lacks %s", root, ", ".join(missing))
                return SmokeError.exit_code
            turns = [[e] for e in chosen] if settings.one_at_a_time else [chosen]
            for turn in turns:
                sites = {e.name: e.site for e in turn}
                serve_engines(args.work, engines, sites, MODULE, args.time_limit)
    text, ok = report(args.work)
    answer(text.removesuffix("\n"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
