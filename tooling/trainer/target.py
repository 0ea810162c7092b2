"""The target: a small transformers model trained on the corpus, attention-only
(``Qwen3ForCausalLM``) or of the seed's hybrid family (``Qwen3_5ForConditionalGeneration``).

Also the target-side tools the drafter needs: greedy continuations and the
context features (HF ``hidden_states[id + 1]``, the reference's reading).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dflash.model import extract_context_feature
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from ..errors import TrainingError
from .common import Budget, Log, lr_factor
from .config import RecipeConfig
from .hybrid import hybrid_config
from .tokenizer import EOT_ID
from .torchutil import amp, eval_mode, make_adamw, set_lr, sync

logger = logging.getLogger(__name__)


def target_config(cfg: RecipeConfig, vocab_size: int) -> PretrainedConfig:
    """The target's config: Qwen3 with full attention everywhere, or the hybrid Qwen3.5; the
    head is untied in both."""
    if cfg.arch == "hybrid":
        from transformers import Qwen3_5Config

        return Qwen3_5Config(
            **hybrid_config(
                vocab_size=vocab_size,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.target_intermediate,
                layers=cfg.target_layers,
                attention=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                linear=(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_head_dim),
                max_position_embeddings=cfg.max_position_embeddings,
                eos_token_id=EOT_ID,
            )
        )
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.target_intermediate,
        num_hidden_layers=cfg.target_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        architectures=["Qwen3ForCausalLM"],
    )


def build_target(config: PretrainedConfig, seed: int, device: torch.device) -> nn.Module:
    """A freshly initialised target (fp32 master weights) on ``device``."""
    torch.manual_seed(seed)
    if isinstance(config, Qwen3Config):
        model: nn.Module = Qwen3ForCausalLM(config)
    else:
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(config)
    return model.to(device)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config (a multimodal config holds it as ``text_config``)."""
    return getattr(config, "text_config", None) or config


class WindowSampler:
    """Non-overlapping windows of a token stream, in a new shuffled order each epoch.

    Each epoch starts at a fresh random offset, so window edges move between epochs.
    """

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        self.n_tokens = n_tokens
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.pending = torch.zeros(0, dtype=torch.long)
        self.epochs = 0
        self.windows_per_epoch = max((n_tokens - seq_len) // seq_len, 1)

    def _refill(self) -> None:
        offset = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
        count = max((self.n_tokens - offset) // self.seq_len, 1)
        starts = offset + torch.arange(count) * self.seq_len
        starts = starts[starts + self.seq_len <= self.n_tokens]
        order = torch.randperm(starts.numel(), generator=self.gen)
        self.pending = torch.cat([self.pending, starts[order]])
        self.epochs += 1

    def next(self, batch: int) -> torch.Tensor:
        """``batch`` window starts (CPU int64)."""
        while self.pending.numel() < batch:
            self._refill()
        out, self.pending = self.pending[:batch], self.pending[batch:]
        return out


@dataclass
class TrainResult:
    """What a training phase did: steps, time, the logged loss curve."""

    steps: int
    max_steps: int
    time_s: float
    time_capped: bool
    curve: list[tuple[int, float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """The last logged loss (NaN if none)."""
        return self.curve[-1][1] if self.curve else float("nan")


#: How much above the floor the in-training margin must be to stop: the final check is on the
#: bf16 model as saved, and on more prompts.
DECISIVE_HEADROOM = 1.1


def train_target(
    model: nn.Module,
    stream: torch.Tensor,
    cfg: RecipeConfig,
    log: Log,
    decisiveness: Callable[[], float] | None = None,
) -> TrainResult:
    """Train on windows of ``stream`` (a 1-D token tensor on the model's device).

    The first optimizer step runs outside the time cap: it compiles the kernels (Triton's autotuning
    of flash-linear-attention's, on a GPU), which says nothing about how long training takes. Its
    seconds are reported apart (``first_step_s``). The main phase then follows the learning-rate
    schedule to ``target_time_cap_s`` (or the step count). Then, given ``decisiveness`` (the median
    top-2 logit margin of the model's greedy choices) and ``target_extra_time_s``, training goes on
    at the schedule's last rate, checked every ``target_check_every_s`` (at least one step between
    two checks; the extra time counted from the end of the first check), until the margin clears
    ``min_target_margin`` with ``DECISIVE_HEADROOM`` or the extra time is spent: the recipe asks for
    a decisive target, not a number of steps. Returns the phase summary (``time_s``: the whole
    phase, first step included); the model is trained in place.
    """
    device = stream.device
    seq = cfg.target_seq_len
    sampler = WindowSampler(stream.numel(), seq, cfg.seed + 101)
    if cfg.target_max_steps > 0:
        max_steps = cfg.target_max_steps
    else:
        max_steps = math.ceil(cfg.target_epochs * sampler.windows_per_epoch / cfg.target_batch)
    opt = make_adamw(model, cfg.target_lr, cfg.weight_decay)
    offsets = torch.arange(seq, device=device)
    budget = Budget(max_steps, cfg.target_time_cap_s)
    log(
        logger,
        f"target: {max_steps} steps of {cfg.target_batch}x{seq} tokens "
        f"({sampler.windows_per_epoch} windows per epoch), cap {cfg.target_time_cap_s:.0f}s",
    )
    curve: list[tuple[int, float]] = []
    running = torch.zeros((), device=device)
    count = 0
    step = 0

    def train_step(lr: float, last: bool) -> None:
        nonlocal count, step
        set_lr(opt, lr)
        starts = sampler.next(cfg.target_batch).to(device, non_blocking=True)
        x = stream[starts[:, None] + offsets]
        with amp(device):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running.add_(loss.detach().float())
        count += 1
        step += 1
        if step % cfg.log_every == 0 or last:
            value = float((running / count).item())  # one sync per log line, not per step
            curve.append((step, value))
            running.zero_()
            count = 0
            of = f"/{max_steps}" if step <= max_steps else " (until decisive)"
            log(logger, f"target step {step}{of} loss {value:.4f} ({budget.elapsed():.1f}s)")
            if not math.isfinite(value):
                raise TrainingError(f"target loss is {value} at step {step}")

    model.train()
    started = time.perf_counter()
    first_step_s = 0.0
    if not budget.done(0):
        train_step(
            cfg.target_lr * lr_factor(0.0, cfg.warmup_frac, cfg.min_lr_ratio), budget.done(1)
        )
        sync(device)
        first_step_s = time.perf_counter() - started
        log(logger, f"target: first step (kernel compile) {first_step_s:.1f}s")
        # The cap's clock starts now, with the compiled kernels.
        budget = Budget(max_steps, cfg.target_time_cap_s)
    while not budget.done(step):
        progress = budget.progress(step)
        train_step(
            cfg.target_lr * lr_factor(progress, cfg.warmup_frac, cfg.min_lr_ratio),
            budget.done(step + 1),
        )
    main_steps, main_s = step, budget.elapsed()
    checks: list[tuple[float, float]] = []
    if decisiveness is not None and cfg.target_extra_time_s > 0:
        goal = cfg.min_target_margin * DECISIVE_HEADROOM
        extra: Budget | None = None
        while True:
            with eval_mode(model):
                margin = decisiveness()
            checks.append((round(time.perf_counter() - started, 1), margin))
            log(logger, f"target: median greedy margin {margin:.3f} (goal {goal:.3f})")
            if margin >= goal or (extra is not None and extra.done(0)):
                break
            # The extra time's clock starts after the first check, as the cap's after the
            # first step: the first greedy run compiles the decoding kernels, and counted in,
            # it could spend the whole extra time with no step trained.
            if extra is None:
                extra = Budget(1 << 62, cfg.target_extra_time_s)
            left = extra.time_s - extra.elapsed()
            block = Budget(1 << 62, max(min(cfg.target_check_every_s, left), 1e-3), min_steps=1)
            model.train()
            done_here = 0
            while not block.done(done_here):
                train_step(cfg.target_lr * cfg.min_lr_ratio, False)
                done_here += 1
    return TrainResult(
        steps=step,
        max_steps=max_steps,
        time_s=time.perf_counter() - started,
        time_capped=budget.time_capped(main_steps),
        curve=curve,
        extra={
            "epochs_seen": step * cfg.target_batch / sampler.windows_per_epoch,
            "first_step_s": first_step_s,
            "main_phase_steps": main_steps,
            "main_phase_s": main_s,
            "margin_checks": checks,
        },
    )


@torch.inference_mode()
def eval_loss(
    model: nn.Module, stream: torch.Tensor, seq_len: int, max_tokens: int, batch: int
) -> float:
    """Mean next-token loss (nats) over evenly spread windows of ``stream``."""
    total_windows = (stream.numel() - 1) // seq_len
    if total_windows < 1:
        return float("nan")
    n = max(1, min(total_windows, max_tokens // seq_len))
    starts = torch.linspace(0, total_windows - 1, n).long().to(stream.device) * seq_len
    offsets = torch.arange(seq_len, device=stream.device)
    total = torch.zeros((), dtype=torch.float64, device=stream.device)
    count = 0
    device = stream.device
    with eval_mode(model):
        for i in range(0, n, batch):
            x = stream[starts[i : i + batch, None] + offsets]
            with amp(device):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                x[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += loss.double()
            count += x[:, 1:].numel()
    return float(total.item() / count)


@torch.inference_mode()
def greedy_generate(
    model: nn.Module, prompts: torch.Tensor, new_tokens: int, with_margins: bool = False
) -> Any:
    """The target's greedy continuation (``new_tokens`` ids per row) of equal-length prompts.

    A plain KV-cached loop, without ``generate``'s stopping rules: it never stops at EOT.
    ``with_margins``: also each choice's top-2 logit margin (float32, same shape), what a
    lossless comparison needs to tell a near-tie from a wrong token.
    """
    produced: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> torch.Tensor:
        if with_margins:
            top = logits.float().topk(2, dim=-1).values
            margins.append(top[:, 0] - top[:, 1])
        nxt = logits.argmax(-1)
        produced.append(nxt)
        return nxt

    with eval_mode(model):
        out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        nxt = choose(out.logits[:, -1])
        for _ in range(new_tokens - 1):
            out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            nxt = choose(out.logits[:, -1])
    tokens = torch.stack(produced, dim=1)
    return (tokens, torch.stack(margins, dim=1)) if with_margins else tokens


@torch.inference_mode()
def features_and_greedy(
    model: nn.Module, ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context features and the target's argmax at every position of ``ids`` (one forward).

    Returns ``(features, greedy_next)``: features are ``extract_context_feature`` of
    the HF hidden states (``hidden_states[id + 1]`` for each id, concatenated);
    ``greedy_next[:, t]`` is the target's greedy choice for position ``t + 1``.
    """
    with eval_mode(model):
        out = model(input_ids=ids, output_hidden_states=True)
        feats = extract_context_feature(list(out.hidden_states), layer_ids)
        greedy = out.logits.argmax(-1)
    return feats, greedy
