"""The trained hybrid pair on vLLM engines: what each engine runs (``plan``), and the results
read back (``load_results``).

The pair is the recipe's (``tooling train --arch hybrid``). ``plan`` writes one request per
engine (``tooling.trained.serving.trained_run`` runs it); ``hybrid_verdicts`` judges what they
return and ``hybrid`` reports it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import SmokeError

logger = logging.getLogger(__name__)

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
#: The option the first call serves the fixed wheel with beside it (patch 22): the drafter's
#: forward on full CUDA graphs of its own is the fixed wheel's default, so its control is the
#: fixed wheel with them off, held to the same checks: the acceptance of the two side by side
#: (a graph that reads stale metadata drafts worse, and the target's verification hides it
#: from the lossless checks).
NO_DRAFTER_GRAPHS = {"dflash_full_cudagraphs": False}
#: The option the first call also serves the fixed wheel with (patch 32): a Gated DeltaNet
#: verify step that keeps one state a request and replays the accepted tokens' rows the next
#: step. It needs prefix caching off, which the engine is served with.
REPLAY = {"gdn_spec_replay": True}
#: The drafts a step verifies under the first call's speculation budget (patch 17) once more
#: than LOAD_BUDGET_FROM - 1 requests run: none, so that its 16 at once serve patch 23's step
#: of no drafts, whose decodes on this hybrid target read the state the drafts before them
#: left (patch 24); one at a time the call's K.
LOAD_BUDGET_K = 0
LOAD_BUDGET_FROM = 9
#: The fix the budget's control is served without: the same budget on the wheel without
#: patch 24, whose steps of no drafts read each request's first state slot.
STATE_FIX = "hybrid-accepted-state"

PLAIN = "plain"
PLAIN_PREFIX = "plain-prefix"
PLAIN_SPEED = "plain-speed"
#: The recipe's prompts that share a prefix (``trainer/checked.py``).
PREFIX_PROMPTS = "prefix-"
#: The one of them that fills the cache.
FIRST_PREFIX_PROMPT = "prefix-a"
#: The vLLM installs the variants run on: the fixed wheel, stock, and one ablation each.
SITES = (
    *("patched", "stock"),
    *(f"no-{p}" for p in (*ABLATED, FULL_DRAFTER_FIX, STATE_FIX)),
)


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
    budget: bool = False
    """The fixed wheel under the speculation budget ``budget_schedule`` gives."""
    no_drafter_graphs: bool = False
    """The fixed wheel with ``NO_DRAFTER_GRAPHS``."""
    replay: bool = False
    """The fixed wheel with ``REPLAY``, prefix caching off."""

    @property
    def drafted(self) -> bool:
        return self.k > 0


def variants(ks: tuple[int, ...]) -> list[Variant]:
    """The engines, one call per K (the seed's K first): the fixed wheel and stock in each;
    the plain engine, the fixed wheel with ``NO_DRAFTER_GRAPHS``, with ``REPLAY``, and under a
    speculation budget with its control (the wheel without ``STATE_FIX``) in the first; the
    ablations of ``ABLATED`` in the others (in the only one where there is one).

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
        if call == 1:
            # The checks of the newest fixes in the first call, served first where the call
            # takes turns (``gpu_fit``); the ablations of the settled fixes in the later calls.
            if k > LOAD_BUDGET_K:
                out += [
                    Variant(f"{site}-k{k}-budget", site, k, call, kv_cache_gib=kv, budget=True)
                    for site in ("patched", f"no-{STATE_FIX}")
                ]
            out += [
                Variant(
                    f"patched-k{k}-no-drafter-graphs",
                    "patched",
                    k,
                    call,
                    kv_cache_gib=kv,
                    no_drafter_graphs=True,
                ),
                Variant(f"patched-k{k}-replay", "patched", k, call, kv_cache_gib=kv, replay=True),
            ]
        out.append(Variant(f"stock-k{k}", "stock", k, call, kv_cache_gib=kv))
        if call > 1 or len(ordered) == 1:
            out += [Variant(f"no-{p}-k{k}", f"no-{p}", k, call, kv_cache_gib=kv) for p in ABLATED]
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


def budget_schedule(k: int) -> dict[str, Any]:
    """The speculation budget of a ``budget`` variant of K = ``k``: ``k`` drafts verified a
    step up to LOAD_BUDGET_FROM - 1 running requests, LOAD_BUDGET_K from there."""
    ranges = [[1, LOAD_BUDGET_FROM - 1, k], [LOAD_BUDGET_FROM, 1024, LOAD_BUDGET_K]]
    return {"num_speculative_tokens_per_batch_size": ranges}


def chosen_variants(pair: Path, only: tuple[str, ...] = ()) -> list[Variant]:
    """The variants of ``pair``'s plan, or those ``only`` names; a name no variant has is
    refused."""
    prompts = json.loads((pair / "prompts.json").read_text())
    chosen = variants(tuple(prompts["speculative_tokens"]))
    unknown = sorted(set(only) - {v.name for v in chosen})
    if unknown:
        raise SmokeError(f"no engine {', '.join(unknown)} in the plan of {pair}")
    return [v for v in chosen if v.name in only] if only else chosen


def plan(pair: Path, work: Path, only: tuple[str, ...] = ()) -> list[Variant]:
    """Write ``work/<variant>.in.json`` for every engine, or those ``only`` names (and
    ``work/FULL_DRAFTER``); return the variants. A name no variant has is refused."""
    prompts = json.loads((pair / "prompts.json").read_text())
    engine = prompts["engine"]
    chosen = chosen_variants(pair, only)
    logger.debug("plan %d engine variants of %s in %s", len(chosen), pair, work)
    work.mkdir(parents=True, exist_ok=True)
    full = full_attention_drafter(pair / "drafter", work / FULL_DRAFTER)
    for v in chosen:
        same_call = [o for o in chosen if o.call == v.call]
        engine_args: dict[str, Any] = {"disable_log_stats": False}
        if v.prefix_caching or v.replay:
            engine_args["enable_prefix_caching"] = v.prefix_caching
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
                "speculative_args": {
                    **(budget_schedule(v.k) if v.budget else {}),
                    **(NO_DRAFTER_GRAPHS if v.no_drafter_graphs else {}),
                    **(REPLAY if v.replay else {}),
                },
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
