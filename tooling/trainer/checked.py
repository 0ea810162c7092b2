"""The prompts a strict lossless check serves on the trained pair, chosen by the recipe.

Each is served alone, in this order, greedily, with and without the drafter. They cover
what breaks a hybrid target under speculative decoding: prompts of K, K+1 and K+2
tokens (a (K+1)-token prefill looks like a verify step), a prompt whose last
chunked-prefill piece is one token, prompts that hit the prefix cache after an earlier
one, and a completion that runs to ``max_model_len``. The recipe checks its quality
floor on them too, and the served engines take ``engine_settings`` so chunking and
lengths match.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: The longest context the check serves (shorter where the target's positions end sooner).
MAX_MODEL_LEN = 2048
#: vLLM's smallest KV-cache block: the prefix-cache prompts share whole blocks of it.
BLOCK = 16


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


def lossless_prompts(
    stream: np.ndarray,
    speculative_tokens: tuple[int, ...],
    engine: dict[str, int],
    new_tokens: int,
    seed: int,
) -> list[CheckedPrompt]:
    """The check's prompts, windows of ``stream`` (held-out tokens) at seeded offsets, each
    run for ``new_tokens`` but the last, which runs to ``max_model_len``."""
    rng = np.random.default_rng(seed)

    def window(length: int) -> list[int]:
        start = int(rng.integers(0, stream.size - length + 1))
        return [int(t) for t in stream[start : start + length]]

    out: list[CheckedPrompt] = []
    for k in sorted(speculative_tokens):
        for extra, why in (
            (0, "K"),
            (1, "K+1: the prefill is as long as a verify step"),
            (2, "K+2"),
        ):
            length = k + extra
            out.append(CheckedPrompt(f"k{k}-len{length}", window(length), new_tokens, why))
    chunk = engine["max_num_batched_tokens"]
    out.append(
        CheckedPrompt(
            f"chunk-tail-{chunk + 1}",
            window(chunk + 1),
            new_tokens,
            "its last chunked-prefill piece is one token",
        )
    )
    # A hybrid target's attention block grows until its page holds a Gated DeltaNet state
    # (hundreds of tokens on the seed's heads), and the prefix cache reuses whole blocks:
    # the shared prefix spans several.
    shared = engine["max_num_batched_tokens"] // BLOCK * BLOCK
    first = window(shared + BLOCK)
    other = window(BLOCK)
    out += [
        CheckedPrompt("prefix-a", first, new_tokens, "fills the prefix cache"),
        CheckedPrompt(
            "prefix-b",
            first[:shared] + other,
            new_tokens,
            f"its first {shared} tokens hit the prefix cache",
        ),
        CheckedPrompt("prefix-a-again", first, new_tokens, "every whole block hits the cache"),
    ]
    length = engine["max_model_len"] * 3 // 4
    out.append(
        CheckedPrompt(
            "to-max-model-len",
            window(length),
            engine["max_model_len"] - length,
            "the completion runs to max_model_len",
        )
    )
    return out
