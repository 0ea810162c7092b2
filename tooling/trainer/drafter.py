"""The DFlash drafter: the reference ``DFlashDraftModel``, trained with many anchors per sequence.

Inference (``dflash.model.dflash_generate``) drafts one block at a time: the
context is the target's features at positions ``[0, a)``, the block is
``[token_a, mask, mask, mask]`` at positions ``a .. a+3``, and the drafter's
outputs at the three mask positions predict tokens ``a+1 .. a+3``. Training packs
K such blocks per sequence into one forward pass. Each block sees exactly what it
would see alone: ``multi_block_hidden`` runs the reference's own layers with one
attention mask per layer kind that restricts block ``j`` to context before its
anchor (and, in sliding layers, to the window, causally) and to its own block.
``check_equivalence`` compares that against the reference forward block by block.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from dflash.model import DFlashDraftModel, _draft_value, _output_head, _raw_input_embeddings
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, Qwen3Config

from ..errors import TrainingError
from .common import Budget, Log, lr_factor
from .config import RecipeConfig
from .target import TrainResult, text_config
from .torchutil import amp, eval_mode, make_adamw, set_lr

logger = logging.getLogger(__name__)


def drafter_config(cfg: RecipeConfig, target: PretrainedConfig, mask_token_id: int) -> Qwen3Config:
    """The drafter's Qwen3Config in the reference checkpoint's shape (hybrid SWA, dflash_config),
    its attention heads the recipe's ``draft_*`` settings where set, else the target's."""
    text = text_config(target)
    layers = len(cfg.drafter_layer_types)
    return Qwen3Config(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=cfg.drafter_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=cfg.draft_num_heads or cfg.num_heads,
        num_key_value_heads=cfg.draft_num_kv_heads or cfg.num_kv_heads,
        head_dim=cfg.draft_head_dim or cfg.head_dim,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        tie_word_embeddings=False,
        layer_types=list(cfg.drafter_layer_types),
        sliding_window=cfg.sliding_window,
        # Without it Qwen3Config drops sliding_window to None (reference and vLLM alike).
        use_sliding_window=True,
        max_window_layers=layers,
        architectures=["DFlashDraftModel"],
        num_target_layers=text.num_hidden_layers,
        block_size=cfg.block_size,
        dflash_config={
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": mask_token_id,
            "block_size": cfg.block_size,
        },
    )


def build_drafter(config: Qwen3Config, seed: int, device: torch.device) -> DFlashDraftModel:
    """A freshly initialised drafter (fp32 master weights) on ``device``."""
    torch.manual_seed(seed)
    return DFlashDraftModel(config).to(device)


def block_layer_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, is_causal: bool, window: int | None
) -> torch.Tensor:
    """Boolean attention mask ``(B, 1, K*bs, ctx_len + K*bs)`` for K blocks per row.

    Keys are ``[context 0..ctx_len-1, block tokens]``. The query at offset ``i`` of
    block ``j`` (position ``q = a_j + i``) sees context ``p < a_j`` and its own block;
    with ``is_causal`` only keys at or before it, and with ``window`` only keys
    with ``q - p < window`` (both ways when not causal): the reference's
    ``_attention_mask`` applied to a single block whose context ends at its anchor.
    """
    batch, blocks = anchors.shape
    queries = blocks * block_size
    device = anchors.device
    offset = torch.arange(block_size, device=device)
    q_pos = (anchors[:, :, None] + offset).reshape(batch, queries)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)
    ctx_pos = torch.arange(ctx_len, device=device)
    ctx_visible = ctx_pos[None, None, :] < q_anchor[:, :, None]
    if window is not None:
        ctx_visible &= (q_pos[:, :, None] - ctx_pos[None, None, :]) < window
    idx = torch.arange(queries, device=device)
    blk, off = idx // block_size, idx % block_size
    own = blk[:, None] == blk[None, :]
    if is_causal:
        own &= off[None, :] <= off[:, None]
    if window is not None:
        own &= (off[:, None] - off[None, :]) < window
        if not is_causal:
            own &= (off[None, :] - off[:, None]) < window
    mask = torch.cat([ctx_visible, own[None].expand(batch, queries, queries)], dim=2)
    return mask[:, None]


def multi_block_hidden(
    drafter: DFlashDraftModel,
    ctx_features: torch.Tensor,
    noise_embedding: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """The drafter's final hidden states for K blocks per row, ``(B, K*bs, hidden)``.

    ``ctx_features`` is ``(B, T, n_ids*hidden)`` for positions ``0..T-1``;
    ``noise_embedding`` is ``(B, K*bs, hidden)`` for the block tokens. This is
    ``DFlashDraftModel.forward`` with a per-layer block mask instead of none.
    """
    batch, ctx_len, _ = ctx_features.shape
    block_size = noise_embedding.shape[1] // anchors.shape[1]
    offset = torch.arange(block_size, device=anchors.device)
    q_pos = (anchors[:, :, None] + offset).reshape(batch, -1)
    ctx_pos = torch.arange(ctx_len, device=anchors.device).expand(batch, ctx_len)
    position_ids = torch.cat([ctx_pos, q_pos], dim=1)
    target_hidden = drafter.hidden_norm(drafter.fc(ctx_features))
    position_embeddings = drafter.rotary_emb(noise_embedding, position_ids)
    masks: dict[tuple[bool, int | None], torch.Tensor] = {}
    hidden = noise_embedding
    for layer in drafter.layers:
        attn = layer.self_attn
        key = (bool(attn.is_causal), attn.sliding_window)
        if key not in masks:
            masks[key] = block_layer_mask(anchors, ctx_len, block_size, *key)
        hidden = layer(
            hidden_states=hidden,
            target_hidden=target_hidden,
            attention_mask=masks[key],
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
    return drafter.norm(hidden)


def block_input_ids(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """Block token ids ``(B, K*bs)``: each block is ``[token at anchor, mask, ..., mask]``."""
    batch, blocks = anchors.shape
    ids = torch.full(
        (batch, blocks, block_size), mask_token_id, dtype=tokens.dtype, device=tokens.device
    )
    ids[:, :, 0] = tokens.gather(1, anchors)
    return ids.reshape(batch, blocks * block_size)


def block_labels(
    tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity ``(B, K, bs-1)`` for the mask positions of each block.

    The label of position ``a+i`` is the target's greedy choice there,
    ``greedy[a+i-1]``. It is valid only while the sequence follows the target's
    greedy chain (``tokens[a+j] == greedy[a+j-1]`` for ``0 < j < i``): only then is
    it the token greedy decoding would produce after the block's anchor. In the
    target's own continuations every label is valid; in corpus text often only
    the first.
    """
    batch, blocks = anchors.shape
    steps = torch.arange(1, block_size, device=anchors.device)
    label_idx = (anchors[:, :, None] + steps - 1).reshape(batch, -1)
    labels = greedy.gather(1, label_idx).reshape(batch, blocks, block_size - 1)
    follows = tokens[:, 1:] == greedy[:, :-1]  # follows[t]: token t+1 is greedy given ..t
    if block_size > 2:
        chain_idx = (anchors[:, :, None] + steps[:-1] - 1).reshape(batch, -1)
        chain = follows.gather(1, chain_idx).reshape(batch, blocks, block_size - 2)
        valid = torch.cat([torch.ones_like(chain[..., :1]), chain.long().cumprod(-1).bool()], -1)
    else:
        valid = torch.ones_like(labels, dtype=torch.bool)
    return labels, valid


def sample_anchors(
    batch: int,
    count: int,
    seq_len: int,
    prompt_len: int,
    cfg: RecipeConfig,
    generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """Distinct anchors ``(batch, count)``: a share in the generated part, the rest before it."""
    last = seq_len - cfg.block_size  # the block must fit
    gen_slots = last - prompt_len + 1
    prompt_slots = prompt_len - cfg.min_anchor
    n_gen = min(round(count * cfg.gen_anchor_fraction), gen_slots)
    n_prompt = min(count - n_gen, prompt_slots)
    n_gen = min(count - n_prompt, gen_slots)
    if n_gen + n_prompt < count:
        raise ValueError(f"{count} anchors do not fit in sequences of {seq_len} tokens")
    parts = []
    for lo, slots, k in ((prompt_len, gen_slots, n_gen), (cfg.min_anchor, prompt_slots, n_prompt)):
        if k:
            keys = torch.rand(batch, slots, generator=generator, device=device)
            parts.append(keys.argsort(dim=1)[:, :k] + lo)
    return torch.cat(parts, dim=1)


@dataclass
class DrafterData:
    """The drafter's training sequences, all on one device.

    ``tokens`` ``(N, T)``: prompt then the target's greedy continuation;
    ``greedy`` ``(N, T)``: the target's argmax at each position (teacher-forced);
    ``features`` ``(N, T, n_ids*hidden)`` bf16: ``extract_context_feature`` per position.
    """

    tokens: torch.Tensor
    greedy: torch.Tensor
    features: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def position_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """Loss weight of mask position k (1-based), exp(-(k-1)/gamma): early ones gate the rest."""
    k = torch.arange(block_size - 1, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def _block_logits(
    drafter: DFlashDraftModel,
    target: nn.Module,
    data: DrafterData,
    rows: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Drafter logits ``(B, K, bs-1, vocab)`` at the mask positions of the chosen blocks."""
    tokens = data.tokens[rows]
    ids = block_input_ids(tokens, anchors, block_size, int(drafter.mask_token_id))
    scale = float(_draft_value(drafter.config, "input_embedding_scale", 1.0))
    noise = _raw_input_embeddings(target, ids, scale)
    hidden = multi_block_hidden(drafter, data.features[rows], noise, anchors)
    batch, blocks = anchors.shape
    hidden = hidden.reshape(batch, blocks, block_size, -1)[:, :, 1:]
    return drafter.compute_logits(hidden, _output_head(target))


def train_drafter(
    drafter: DFlashDraftModel,
    target: nn.Module,
    data: DrafterData,
    cfg: RecipeConfig,
    time_cap_s: float,
    log: Log,
) -> TrainResult:
    """Train the drafter on the target's greedy labels; the target stays frozen.

    Returns the phase summary, with the last logged per-position accuracy.
    """
    device = data.tokens.device
    bs = cfg.block_size
    seq_len = int(data.tokens.shape[1])
    for p in target.parameters():
        p.requires_grad_(False)
    opt = make_adamw(drafter, cfg.drafter_lr, cfg.weight_decay)
    weights = position_weights(bs, cfg.loss_gamma, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 202)
    budget = Budget(cfg.drafter_steps, time_cap_s, cfg.drafter_min_steps)
    log(
        logger,
        f"drafter: {cfg.drafter_steps} steps of {cfg.drafter_batch} sequences x "
        f"{cfg.anchors_per_seq} blocks, cap {time_cap_s:.0f}s, "
        f"at least {min(cfg.drafter_min_steps, cfg.drafter_steps)} steps",
    )
    curve: list[tuple[int, float]] = []
    running = torch.zeros(bs, device=device)  # loss, then accuracy per mask position
    count = 0
    step = 0
    extra: dict[str, float] = {}
    drafter.train()
    while not budget.done(step):
        set_lr(
            opt,
            cfg.drafter_lr * lr_factor(budget.progress(step), cfg.warmup_frac, cfg.min_lr_ratio),
        )
        rows = torch.randint(0, len(data), (cfg.drafter_batch,), generator=gen, device=device)
        anchors = sample_anchors(
            cfg.drafter_batch, cfg.anchors_per_seq, seq_len, data.prompt_len, cfg, gen, device
        )
        labels, valid = block_labels(data.tokens[rows], data.greedy[rows], anchors, bs)
        with amp(device):
            logits = _block_logits(drafter, target, data, rows, anchors, bs)
        ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
        w = (weights * valid).flatten()
        loss = (ce * w).sum() / w.sum().clamp_min(1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels) & valid
            running[0] += loss.detach()
            running[1:] += hit.float().sum(dim=(0, 1)) / valid.float().sum(dim=(0, 1)).clamp_min(1)
        count += 1
        step += 1
        if step % cfg.log_every == 0 or budget.done(step):
            stats = (running / max(count, 1)).tolist()
            running.zero_()
            count = 0
            value = stats[0]
            curve.append((step, value))
            acc = stats[1:]
            extra = {f"train_acc_pos{i + 1}": a for i, a in enumerate(acc)}
            log(
                logger,
                f"drafter step {step}/{cfg.drafter_steps} loss {value:.4f} acc "
                + " ".join(f"{a:.3f}" for a in acc)
                + f" ({budget.elapsed():.1f}s)",
            )
            if not math.isfinite(value):
                raise TrainingError(f"drafter loss is {value} at step {step}")
    return TrainResult(
        steps=step,
        max_steps=cfg.drafter_steps,
        time_s=budget.elapsed(),
        time_capped=budget.time_capped(step),
        curve=curve,
        extra=extra,
    )


@torch.no_grad()
def evaluate_drafter(
    drafter: DFlashDraftModel,
    target: nn.Module,
    data: DrafterData,
    block_size: int,
    batch: int = 16,
) -> dict[str, float | list[float]]:
    """Greedy-acceptance proxy on every block of the generated parts of ``data``.

    Returns per-position accuracy, the per-position acceptance (all earlier
    positions right too) and ``1 + sum`` of it: the mean acceptance length the
    drafter would reach if every step drafted from these exact contexts.
    """
    device = data.tokens.device
    seq_len = int(data.tokens.shape[1])
    anchor_row = torch.arange(data.prompt_len, seq_len - block_size + 1, device=device)
    hits = torch.zeros(block_size - 1, device=device, dtype=torch.float64)
    accepted = torch.zeros(block_size - 1, device=device, dtype=torch.float64)
    blocks = 0
    with eval_mode(drafter):
        for start in range(0, len(data), batch):
            rows = torch.arange(start, min(start + batch, len(data)), device=device)
            anchors = anchor_row.expand(rows.numel(), -1)
            labels, valid = block_labels(data.tokens[rows], data.greedy[rows], anchors, block_size)
            with amp(device):
                logits = _block_logits(drafter, target, data, rows, anchors, block_size)
            ok = valid.all(-1)  # blocks whose whole greedy chain is known
            right = (logits.argmax(-1) == labels)[ok]
            hits += right.double().sum(0)
            accepted += right.long().cumprod(-1).double().sum(0)
            blocks += int(ok.sum())
    blocks = max(blocks, 1)
    per_acc = (hits / blocks).tolist()
    per_accept = (accepted / blocks).tolist()
    return {
        "blocks": float(blocks),
        "accuracy_per_position": per_acc,
        "acceptance_per_position": per_accept,
        "est_mean_acceptance_length": 1.0 + sum(per_accept),
    }


@torch.no_grad()
def check_equivalence(
    drafter: DFlashDraftModel,
    ctx_features: torch.Tensor,
    noise: torch.Tensor,
    anchors: torch.Tensor,
) -> float:
    """Largest difference between the multi-block forward and the reference forward.

    For each block, the reference ``DFlashDraftModel.forward`` gets the context up to
    the anchor and the block alone, with no mask, as in ``dflash_generate`` without
    its cache. Returns the max absolute difference over all block outputs.
    """
    bs = noise.shape[1] // anchors.shape[1]
    with eval_mode(drafter):
        multi = multi_block_hidden(drafter, ctx_features, noise, anchors)
        worst = 0.0
        for b in range(anchors.shape[0]):
            for j in range(anchors.shape[1]):
                a = int(anchors[b, j])
                ref = drafter(
                    target_hidden=ctx_features[b : b + 1, :a],
                    noise_embedding=noise[b : b + 1, j * bs : (j + 1) * bs],
                    position_ids=torch.arange(a + bs, device=anchors.device)[None],
                )
                diff = (ref[0] - multi[b, j * bs : (j + 1) * bs]).abs().max()
                worst = max(worst, float(diff))
    return worst


@torch.no_grad()
def check_on_data(
    drafter: DFlashDraftModel,
    target: nn.Module,
    data: DrafterData,
    rows: int = 2,
    blocks: int = 8,
) -> float:
    """``check_equivalence`` on real sequences with the models as they are (bf16 after
    training), so the kernels the training forward used are compared with the
    reference's unmasked path. Returns the max absolute difference."""
    device = data.tokens.device
    bs = int(drafter.block_size)
    seq_len = int(data.tokens.shape[1])
    n = min(rows, len(data))
    step = max((seq_len - bs - data.prompt_len) // blocks, 1)
    anchors = torch.arange(data.prompt_len, seq_len - bs + 1, step, device=device)[:blocks]
    anchors = anchors.expand(n, -1)
    ids = block_input_ids(data.tokens[:n], anchors, bs, int(drafter.mask_token_id))
    scale = float(_draft_value(drafter.config, "input_embedding_scale", 1.0))
    noise = _raw_input_embeddings(target, ids, scale)
    return check_equivalence(drafter, data.features[:n].to(noise.dtype), noise, anchors)
