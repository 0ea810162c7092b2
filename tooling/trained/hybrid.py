"""The trained hybrid pair on vLLM engines: what each engine runs, and the verdicts.

The pair is the recipe's (``tooling train --arch hybrid``): a decisive target, so a strict
lossless check holds. ``plan`` writes one request per engine
(``tooling.trained.serving.trained_run`` runs it); ``judge`` reads the results back:

- **strict lossless**: each checked prompt's greedy completion with the drafter equals the
  plain engine's; a first difference is excused only where the plain run's top-2 margin is
  at most ``TIE_MARGIN`` (a near-tie any change of batch shape may flip), and each excuse is
  listed; the completion is not compared past it;
- **lossless under load**: the greedy outputs of the acceptance pass with 16 requests at
  once against the plain engine's, within the plain engine's own noise between one at a
  time and at once;
- **acceptance**: vLLM's counters, one request at a time and 16 at once, beside the
  reference package's figure at the same K, and judged on the prompts whose greedy outputs
  the engine shares with the reference;
- **speed**: decode tokens/s with and without the drafter, as the ratio to the plain engine
  of the same run, the first traffic of each shape apart.

Standard library only. ``tooling smoke --trained-hybrid`` runs it (``trained/measure.py``; on
a host whose commands are bounded in time, one call at a time: ``ci/gpu/trained-hybrid.sh``);
``python -m tooling.trained.hybrid plan|report`` writes the requests or reads a run back.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..entry import answer, entry_logging
from ..smoke.distribution import at_most
from .hybrid_plan import (
    BF16_STEP,
    FULL_DRAFTER_FIX,
    LOAD_CONCURRENCY,
    LOAD_NOISE_LIMIT,
    PLAIN,
    PLAIN_PREFIX,
    PLAIN_SPEED,
    REFERENCE_TOLERANCE,
    SPEC,
    TIE_MARGIN,
    Variant,
    load_results,
    plan,
)
from .hybrid_verdicts import (
    LosslessVerdict,
    PromptVerdict,
    acceptance_rows,
    cache_misses,
    compare_completion,
    lossless,
    speed_rows,
    top2_margin,
)

logger = logging.getLogger(__name__)

# -- the report --------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


Section = tuple[list[str], list[str]]
"""A report section: its lines, and the problems it found (none: it proves its part)."""


def _per_position(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values) or "-"


@dataclass
class SharedOutputs:
    """Acceptance on the prompts whose greedy output an engine shares with the reference: there
    both drafted from the same contexts, so a correct integration drafts and accepts alike
    (elsewhere a near-tie sent the two down other continuations, with other acceptance)."""

    prompts: int
    shared: int
    engine_length: float | None
    reference_length: float | None

    @property
    def ratio(self) -> float | None:
        if self.engine_length is None or not self.reference_length:
            return None
        return self.engine_length / self.reference_length


def shared_outputs(reference_runs: list[dict[str, Any]], one: dict[str, Any]) -> SharedOutputs:
    """``one``: an engine's acceptance pass one request at a time (outputs, per-prompt counters)."""
    outputs, counters = one.get("outputs", []), one.get("per_prompt", [])
    drafts = accepted = ref_drafts = ref_accepted = shared = 0
    for output, counted, ref in zip(outputs, counters, reference_runs, strict=False):
        if output != ref["output_ids"]:
            continue
        shared += 1
        drafts += int(counted.get(f"{SPEC}num_drafts", 0))
        accepted += int(counted.get(f"{SPEC}num_accepted_tokens", 0))
        steps = [
            a for d, a in zip(ref["drafted_per_step"], ref["accepted_per_step"], strict=True) if d
        ]
        ref_drafts += len(steps)
        ref_accepted += sum(steps)
    return SharedOutputs(
        prompts=len(reference_runs),
        shared=shared,
        engine_length=1 + accepted / drafts if drafts else None,
        reference_length=1 + ref_accepted / ref_drafts if ref_drafts else None,
    )


def acceptance_section(
    k: int,
    reference: dict[str, Any],
    reference_runs: list[dict[str, Any]],
    chosen: list[Variant],
    results: dict[str, dict[str, Any]],
) -> Section:
    """The acceptance table at one K. The fixed wheel must be within REFERENCE_TOLERANCE of the
    reference on the prompts whose outputs the two share, at least half of them."""
    ref_len = reference.get("mean_acceptance_length")
    lines = [
        "",
        f"## Acceptance, K = {k} (reference: the dflash package, HF, one prompt at a time)",
        "| engine | one at a time | 16 at once (most running) | vs reference "
        "| on outputs shared with the reference: engine / reference (prompts) "
        "| per position (one at a time) | greedy = plain (1 / 16) |",
        "|---|---|---|---|---|---|---|",
        f"| reference | {_fmt(ref_len)} | - | 1.000 | - | "
        f"{_per_position(reference.get('acceptance_per_position', []))} | - |",
    ]
    problems: list[str] = []
    plain = results.get(PLAIN)
    shown = [v for v in chosen if v.k == k and not (v.prefix_caching or v.speed or v.full_drafter)]
    for v in shown:
        r = results[v.name]
        if not r.get("ok"):
            lines.append(f"| {v.name} | error: {r.get('error')} | | | | | |")
            if v.site == "patched":
                problems.append(f"{v.name}: {r.get('error')}")
            continue
        rows = {row.concurrency: row for row in acceptance_rows(v.name, r, plain)}
        one, many = rows.get(1), rows.get(16)
        one_len = one.acceptance_length if one else None
        ratio = one_len / ref_len if one_len and ref_len else None
        same = shared_outputs(reference_runs, r.get("acceptance", {}).get("1", {}))
        lines.append(
            f"| {v.name} | {_fmt(one_len)} | "
            f"{_fmt(many.acceptance_length if many else None)} "
            f"({many.most_running if many else '-'}) | {_fmt(ratio)} | "
            f"{_fmt(same.engine_length)} / {_fmt(same.reference_length)} "
            f"({same.shared} of {same.prompts}) | "
            f"{_per_position(one.per_position if one else [])} | "
            f"{one.equal_plain if one else '-'}/{one.prompts if one else '-'} / "
            f"{many.equal_plain if many else '-'}/{many.prompts if many else '-'} |"
        )
        for row in rows.values():
            if row.most_running < row.concurrency:
                problems.append(
                    f"{v.name}: at most {row.most_running} of {row.concurrency} requests ran at "
                    "once (the engine's tokens per step or KV cache held them back)"
                )
        if v.site != "patched":
            continue
        if not r.get("acceptance", {}).get("1", {}).get("per_prompt"):
            problems.append(f"{v.name}: no counters per prompt served alone")
        elif 2 * same.shared < same.prompts or same.ratio is None:
            problems.append(
                f"{v.name}: {same.shared} of {same.prompts} outputs equal the reference's, "
                "too few to set its acceptance beside the reference's"
            )
        elif round(abs(same.ratio - 1), 9) > REFERENCE_TOLERANCE:
            problems.append(
                f"{v.name}: acceptance length {_fmt(same.engine_length)} is not within "
                f"{REFERENCE_TOLERANCE:.0%} of the reference's {_fmt(same.reference_length)} "
                f"on the {same.shared} prompts whose outputs they share"
            )
    return lines, problems


def _where(prompts: list[PromptVerdict]) -> str:
    return "; ".join(
        f"{p.prompt} @ {p.first_difference}: {_fmt(p.plain_margin, 4)}" for p in prompts
    )


def _verdict_row(verdict: LosslessVerdict) -> str:
    if verdict.error:
        return f"| {verdict.engine} | error: {verdict.error} | | | |"
    return (
        f"| {verdict.engine} | {'pass' if verdict.ok else 'FAIL'} | {len(verdict.prompts)} | "
        f"{_where(verdict.failures) or '-'} | {_where(verdict.ties) or '-'} |"
    )


def lossless_section(chosen: list[Variant], results: dict[str, dict[str, Any]]) -> Section:
    """The strict check of every drafted engine: the fixed wheel passes, stock fails on K+1."""
    missing = {"ok": False, "error": "no result"}
    plain = results.get(PLAIN, missing)
    lines = [
        "",
        "## Strict lossless (greedy, each prompt alone; a difference is excused only where the "
        f"plain run's top-2 margin <= 2^-7 = {TIE_MARGIN:.4f})",
        "| engine | verdict | prompts | failures (prompt @ position: plain margin) "
        "| excused ties |",
        "|---|---|---|---|---|",
    ]
    problems: list[str] = []
    notes: list[str] = []

    for v in [v for v in chosen if v.drafted and not v.speed]:
        base = results.get(PLAIN_PREFIX, missing) if v.prefix_caching else plain
        verdict = lossless(v.name, base, results[v.name])
        lines.append(_verdict_row(verdict))
        if v.site == "patched" and not verdict.ok:
            problems.append(f"{v.name}: strict lossless check not passed")
        rounding = [p for p in verdict.failures if at_most(p.plain_margin, BF16_STEP)]
        if rounding:
            notes.append(
                f"{v.name}: {_where(rounding)}: the plain margin is at most one bf16 step of a "
                "logit between 4 and 8, which rounding in another batch shape can flip"
            )
        if v.prefix_caching and verdict.error is None:
            problems += cache_misses(v.name, results[v.name]) + cache_misses(PLAIN_PREFIX, base)
        if v.site != "stock" or verdict.error is not None:
            continue
        if verdict.ok:
            problems.append(f"{v.name}: stock passed the strict lossless check (it must fail)")
        elif not any(p.prompt.endswith(f"len{v.k + 1}") for p in verdict.failures):
            problems.append(f"{v.name}: stock did not fail on its K+1 prompt")
    if notes:
        lines += ["", "Failures within rounding (they still fail the check):", *notes]
    return lines, problems


def plain_noise(plain: dict[str, Any]) -> float | None:
    """How far the plain engine's own outputs one at a time and ``LOAD_CONCURRENCY`` at once
    move apart: at each prompt where they part, the two tokens' top-2 margins added (the
    change of their logit gap between the two batch shapes); the largest, or 0.0 where they
    never part. None: no logprobs to tell."""
    runs = plain.get("acceptance", {})
    one = runs.get("1", {}).get("completions")
    many = runs.get(str(LOAD_CONCURRENCY), {}).get("completions")
    if not one or not many:
        return None
    noise = 0.0
    for a, b in zip(one, many, strict=False):
        at = compare_completion("", a, b).first_difference
        if at is None or at >= min(len(a["logprobs"]), len(b["logprobs"])):
            continue
        noise = max(noise, top2_margin(a["logprobs"][at]) + top2_margin(b["logprobs"][at]))
    return noise


def load_section(chosen: list[Variant], results: dict[str, dict[str, Any]]) -> Section:
    """Lossless under load: each drafted engine's greedy outputs with ``LOAD_CONCURRENCY``
    requests at once against the plain engine's at once. Serving each prompt alone (the
    strict check) cannot see a fault that only batching brings. A difference is excused where
    the plain margin is within the plain engine's own noise between its two batch shapes (at
    least one bf16 step), or where the output is the plain engine's own one at a time."""
    plain = results.get(PLAIN, {"ok": False})
    noise = plain_noise(plain) if plain.get("ok") else None
    level = str(LOAD_CONCURRENCY)
    title = f"## Lossless under load ({LOAD_CONCURRENCY} at once, greedy, against the plain engine"
    if noise is None:
        problem = "lossless under load: no plain outputs with logprobs to compare with"
        return ["", f"{title})", problem], [problem]
    if not at_most(noise, LOAD_NOISE_LIMIT):
        problem = (
            f"lossless under load: the plain engine's own outputs one at a time and at once "
            f"part at a margin of {noise:.4f}, over {LOAD_NOISE_LIMIT:.4f}: no verdict"
        )
        return ["", f"{title})", problem], [problem]
    tolerance = max(BF16_STEP, noise)
    lines = [
        "",
        f"{title} at once; the plain engine's own noise between one at a time and at once "
        f"{noise:.4f}, so a difference is excused where the plain margin <= {tolerance:.4f})",
        "| engine | verdict | prompts | failures (prompt @ position: plain margin) "
        "| excused ties |",
        "|---|---|---|---|---|",
    ]
    problems: list[str] = []
    many = plain["acceptance"][level]["completions"]
    one = plain["acceptance"]["1"]["completions"]
    for v in [v for v in chosen if v.drafted and not v.speed and not v.prefix_caching]:
        r = results[v.name]
        runs = r.get("acceptance", {}).get(level, {}).get("completions")
        if not r.get("ok") or not runs:
            verdict = LosslessVerdict(v.name, error=str(r.get("error") or "no outputs"))
        else:
            verdict = LosslessVerdict(
                v.name,
                [
                    compare_completion(f"prompt {i}", at_once, drafted, tolerance)
                    if drafted["tokens"] != alone["tokens"]
                    else compare_completion(f"prompt {i}", alone, drafted)
                    for i, (at_once, alone, drafted) in enumerate(
                        zip(many, one, runs, strict=False)
                    )
                ],
            )
        lines.append(_verdict_row(verdict))
        if v.site == "patched" and not verdict.ok:
            problems.append(f"{v.name}: not lossless with {LOAD_CONCURRENCY} requests at once")
        if v.full_drafter and v.site != "patched" and verdict.error is None and verdict.ok:
            problems.append(
                f"{v.name}: lossless with {LOAD_CONCURRENCY} requests at once without "
                f"{FULL_DRAFTER_FIX}, so the check does not show the fault that fix removes"
            )
    return lines, problems


def speed_section(chosen: list[Variant], results: dict[str, dict[str, Any]]) -> Section:
    """Decode speed with and without the drafter, as ratios to the plain engine of the run."""
    plain = results.get(PLAIN_SPEED, {"ok": False})
    lines: list[str] = []
    problems: list[str] = []
    for v in [v for v in chosen if v.speed and v.drafted]:
        drafted = results[v.name]
        rows = speed_rows(plain, drafted) if plain.get("ok") and drafted.get("ok") else []
        lines += [
            "",
            f"## Decode speed, K = {v.k}, against the plain engine of the same run "
            "(the median steady pass; first traffic apart)",
            "| concurrent | plain tok/s | DFlash tok/s | ratio | first pass plain / DFlash (s) "
            "| steady pass plain / DFlash (s) | most running plain / DFlash |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row.concurrency} | {row.plain_tps:.0f} | {row.drafted_tps:.0f} | "
            f"{row.ratio:.2f} | {row.plain_first_s:.2f} / {row.drafted_first_s:.2f} | "
            f"{row.plain_steady_s:.2f} / {row.drafted_steady_s:.2f} | "
            f"{row.plain_most_running} / {row.drafted_most_running} |"
            for row in rows
        ]
        if not rows:
            problems.append(f"{v.name}: no speed figures")
        problems += [
            f"speed at {row.concurrency} concurrent: at most {who} {ran} ran at once, so the "
            "row is not a figure at that concurrency"
            for row in rows
            for who, ran in (("plain", row.plain_most_running), (v.name, row.drafted_most_running))
            if ran < row.concurrency
        ]
    return lines, problems


def report(pair: Path, work: Path, through_call: int | None = None) -> tuple[str, bool]:
    """The tables and whether the run proves what it must: the fixed wheel lossless (the
    prefix prompts found in the cache where it is on) and within ``REFERENCE_TOLERANCE`` of
    the reference at each K, stock failing the lossless check, and every figure measured at
    the concurrency it names."""
    summary = json.loads((pair / "summary.json").read_text())
    reference = summary["reference"]["by_speculative_tokens"]
    reference_runs = json.loads((pair / "reference.json").read_text()).get(
        "by_speculative_tokens", {}
    )
    chosen, results = load_results(work, through_call)
    logger.debug("report of %d variants' results in %s", len(chosen), work)
    lines: list[str] = []
    for v in chosen:
        r = results[v.name]
        lines.append(
            f"{v.name}: started in {r['startup_s']:.0f}s, {r.get('cudagraph_mode')}, "
            f"{r.get('max_num_scheduled_tokens', '-')} tokens per step, "
            f"attention block {r.get('block_size', '-')}, prefix caching "
            f"{r.get('mamba_cache_mode', '-') if r.get('enable_prefix_caching') else 'off'}"
            if r.get("ok")
            else f"{v.name}: error: {r.get('error')}"
        )
    sections = [
        acceptance_section(
            k, reference.get(str(k), {}), reference_runs.get(str(k), []), chosen, results
        )
        for k in sorted({v.k for v in chosen if v.drafted}, reverse=True)
    ]
    sections += [
        lossless_section(chosen, results),
        load_section(chosen, results),
        speed_section(chosen, results),
    ]
    problems = [p for _, found in sections for p in found]
    for section_lines, _ in sections:
        lines += section_lines
    lines += ["", "verdict: " + ("pass" if not problems else "FAIL"), *problems]
    return "\n".join(lines) + "\n", not problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.trained.hybrid")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "report"):
        p = sub.add_parser(name)
        p.add_argument("pair", type=Path)
        p.add_argument("work", type=Path)
        if name == "report":
            p.add_argument("--through-call", type=int)
    args = parser.parse_args(argv)
    if args.command == "plan":
        with entry_logging():
            planned = plan(args.pair, args.work)
        # One line per variant, as the GPU host's script reads them.
        answer("\n".join(f"{v.name} {v.site} {v.call}" for v in planned))
        return 0
    text, ok = report(args.pair, args.work, args.through_call)
    answer(text.removesuffix("\n"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
