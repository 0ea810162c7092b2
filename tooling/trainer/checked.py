"""The prompts a strict lossless check serves on the trained pair, chosen by the recipe.

Each is served alone, in this order, greedily, with and without the drafter. They cover
what breaks a hybrid target under speculative decoding: prompts of K, K+1 and K+2
tokens (a (K+1)-token prefill looks like a verify step), a prompt whose last
chunked-prefill piece is one token, prompts that hit the prefix cache after an earlier
one, and a completion that runs to ``max_model_len``. The recipe checks its quality
floor on them too, and the served engines take ``engine_settings`` so chunking and
lengths match.

Each place in that list takes the most decisive of several seeded windows of its length:
the one whose greedy completion, in the recipe's own bf16 run of the target, comes
nearest a tie the fewest times. vLLM's kernels round otherwise than the recipe's, by a
bf16 step or two, so a choice within ``NEAR_TIE`` here may flip there without any
defect; on windows with fewer of them a failure names a defect more often than a rounding
(the check lists the margin of each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: The longest context the check serves (shorter where the target's positions end sooner).
MAX_MODEL_LEN = 2048
#: vLLM's smallest KV-cache block: the prefix-cache prompts share whole blocks of it.
BLOCK = 16
#: A greedy choice this near the runner-up may be a tie in vLLM: a bf16 step of a logit of
#: magnitude 4 to 8 is 2^-5, and vLLM's kernels round otherwise than the recipe's.
NEAR_TIE = 2**-3


@dataclass(frozen=True)
class CheckedPrompt:
    name: str
    token_ids: list[int]
    max_new_tokens: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_settings(max_position_embeddings: int) -> dict[str, int]:
    """vLLM settings the check's prompts are cut for; every engine of the check takes them.

    Half the context per step makes the longest prompts chunk; 64 sequences let the speed
    figures run 64 requests at once, K+1 tokens each.
    """
    max_model_len = min(MAX_MODEL_LEN, max_position_embeddings)
    return {
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_model_len // 2,
        "max_num_seqs": 64,
    }


@dataclass(frozen=True)
class Slot:
    """One place of the check's prompt list and the seeded windows it may take: each
    candidate is the prompts that place serves (one, or the prefix cache's three), all of
    one length and one completion length, so a slot's candidates run as one batch."""

    candidates: tuple[tuple[CheckedPrompt, ...], ...]


def lossless_slots(
    stream: np.ndarray,
    speculative_tokens: tuple[int, ...],
    engine: dict[str, int],
    new_tokens: int,
    seed: int,
    candidates: int,
) -> list[Slot]:
    """The check's places, each with ``candidates`` windows of ``stream`` (held-out tokens)
    at seeded offsets; each prompt runs for ``new_tokens`` but the last, which runs to
    ``max_model_len``."""
    rng = np.random.default_rng(seed)

    def window(length: int) -> list[int]:
        start = int(rng.integers(0, stream.size - length + 1))
        return [int(t) for t in stream[start : start + length]]

    def single(name: str, length: int, completion: int, why: str) -> Slot:
        return Slot(
            tuple(
                (CheckedPrompt(name, window(length), completion, why),) for _ in range(candidates)
            )
        )

    out: list[Slot] = []
    for k in sorted(speculative_tokens):
        for extra, why in (
            (0, "K"),
            (1, "K+1: the prefill is as long as a verify step"),
            (2, "K+2"),
        ):
            out.append(single(f"k{k}-len{k + extra}", k + extra, new_tokens, why))
    chunk = engine["max_num_batched_tokens"]
    out.append(
        single(
            f"chunk-tail-{chunk + 1}",
            chunk + 1,
            new_tokens,
            "its last chunked-prefill piece is one token",
        )
    )
    # A hybrid target's attention block grows until its page holds a Gated DeltaNet state
    # (hundreds of tokens on the seed's heads), and the prefix cache reuses whole blocks:
    # the shared prefix spans several.
    shared = engine["max_num_batched_tokens"] // BLOCK * BLOCK

    def prefix() -> tuple[CheckedPrompt, ...]:
        first = window(shared + BLOCK)
        other = window(BLOCK)
        return (
            CheckedPrompt("prefix-a", first, new_tokens, "fills the prefix cache"),
            CheckedPrompt(
                "prefix-b",
                first[:shared] + other,
                new_tokens,
                f"its first {shared} tokens hit the prefix cache",
            ),
            CheckedPrompt("prefix-a-again", first, new_tokens, "every whole block hits the cache"),
        )

    out.append(Slot(tuple(prefix() for _ in range(candidates))))
    length = engine["max_model_len"] * 3 // 4
    out.append(
        single(
            "to-max-model-len",
            length,
            engine["max_model_len"] - length,
            "the completion runs to max_model_len",
        )
    )
    return out


@dataclass(frozen=True)
class Chosen:
    prompts: list[CheckedPrompt]
    """The check's prompts, one candidate per slot, in the slots' order."""
    margins: dict[str, list[float]]
    """Each chosen prompt's greedy top-2 margins (a repeated prompt once)."""
    near_ties: dict[str, int]
    """How many of them are within ``NEAR_TIE``."""


def choose_decisive(
    slots: Sequence[Slot], margins_of: Callable[[list[CheckedPrompt]], list[list[float]]]
) -> Chosen:
    """Each slot's candidate with the fewest greedy choices within ``NEAR_TIE`` (then the
    largest smallest margin, then the first drawn). ``margins_of`` gives each prompt's
    greedy top-2 margins, for prompts of one length and one completion length."""
    prompts: list[CheckedPrompt] = []
    margins: dict[str, list[float]] = {}
    for slot in slots:
        groups = [_distinct(c) for c in slot.candidates]
        flat = iter(margins_of([p for group in groups for p in group]))
        rows = [[next(flat) for _ in group] for group in groups]
        ranks = []
        for i, candidate in enumerate(rows):
            choices = [m for row in candidate for m in row]
            ranks.append((sum(1 for m in choices if m <= NEAR_TIE), -min(choices), i))
        best = min(ranks)[2]
        prompts += slot.candidates[best]
        margins.update({p.name: row for p, row in zip(groups[best], rows[best], strict=True)})
    return Chosen(
        prompts,
        margins,
        {name: sum(1 for m in row if m <= NEAR_TIE) for name, row in margins.items()},
    )


def _distinct(group: tuple[CheckedPrompt, ...]) -> list[CheckedPrompt]:
    """A candidate's prompts, a repeated one (prefix-a-again) once: one completion."""
    first: dict[tuple[int, ...], CheckedPrompt] = {}
    for p in group:
        first.setdefault(tuple(p.token_ids), p)
    return list(first.values())
