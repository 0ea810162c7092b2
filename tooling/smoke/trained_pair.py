"""The trained hybrid pair on vLLM engines: what each engine runs, and the verdicts.

The pair is the recipe's (``tooling train --arch hybrid``): a decisive target, so a strict
lossless check holds. ``plan`` writes one request per engine
(``tooling.smoke.serving.trained_run`` runs it); ``judge`` reads the results back:

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

Standard library only. ``tooling smoke --trained-hybrid`` runs it (``smoke/trained.py``; on
a host whose commands are bounded in time, one call at a time: ``ci/gpu/trained-hybrid.sh``);
``python -m tooling.smoke.trained_pair plan|report`` writes the requests or reads a run back.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .distribution import at_most

#: A plain run's top-2 logprob margin at or below which a differing greedy token is a tie.
TIE_MARGIN = 2.0**-7
#: One bf16 step of a logit between 4 and 8: a plain margin this small is a difference of
#: rounding, which the report names beside the strict verdict.
BF16_STEP = 2.0**-5
#: The fixed wheel's acceptance length may differ this much from the reference's, either way, on
#: the prompts whose outputs they share: both count vLLM's way (the last step drafts a whole
#: block), so more is a disagreement too.
REFERENCE_TOLERANCE = 0.02
ACCEPTANCE_CONCURRENCY = (1, 16)
#: The acceptance pass whose outputs the lossless check under load compares.
LOAD_CONCURRENCY = 16
#: A plain engine whose own outputs move further than this between one at a time and at once
#: excuses too much for the check under load to reach a verdict (batch shapes move a
#: decisive target's logits by a few bf16 steps).
LOAD_NOISE_LIMIT = 2.0**-2
SPEED_CONCURRENCY = (1, 16, 64)
SPEED_NEW_TOKENS = 128
GIB = 1 << 30
SPEC = "vllm:spec_decode_"
#: Patches whose ablations the acceptance table shows (the three that move acceptance).
#: KV cache per engine, GiB, sized from the engines' own "maximum concurrency" lines on the
#: recipe's pair (docs/notebook/2026-12-01-trained-hybrid.md); a call's engines share one GPU.
KV_GIB = 8
KV_GIB_SEED_K = 12  # 16 requests at the seed's K
KV_GIB_SPEED = 48  # 64 requests at the seed's K
KV_GIB_PLAIN = 12
ABLATED = ("dflash-layer-id-offset", "dflash-swa-config", "eagle-cache-drop")
#: The fix whose fault only a drafter without sliding layers shows (FA3 schedules ahead of
#: time only while every FlashAttention layer has one window): the fixed wheel and the wheel
#: without it serve the pair's drafter with every layer full attention, 16 requests at once.
FULL_DRAFTER_FIX = "fa3-schedule-per-group"
FULL_DRAFTER = "drafter-full-attention"
PLAIN = "plain"
PLAIN_PREFIX = "plain-prefix"
PLAIN_SPEED = "plain-speed"
#: The recipe's prompts that share a prefix (``trainer/checked.py``).
PREFIX_PROMPTS = "prefix-"
#: The one of them that fills the cache.
FIRST_PREFIX_PROMPT = "prefix-a"
#: The vLLM installs the variants run on: the fixed wheel, stock, and one ablation each.
SITES = ("patched", "stock", *(f"no-{p}" for p in (*ABLATED, FULL_DRAFTER_FIX)))


@dataclass(frozen=True)
class Variant:
    """One engine of a run: an install (``site`` under the engines folder) and its K."""

    name: str
    site: str
    k: int
    call: int
    speed: bool = False
    """This engine measures decode speed and nothing else, at vLLM's default tokens per step.
    The other engines schedule the recipe's budget, so that their prompts chunk alike; at
    the seed's K, 64 decoding requests fill 1024 tokens a step with no room left to prefill
    a newcomer, and fewer than 64 ever run at once."""
    kv_cache_gib: int = KV_GIB
    prefix_caching: bool = False
    """vLLM's prefix caching on (off by default for a hybrid target): this engine serves only
    the prefix-cache prompts, against the plain engine with prefix caching."""
    full_drafter: bool = False
    """The pair's drafter with every layer full attention (``FULL_DRAFTER``): its acceptance
    is not the pair's, so only the lossless checks judge it."""

    @property
    def drafted(self) -> bool:
        return self.k > 0


def variants(ks: tuple[int, ...]) -> list[Variant]:
    """The engines, one call per K (the seed's K first), the plain engine in the first.

    The engines at the seed's K hold the KV cache 16 concurrent requests need (a hybrid
    target keeps a Gated DeltaNet state per drafted position, so a request of the seed's K
    holds several times a smaller K's). The last K's call adds the prefix-caching pair
    (plain and the fixed wheel at the seed's K): vLLM leaves prefix caching off for a hybrid
    target unless asked, so the other engines never hit the cache, and the pair for
    ``FULL_DRAFTER_FIX`` at the seed's K. A call of its own measures speed: plain and the
    fixed wheel at the seed's K, each with the KV cache 64 concurrent requests need.
    """
    out: list[Variant] = []
    ordered = sorted(ks, reverse=True)
    for call, k in enumerate(ordered, start=1):
        kv = KV_GIB_SEED_K if call == 1 else KV_GIB
        if call == 1:
            out.append(Variant(PLAIN, "patched", 0, call, kv_cache_gib=KV_GIB_PLAIN))
        out.append(Variant(f"patched-k{k}", "patched", k, call, kv_cache_gib=kv))
        out += [Variant(f"no-{p}-k{k}", f"no-{p}", k, call, kv_cache_gib=kv) for p in ABLATED]
        out.append(Variant(f"stock-k{k}", "stock", k, call, kv_cache_gib=kv))
    last = len(ordered)
    out += [
        Variant(PLAIN_PREFIX, "patched", 0, last, prefix_caching=True),
        Variant(f"patched-k{ordered[0]}-prefix", "patched", ordered[0], last, prefix_caching=True),
    ]
    out += [
        Variant(
            f"{site}-k{ordered[0]}-full-drafter",
            site,
            ordered[0],
            last,
            kv_cache_gib=KV_GIB_SEED_K,
            full_drafter=True,
        )
        for site in ("patched", f"no-{FULL_DRAFTER_FIX}")
    ]
    speed = last + 1
    out += [
        Variant(PLAIN_SPEED, "patched", 0, speed, speed=True, kv_cache_gib=KV_GIB_PLAIN),
        Variant(
            f"patched-k{ordered[0]}-speed",
            "patched",
            ordered[0],
            speed,
            speed=True,
            kv_cache_gib=KV_GIB_SPEED,
        ),
    ]
    return out


def batched_tokens(engine: dict[str, Any], k: int) -> int:
    """``max_num_batched_tokens`` for an engine drafting ``k`` tokens: vLLM keeps ``k - 1``
    slots per sequence for a parallel drafter out of it, and schedules the rest, so every
    engine of the check schedules the recipe's tokens per step (and chunks prompts alike)."""
    return int(engine["max_num_batched_tokens"]) + int(engine["max_num_seqs"]) * max(k - 1, 0)


def is_prefix_prompt(name: str) -> bool:
    return name.startswith(PREFIX_PROMPTS)


def full_attention_drafter(drafter: Path, out: Path) -> Path:
    """``out``: ``drafter`` with every layer full attention (its config's ``layer_types``),
    its other files linked; made again each time, so it is never an earlier run's."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in drafter.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((drafter / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * int(config["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def plan(pair: Path, work: Path) -> list[Variant]:
    """Write ``work/<variant>.in.json`` for every engine (and ``work/FULL_DRAFTER``);
    return the variants."""
    prompts = json.loads((pair / "prompts.json").read_text())
    engine = prompts["engine"]
    chosen = variants(tuple(prompts["speculative_tokens"]))
    work.mkdir(parents=True, exist_ok=True)
    full = full_attention_drafter(pair / "drafter", work / FULL_DRAFTER)
    for v in chosen:
        same_call = [o for o in chosen if o.call == v.call]
        engine_args: dict[str, Any] = {"disable_log_stats": False}
        if v.prefix_caching:
            engine_args["enable_prefix_caching"] = True
        request: dict[str, Any] = {
            "name": v.name,
            "engine": {
                "target": str(pair / "target"),
                "drafter": (
                    str(full if v.full_drafter else pair / "drafter") if v.drafted else None
                ),
                "num_speculative_tokens": v.k,
                "vocab_size": 0,
                "max_model_len": engine["max_model_len"],
                "max_num_seqs": engine["max_num_seqs"],
                "max_num_batched_tokens": None if v.speed else batched_tokens(engine, v.k),
                "kv_cache_memory_bytes": v.kv_cache_gib * GIB,
                "engine_args": engine_args,
            },
            "lossless": [
                p
                for p in prompts["lossless"]
                if not v.speed and (is_prefix_prompt(p["name"]) or not v.prefix_caching)
            ],
            "acceptance_prompts": [p["token_ids"] for p in prompts["prompts"]],
            "acceptance_max_new_tokens": prompts["max_new_tokens"],
            "acceptance_concurrency": (
                [] if v.prefix_caching or v.speed else list(ACCEPTANCE_CONCURRENCY)
            ),
            "speed": (
                {
                    "concurrency": list(SPEED_CONCURRENCY),
                    "max_new_tokens": SPEED_NEW_TOKENS,
                    "lock": str(work / f"speed-{v.call}.lock"),
                }
                if v.speed
                else None
            ),
            "barrier": str(work / f"barrier-{v.call}"),
            "barrier_count": len(same_call),
        }
        (work / f"{v.name}.in.json").write_text(json.dumps(request))
    (work / "variants.json").write_text(json.dumps([asdict(v) for v in chosen], indent=1))
    return chosen


# -- verdicts (pure) ---------------------------------------------------------------------------


def top2_margin(position: dict[str, float]) -> float:
    """The gap between the two best logprobs at one position (inf with one candidate)."""
    best = sorted(position.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


@dataclass
class PromptVerdict:
    prompt: str
    compared: int
    """Positions compared (up to the first difference, or all)."""
    first_difference: int | None
    plain_margin: float | None
    """The plain run's top-2 margin at the first difference."""
    tie: bool

    @property
    def ok(self) -> bool:
        return self.first_difference is None or self.tie


def compare_completion(
    name: str, plain: dict[str, Any], drafted: dict[str, Any], tie_margin: float = TIE_MARGIN
) -> PromptVerdict:
    """One checked prompt: where the drafted completion first leaves the plain one, and why."""
    a, b = plain["tokens"], drafted["tokens"]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            margin = top2_margin(plain["logprobs"][i]) if i < len(plain["logprobs"]) else None
            tie = at_most(margin, tie_margin)
            return PromptVerdict(name, i, i, margin, tie)
    if len(a) != len(b):
        return PromptVerdict(name, min(len(a), len(b)), min(len(a), len(b)), None, False)
    return PromptVerdict(name, len(a), None, None, False)


@dataclass
class LosslessVerdict:
    engine: str
    prompts: list[PromptVerdict] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.prompts) and all(p.ok for p in self.prompts)

    @property
    def failures(self) -> list[PromptVerdict]:
        return [p for p in self.prompts if not p.ok]

    @property
    def ties(self) -> list[PromptVerdict]:
        return [p for p in self.prompts if p.first_difference is not None and p.tie]


def lossless(engine: str, plain: dict[str, Any], drafted: dict[str, Any]) -> LosslessVerdict:
    """The strict check of one drafted engine against the plain engine."""
    if not plain.get("ok") or not drafted.get("ok"):
        bad = plain if not plain.get("ok") else drafted
        return LosslessVerdict(engine, error=str(bad.get("error", "no result")))
    verdict = LosslessVerdict(engine)
    for name, result in drafted["lossless"].items():
        if name not in plain["lossless"]:
            return LosslessVerdict(engine, error=f"the plain engine did not serve {name}")
        verdict.prompts.append(compare_completion(name, plain["lossless"][name], result))
    return verdict


def cache_misses(engine: str, result: dict[str, Any]) -> list[str]:
    """The prefix-cache prompts served after another with the same prefix that found nothing
    in the cache: there the check proves nothing about prefix caching."""
    return [
        f"{engine}: {name} found no tokens in the prefix cache"
        for name, served in result.get("lossless", {}).items()
        if is_prefix_prompt(name)
        and name != FIRST_PREFIX_PROMPT
        and not served.get("num_cached_tokens")
    ]


@dataclass
class AcceptanceRow:
    engine: str
    k: int
    concurrency: int
    drafts: int
    accepted: int
    per_position: list[float]
    most_running: int
    equal_plain: int
    prompts: int

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def acceptance_rows(
    name: str, result: dict[str, Any], plain: dict[str, Any] | None
) -> list[AcceptanceRow]:
    rows = []
    for level, data in result.get("acceptance", {}).items():
        spec = data["spec"]
        drafts = int(spec.get(f"{SPEC}num_drafts", 0))
        per_pos = spec.get(f"{SPEC}num_accepted_tokens_per_pos", []) or []
        plain_out = (plain or {}).get("acceptance", {}).get("1", {}).get("outputs", [])
        rows.append(
            AcceptanceRow(
                engine=name,
                k=int(result.get("num_speculative_tokens", 0)),
                concurrency=int(level),
                drafts=drafts,
                accepted=int(spec.get(f"{SPEC}num_accepted_tokens", 0)),
                per_position=[a / drafts for a in per_pos] if drafts else [],
                most_running=int(data.get("most_running", 0)),
                equal_plain=sum(a == b for a, b in zip(data["outputs"], plain_out, strict=False)),
                prompts=len(data["outputs"]),
            )
        )
    return rows


@dataclass
class SpeedRow:
    concurrency: int
    plain_tps: float
    drafted_tps: float
    plain_first_s: float
    drafted_first_s: float
    plain_steady_s: float
    drafted_steady_s: float
    plain_most_running: int
    drafted_most_running: int

    @property
    def ratio(self) -> float:
        return self.drafted_tps / self.plain_tps if self.plain_tps else 0.0


def _steady(passes: list[dict[str, Any]]) -> tuple[float, float]:
    """Tokens/s and seconds of the median pass after the first (a pass that still compiles
    for a shape of its own is an outlier, not a share of the figure)."""
    steady = sorted(passes[1:] or passes, key=lambda p: p["seconds"] / max(p["tokens"], 1))
    middle = steady[(len(steady) - 1) // 2 : len(steady) // 2 + 1]
    seconds = statistics.fmean(p["seconds"] for p in middle)
    tokens = statistics.fmean(p["tokens"] for p in middle)
    return (tokens / seconds if seconds else 0.0), seconds


def speed_rows(plain: dict[str, Any], drafted: dict[str, Any]) -> list[SpeedRow]:
    rows = []
    for level, passes in drafted.get("speed", {}).items():
        base = plain.get("speed", {}).get(level)
        if not base:
            continue
        p_tps, p_s = _steady(base)
        d_tps, d_s = _steady(passes)
        rows.append(
            SpeedRow(
                concurrency=int(level),
                plain_tps=p_tps,
                drafted_tps=d_tps,
                plain_first_s=base[0]["seconds"],
                drafted_first_s=passes[0]["seconds"],
                plain_steady_s=p_s,
                drafted_steady_s=d_s,
                plain_most_running=max(p.get("most_running", 0) for p in base),
                drafted_most_running=max(p.get("most_running", 0) for p in passes),
            )
        )
    return rows


# -- the report --------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def load_variants(work: Path) -> list[Variant]:
    """The variants ``plan`` wrote into ``work``."""
    return [Variant(**v) for v in json.loads((work / "variants.json").read_text())]


def load_results(
    work: Path, through_call: int | None = None
) -> tuple[list[Variant], dict[str, dict[str, Any]]]:
    """The variants of calls up to ``through_call`` (all: None) and their results."""
    chosen = load_variants(work)
    if through_call is not None:
        chosen = [v for v in chosen if v.call <= through_call]
    results = {}
    for v in chosen:
        out = work / f"{v.name}.out.json"
        results[v.name] = (
            json.loads(out.read_text()) if out.is_file() else {"ok": False, "error": "no result"}
        )
    return chosen, results


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
    parser = argparse.ArgumentParser(prog="python -m tooling.smoke.trained_pair")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "report"):
        p = sub.add_parser(name)
        p.add_argument("pair", type=Path)
        p.add_argument("work", type=Path)
        if name == "report":
            p.add_argument("--through-call", type=int)
    args = parser.parse_args(argv)
    if args.command == "plan":
        for v in plan(args.pair, args.work):
            print(v.name, v.site, v.call)
        return 0
    text, ok = report(args.pair, args.work, args.through_call)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
