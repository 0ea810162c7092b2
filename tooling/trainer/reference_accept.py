"""Reference acceptance: the dflash package's own speculative decoding on held-out prompts.

The main loop is ``dflash.model.dflash_generate`` itself (greedy, no stop tokens).
``minimal_run`` is the same algorithm without caches, written against the same
reference pieces; it cross-checks the main loop and stands in for it where the
installed transformers lacks what ``dflash_generate`` needs
(``DynamicCache.activate_past_recording``: 5.17 has it, 5.8 does not).

The numbers are the ones vLLM reports: mean acceptance length is
``1 + accepted / drafts`` and acceptance at draft position ``i`` is the share of
drafting steps whose first ``i`` drafts were all accepted. ``dflash_generate``
reports only the tokens each step appended, clipped at ``max_new_tokens``, so
for it the last step's acceptance is a lower bound; ``minimal_run`` counts the
last step as vLLM does (a whole block drafted, every agreeing draft counted).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from dflash import model as dflash_model
from dflash.model import (
    DFlashDraftModel,
    _draft_value,
    _output_head,
    _raw_input_embeddings,
    dflash_generate,
    extract_context_feature,
)
from torch import nn

from .checked import CheckedPrompt
from .common import Log
from .config import RecipeConfig
from .corpus import SourceFile
from .target import greedy_generate
from .tokenizer import EOT_ID

logger = logging.getLogger(__name__)

DFLASH_LOOP = "dflash.model.dflash_generate"
MINIMAL_LOOP = "minimal-uncached"


@dataclass(frozen=True)
class Prompt:
    """One held-out prompt: where it comes from and its token ids."""

    id: int
    file: str
    token_offset: int
    token_ids: list[int]


def select_prompts(
    files: list[SourceFile], docs: list[np.ndarray], count: int, length: int, seed: int
) -> list[Prompt]:
    """``count`` windows of ``length`` tokens from distinct files where possible (seeded).

    Files are taken in a seeded order, one window each at a seeded offset; if
    there are fewer long-enough files than prompts, the order repeats with new
    offsets.
    """
    eligible = [(f, d) for f, d in zip(files, docs, strict=True) if d.size >= length]
    if not eligible:
        raise ValueError(f"no held-out file has {length} tokens")
    rng = random.Random(seed)
    order = list(range(len(eligible)))
    rng.shuffle(order)
    prompts: list[Prompt] = []
    seen: set[tuple[str, int]] = set()
    attempts = 0
    while len(prompts) < count and attempts < 50 * count:
        f, d = eligible[order[attempts % len(order)]]
        attempts += 1
        offset = rng.randrange(0, d.size - length + 1)
        if (f.relpath, offset) in seen:
            continue
        seen.add((f.relpath, offset))
        ids = [int(t) for t in d[offset : offset + length]]
        prompts.append(Prompt(id=len(prompts), file=f.relpath, token_offset=offset, token_ids=ids))
    return prompts


@dataclass
class PromptRun:
    """One prompt's speculative decode: generated ids and, per step, what was drafted and taken."""

    output_ids: list[int]
    produced: list[int]  # tokens appended per step (dflash's acceptance_lengths)
    drafted: list[int]
    accepted: list[int]
    time_s: float = 0.0


def dflash_loop_supported(arch: str = "qwen3") -> bool:
    """Whether ``dflash_generate`` can run: the installed transformers has what it calls, and
    the target's cache can be cut back to the accepted tokens, which a Gated DeltaNet's
    recurrent state cannot (a hybrid target is measured with ``minimal_run``)."""
    from transformers import DynamicCache

    return arch != "hybrid" and hasattr(DynamicCache, "activate_past_recording")


@contextlib.contextmanager
def _host_clock(device: torch.device) -> Iterator[None]:
    """On a CPU, let ``dflash_generate(return_stats=True)`` time with the wall clock.

    Its ``_cuda_time`` calls ``torch.cuda.synchronize``; this only affects timings.
    """
    if device.type == "cuda":
        yield
        return
    saved = dflash_model._cuda_time
    dflash_model._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dflash_model._cuda_time = saved


def _steps(
    produced: list[int], prompt_len: int, max_new: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Drafted and accepted counts per step, rebuilt from the tokens each step appended.

    Mirrors ``dflash_generate``: a step at ``start`` verifies
    ``min(block_size, max_len - start)`` tokens; it appends accepted + 1 except at
    the very end, where it is clipped (the last step's acceptance is a lower bound).
    """
    max_len = prompt_len + max_new
    start = prompt_len
    drafted: list[int] = []
    accepted: list[int] = []
    for p in produced:
        d = min(block_size, max_len - start) - 1
        drafted.append(d)
        accepted.append(min(p - 1, d))
        start += p
    return drafted, accepted


@torch.inference_mode()
def dflash_run(
    target: nn.Module, drafter: DFlashDraftModel, prompt: list[int], max_new: int
) -> PromptRun:
    """One prompt through ``dflash_generate`` (greedy, no stop tokens)."""
    device = target.device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    with _host_clock(device):
        stats = dflash_generate(
            drafter,
            target,
            ids,
            max_new,
            None,
            temperature=0.0,
            block_size=drafter.block_size,
            return_stats=True,
        )
    produced = [int(p) for p in stats.acceptance_lengths]
    drafted, accepted = _steps(produced, len(prompt), max_new, drafter.block_size)
    return PromptRun(
        output_ids=stats.output_ids[0, len(prompt) :].tolist(),
        produced=produced,
        drafted=drafted,
        accepted=accepted,
        time_s=time.perf_counter() - t0,
    )


@torch.inference_mode()
def minimal_run(
    target: nn.Module,
    drafter: DFlashDraftModel,
    prompt: list[int],
    max_new: int,
    block_size: int | None = None,
) -> PromptRun:
    """One prompt through ``dflash_generate``'s greedy algorithm, recomputed without caches.

    Each step runs the drafter on the target's features for every position
    before the block and the block ``[last token, mask, ...]``, then verifies with
    a full target forward; features of accepted tokens come from that forward.
    ``block_size`` (default: the drafter's) is K + 1, as vLLM drafts K tokens a step.
    As in vLLM, the last step drafts a whole block too and counts every draft the target
    agrees with, though the output keeps only the tokens up to ``max_new``.
    """
    device = target.device
    bs = int(block_size or drafter.block_size)
    mask_id = int(drafter.mask_token_id)
    layer_ids = list(drafter.target_layer_ids)
    scale = float(_draft_value(drafter.config, "input_embedding_scale", 1.0))
    head = _output_head(target)
    prompt_len = len(prompt)
    max_len = prompt_len + max_new
    t0 = time.perf_counter()
    tokens = torch.full((1, max_len + bs), mask_id, dtype=torch.long, device=device)
    tokens[0, :prompt_len] = torch.tensor(prompt, device=device)
    out = target(input_ids=tokens[:, :prompt_len], output_hidden_states=True)
    tokens[0, prompt_len] = out.logits[0, -1].argmax()
    context = extract_context_feature(list(out.hidden_states), layer_ids)
    start = prompt_len
    produced: list[int] = []
    drafted: list[int] = []
    accepted_list: list[int] = []  # exact, unlike the clipped last step _steps rebuilds
    while start + 1 < max_len:
        block = tokens[:, start : start + bs].clone()
        noise = _raw_input_embeddings(target, block, scale)
        hidden = drafter(
            target_hidden=context[:, :start],
            noise_embedding=noise,
            position_ids=torch.arange(start + bs, device=device)[None],
        )[:, 1 - bs :]
        block[:, 1:] = drafter.compute_logits(hidden, head).argmax(-1)
        seq = torch.cat([tokens[:, :start], block], dim=1)
        out = target(input_ids=seq, output_hidden_states=True)
        posterior = out.logits[:, start : start + bs].argmax(-1)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0])
        tokens[:, start : start + accepted + 1] = block[:, : accepted + 1]
        tokens[0, start + accepted + 1] = posterior[0, accepted]
        step = min(accepted + 1, max_len - start - 1)
        start += step
        produced.append(step)
        drafted.append(bs - 1)
        accepted_list.append(accepted)
        context = extract_context_feature(list(out.hidden_states), layer_ids)[:, :start]
    return PromptRun(
        output_ids=tokens[0, prompt_len:max_len].tolist(),
        produced=produced,
        drafted=drafted,
        accepted=accepted_list,
        time_s=time.perf_counter() - t0,
    )


@dataclass
class AcceptanceReport:
    """Acceptance over all prompts, vLLM's way, plus dflash's benchmark figure."""

    loop: str
    num_prompts: int
    max_new_tokens: int
    num_speculative_tokens: int
    mean_acceptance_length: float
    acceptance_per_position: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    dflash_benchmark_acceptance_length: float
    acceptance_length_histogram: list[float]
    time_s: float
    runs: list[PromptRun] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The report without the per-prompt runs."""
        out = asdict(self)
        out.pop("runs")
        return out


def summarise(runs: list[PromptRun], loop: str, max_new: int, block_size: int) -> AcceptanceReport:
    """Aggregate per-prompt runs into one report."""
    steps = [(d, a) for r in runs for d, a in zip(r.drafted, r.accepted, strict=True) if d > 0]
    num_drafts = len(steps)
    accepted = sum(a for _, a in steps)
    per_position = [
        sum(1 for _, a in steps if a >= i) / max(num_drafts, 1) for i in range(1, block_size)
    ]
    per_prompt = [sum(r.produced) / len(r.produced) for r in runs if r.produced]
    all_produced = [p for r in runs for p in r.produced]
    histogram = [
        sum(1 for p in all_produced if p == b) / max(len(all_produced), 1)
        for b in range(block_size + 1)
    ]
    return AcceptanceReport(
        loop=loop,
        num_prompts=len(runs),
        max_new_tokens=max_new,
        num_speculative_tokens=block_size - 1,
        mean_acceptance_length=1.0 + accepted / max(num_drafts, 1),
        acceptance_per_position=per_position,
        num_drafts=num_drafts,
        num_draft_tokens=sum(d for d, _ in steps),
        num_accepted_tokens=accepted,
        dflash_benchmark_acceptance_length=sum(per_prompt) / max(len(per_prompt), 1),
        acceptance_length_histogram=histogram,
        time_s=sum(r.time_s for r in runs),
        runs=runs,
    )


def measure(
    target: nn.Module,
    drafter: DFlashDraftModel,
    prompts: list[list[int]],
    max_new: int,
    loop: str = "auto",
    arch: str = "qwen3",
    speculative_tokens: int | None = None,
) -> AcceptanceReport:
    """Speculative-decode every prompt and report acceptance.

    ``loop`` is ``"dflash"``, ``"minimal"`` or ``"auto"`` (dflash's own loop where it can
    run, ``dflash_loop_supported``). ``speculative_tokens`` other than the drafter's
    block size - 1 needs the minimal loop, which drafts blocks of any size.
    """
    block = int(drafter.block_size)
    bs = block if speculative_tokens is None else speculative_tokens + 1
    if loop == "auto":
        loop = "dflash" if dflash_loop_supported(arch) and bs == block else "minimal"
    if loop == "dflash":
        runs = [dflash_run(target, drafter, p, max_new) for p in prompts]
    else:
        runs = [minimal_run(target, drafter, p, max_new, bs) for p in prompts]
    name = DFLASH_LOOP if loop == "dflash" else MINIMAL_LOOP
    return summarise(runs, name, max_new, bs)


@dataclass(frozen=True)
class PlainGreedy:
    """The target's own greedy continuations of the acceptance prompts, with each choice's
    top-2 logit margin, and the margins of the lossless check's prompts."""

    tokens: list[list[int]]
    margins: list[list[float]]
    checked_margins: dict[str, list[float]]

    def all_margins(self) -> list[float]:
        return [m for row in self.margins for m in row] + [
            m for row in self.checked_margins.values() for m in row
        ]


@torch.inference_mode()
def plain_greedy(
    cfg: RecipeConfig,
    target: nn.Module,
    prompts: list[Prompt],
    checked_margins: dict[str, list[float]],
) -> PlainGreedy:
    """Greedy runs of the target alone on the acceptance prompts, beside the lossless
    check's margins (``checked_margins``, measured when its prompts were chosen)."""
    device = next(target.parameters()).device
    ids = torch.tensor([p.token_ids for p in prompts], device=device)
    tokens, margins = greedy_generate(target, ids, cfg.max_new_tokens, with_margins=True)
    return PlainGreedy(tokens.tolist(), margins.tolist(), checked_margins)


@torch.inference_mode()
def greedy_margins(target: nn.Module, prompts: list[CheckedPrompt]) -> list[list[float]]:
    """Each prompt's greedy top-2 margins, as one batch: the prompts share one length and
    one completion length."""
    lengths = {(len(p.token_ids), p.max_new_tokens) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"one batch takes prompts of one shape, not {sorted(lengths)}")
    device = next(target.parameters()).device
    ids = torch.tensor([p.token_ids for p in prompts], device=device)
    _, margins = greedy_generate(target, ids, prompts[0].max_new_tokens, with_margins=True)
    return margins.tolist()


def reference_summary(
    cfg: RecipeConfig,
    target: nn.Module,
    drafter: DFlashDraftModel,
    plain_run: PlainGreedy,
    prompts: list[Prompt],
    log: Log,
) -> dict[str, Any]:
    """Reference acceptance on the prompts, plain greedy outputs and a loop cross-check.

    Returns the summary; its ``document`` entry is the per-prompt file's content.
    """
    ids = [p.token_ids for p in prompts]
    reports = {
        k: measure(target, drafter, ids, cfg.max_new_tokens, arch=cfg.arch, speculative_tokens=k)
        for k in cfg.speculative_tokens
    }
    report = reports[cfg.block_size - 1]
    for k, r in reports.items():
        log(
            logger,
            f"reference ({r.loop}, K={k}): mean acceptance length "
            f"{r.mean_acceptance_length:.3f}, per position "
            + ", ".join(f"{x:.3f}" for x in r.acceptance_per_position),
        )
    plain, margins = plain_run.tokens, plain_run.margins
    lossless = sum(r.output_ids == g for r, g in zip(report.runs, plain, strict=True))
    cross = [
        minimal_run(target, drafter, p, cfg.max_new_tokens) for p in ids[: cfg.crosscheck_prompts]
    ]
    pairs = list(zip(cross, report.runs, strict=False))
    document = {
        "loop": report.loop,
        "max_new_tokens": cfg.max_new_tokens,
        "num_speculative_tokens": cfg.block_size - 1,
        "prompts": [
            {
                "id": p.id,
                "output_ids": r.output_ids,
                "plain_greedy_ids": g,
                "plain_greedy_margins": m,
                "acceptance_lengths": r.produced,
                "drafted_per_step": r.drafted,
                "accepted_per_step": r.accepted,
                "eot_in_output": EOT_ID in r.output_ids,
            }
            for p, r, g, m in zip(prompts, report.runs, plain, margins, strict=True)
        ],
        # Every K's runs, so an engine's acceptance can be set beside the reference's on the
        # prompts whose outputs the two share.
        "by_speculative_tokens": {
            str(k): [
                {
                    "id": p.id,
                    "output_ids": run.output_ids,
                    "drafted_per_step": run.drafted,
                    "accepted_per_step": run.accepted,
                }
                for p, run in zip(prompts, r.runs, strict=True)
            ]
            for k, r in reports.items()
        },
    }
    out = report.summary()
    out.update(
        {
            "by_speculative_tokens": {str(k): r.summary() for k, r in reports.items()},
            "plain_greedy_margins": [m for row in margins for m in row],
            "plain_greedy_equal": lossless,
            "crosscheck_minimal_loop": {
                "prompts": len(cross),
                "outputs_equal": sum(c.output_ids == r.output_ids for c, r in pairs),
                "mean_acceptance_length_minimal_vs_main": [
                    [run_accept_len(c), run_accept_len(r)] for c, r in pairs
                ],
            },
            "prompts_with_eot_in_output": sum(EOT_ID in r.output_ids for r in report.runs),
            "document": document,
        }
    )
    log(
        logger,
        f"reference: {lossless}/{len(ids)} equal to plain greedy; minimal loop equal on "
        f"{out['crosscheck_minimal_loop']['outputs_equal']}/{len(cross)}",
    )
    return out


def run_accept_len(run: PromptRun) -> float:
    """One prompt's mean acceptance length, vLLM's way."""
    drafts = sum(1 for d in run.drafted if d > 0)
    return 1.0 + sum(run.accepted) / max(drafts, 1)
