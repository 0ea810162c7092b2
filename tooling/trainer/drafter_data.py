"""The drafter's data: corpus windows continued greedily by the frozen target.

The drafter must predict the target's greedy continuation, so it learns from the
target's own output: each prompt window is extended by ``data_gen_len`` greedy
tokens (a KV-cached loop), then one full forward gives the context features and
the target's argmax at every position (the labels).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from .common import Log
from .drafter import DrafterData
from .target import features_and_greedy, greedy_generate, text_config
from .tokenizer import EOT_ID

logger = logging.getLogger(__name__)


def sample_windows(
    stream: np.ndarray, count: int, length: int, rng: np.random.Generator
) -> np.ndarray:
    """``count`` windows ``(count, length)`` at uniform random starts in ``stream``."""
    if count <= 0:
        return np.zeros((0, length), dtype=np.int64)
    if stream.size < length:
        raise ValueError(f"a stream of {stream.size} tokens has no window of {length}")
    starts = rng.integers(0, stream.size - length + 1, size=count)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def build_drafter_data(
    target: nn.Module,
    prompts: np.ndarray,
    gen_len: int,
    layer_ids: list[int],
    gen_batch: int,
    feature_batch: int,
    device: torch.device,
    log: Log,
    time_cap_s: float = float("inf"),
) -> tuple[DrafterData, dict[str, float]]:
    """Continue ``prompts`` greedily and read features and labels.

    Generation stops after the batch that passes ``time_cap_s`` (the data then
    holds fewer sequences). Returns the data (on ``device``) and statistics: how
    often the full-forward argmax agrees with the cached greedy token (numerics)
    and how often corpus text is the target's own greedy choice.
    """
    count, prompt_len = prompts.shape
    seq_len = prompt_len + gen_len
    tokens = torch.empty((count, seq_len), dtype=torch.long, device=device)
    t0 = time.perf_counter()
    done = 0
    while done < count:
        chunk = torch.from_numpy(prompts[done : done + gen_batch]).to(device)
        produced = greedy_generate(target, chunk, gen_len)
        tokens[done : done + chunk.shape[0], :prompt_len].copy_(chunk)
        tokens[done : done + chunk.shape[0], prompt_len:].copy_(produced)
        done += chunk.shape[0]
        elapsed = time.perf_counter() - t0
        if done == chunk.shape[0] or done == count or (done // gen_batch) % 4 == 0:
            log(logger, f"drafter data: generated {done}/{count} ({elapsed:.1f}s)")
        if elapsed > time_cap_s and done < count:
            log(
                logger,
                f"drafter data: time cap {time_cap_s:.0f}s reached at {done}/{count} sequences",
            )
            break
    capped = done < count
    count = done
    tokens = tokens[:count]
    width = len(layer_ids) * int(text_config(target.config).hidden_size)
    features = torch.empty((count, seq_len, width), dtype=torch.bfloat16, device=device)
    greedy = torch.empty((count, seq_len), dtype=torch.long, device=device)
    for start in range(0, count, feature_batch):
        chunk = tokens[start : start + feature_batch]
        feats, argmax = features_and_greedy(target, chunk, layer_ids)
        features[start : start + feats.shape[0]].copy_(feats)
        greedy[start : start + feats.shape[0]].copy_(argmax)
    follows = tokens[:, 1:] == greedy[:, :-1]
    stats = {
        "time_capped": float(capped),
        "sequences": float(count),
        "tokens": float(count * seq_len),
        "generated_tokens": float(count * gen_len),
        # Cached decoding vs one full forward: below 1 only through bf16 near-ties.
        "greedy_agreement_generated": float(follows[:, prompt_len - 1 :].float().mean()),
        # How often corpus text is what the target would have chosen (its top-1 accuracy).
        "greedy_agreement_prompt": float(follows[:, : prompt_len - 1].float().mean()),
        "eot_share_generated": float((tokens[:, prompt_len:] == EOT_ID).float().mean()),
    }
    data = DrafterData(tokens=tokens, greedy=greedy, features=features, prompt_len=prompt_len)
    return data, stats
