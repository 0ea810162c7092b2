"""The recipe's stages in order, in the training interpreter: the tokenizer, the target (trained,
saved in bf16 and loaded back), the prompts, the drafter's data, the drafter, the reload check
and the reference's acceptance; then the run's summary. Heavy imports happen inside each stage.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..errors import TrainingError
from .common import Log, RunPaths, sha256_file, write_json
from .config import RECIPE_VERSION, RecipeConfig
from .corpus import DRAFT, HELDOUT, SPLITS, TRAIN, Corpus

logger = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    """Versions of the interpreter and the packages the run used."""
    import tokenizers
    import torch
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    # dflash unpacked onto PYTHONPATH has no metadata; flash-linear-attention is optional
    # (a hybrid target trains on transformers' reference Gated DeltaNet without it), and
    # Triton decides whether its kernels train at all (its gated backward refuses Hopper
    # under Triton < 3.7.1).
    for name, dist in (
        ("dflash", "dflash"),
        ("flash_linear_attention", "flash-linear-attention"),
        ("triton", "triton"),
    ):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = "unknown" if name == "dflash" else "absent"
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
    return out


def _quiet_transformers() -> None:
    """No progress bars from transformers' save and load (the log says what happened)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))


@dataclass
class _Laps:
    """Each stage's wall seconds, the device synchronised first."""

    device: Any
    timings: dict[str, float]
    clock: float

    def __call__(self, name: str) -> None:
        from .torchutil import sync

        sync(self.device)
        now = time.perf_counter()
        self.timings[name] = round(now - self.clock, 2)
        self.clock = now


@dataclass
class _Tokens:
    tok: Any
    split_docs: dict[str, list[Any]]
    streams: dict[str, Any]
    info: dict[str, Any]


def _tokenize(cfg: RecipeConfig, corpus: Corpus, work: RunPaths, log: Log) -> _Tokens:
    """The tokenizer, trained on the target's training split only, and the corpus encoded."""
    from .tokenizer import (
        EOT_ID,
        MASK_ID,
        encode_texts,
        join_documents,
        save_hf_tokenizer,
        tokenizer_digest,
        train_tokenizer,
    )

    train_files = corpus.of_split(TRAIN)
    tok = train_tokenizer(
        (f.text for f in train_files), cfg.vocab_size, qwen3_5=cfg.arch == "hybrid"
    )
    if tok.get_vocab_size() > cfg.vocab_size:
        raise TrainingError(f"tokenizer has {tok.get_vocab_size()} tokens > {cfg.vocab_size}")
    docs = encode_texts(tok, [f.text for f in corpus.files])
    split_docs = {
        s: [d for f, d in zip(corpus.files, docs, strict=True) if f.split == s] for s in SPLITS
    }
    streams = {s: join_documents(split_docs[s]) for s in SPLITS}
    save_hf_tokenizer(tok, work.target, model_max_length=cfg.max_position_embeddings)
    n_bytes = sum(len(f.text.encode("utf-8")) for f in corpus.files)
    tokenizer_info = {
        "vocab_size": tok.get_vocab_size(),
        "digest": tokenizer_digest(tok),
        "bytes_per_token": n_bytes / max(sum(d.size for d in docs), 1),
        "eot_id": EOT_ID,
        "mask_id": MASK_ID,
    }
    log(
        logger,
        f"tokenizer: {tokenizer_info}; stream tokens "
        + ", ".join(f"{s} {streams[s].size}" for s in SPLITS),
    )
    return _Tokens(tok, split_docs, streams, tokenizer_info)


def _saved_in_bf16(model: Any, folder: Path, load: Any, device: Any) -> tuple[Any, bool]:
    """``model`` cast to bf16, saved into ``folder`` and loaded back, and whether the loaded
    weights are the saved ones."""
    import torch

    from .checkpoints import same_weights
    from .torchutil import cast_parameters

    cast_parameters(model, torch.bfloat16)
    model.save_pretrained(folder)
    loaded = load(folder, device)
    return loaded, same_weights(loaded, model)


@dataclass
class _Target:
    model: Any
    config: Any
    result: Any
    losses: dict[str, float]
    equal: bool


def _train_target(
    cfg: RecipeConfig,
    tokens: _Tokens,
    prompts: list[Any],
    work: RunPaths,
    device: Any,
    log: Log,
    lap: _Laps,
) -> _Target:
    """The target trained, saved in bf16 and loaded back, and its losses."""
    import numpy as np
    import torch

    from .checkpoints import load_target
    from .reference_accept import plain_greedy
    from .target import build_target, eval_loss, target_config, train_target
    from .torchutil import count_params

    streams = tokens.streams
    tconf = target_config(cfg, cfg.vocab_size)
    target = build_target(tconf, cfg.seed, device)
    log(
        logger,
        f"target: {count_params(target) / 1e6:.1f}M parameters, "
        f"attention {getattr(target.config, '_attn_implementation', '?')}",
    )
    on_device = {s: torch.from_numpy(streams[s].astype(np.int64)).to(device) for s in SPLITS}

    def decisiveness() -> float:
        return statistics.median(plain_greedy(cfg, target, prompts, {}).all_margins())

    tres = train_target(
        target, on_device[TRAIN], cfg, log, decisiveness if cfg.min_target_margin else None
    )
    lap("target_train")
    # Saved in bf16, then loaded back: everything after this (drafter data, losses, the
    # reference) uses exactly the target vLLM will load. Only parameters are cast: RoPE's
    # inv_freq stays fp32 as from_pretrained keeps it (a bf16 inv_freq shifts the phases).
    target, target_equal = _saved_in_bf16(target, work.target, load_target, device)
    losses = {
        s: eval_loss(target, on_device[s], cfg.target_seq_len, cfg.eval_tokens, cfg.target_batch)
        for s in SPLITS
    }
    log(logger, "target loss (bf16): " + ", ".join(f"{s} {v:.4f}" for s, v in losses.items()))
    del on_device
    lap("target_eval_save")
    return _Target(target, tconf, tres, losses, target_equal)


def _write_prompts(
    cfg: RecipeConfig,
    digest: str,
    tokens: _Tokens,
    prompts: list[Any],
    target: Any,
    work: RunPaths,
    log: Log,
) -> Any:
    """prompts.json: the held-out prompts and the most decisive lossless ones; returns the
    lossless choice."""
    from .checked import NEAR_TIE, choose_decisive, engine_settings, lossless_slots
    from .reference_accept import greedy_margins

    tok = tokens.tok
    prompts_doc = {
        "format": 1,
        "recipe_digest": digest,
        "tokenizer_digest": tokens.info["digest"],
        "prompt_len": cfg.prompt_len,
        "max_new_tokens": cfg.max_new_tokens,
        "num_speculative_tokens": cfg.block_size - 1,
        "prompts": [
            {
                "id": p.id,
                "file": p.file,
                "token_offset": p.token_offset,
                "token_ids": p.token_ids,
                "text": _decode(tok, p.token_ids),
            }
            for p in prompts
        ],
    }
    engine = engine_settings(cfg.max_position_embeddings)
    slots = lossless_slots(
        tokens.streams[HELDOUT],
        cfg.speculative_tokens,
        engine,
        cfg.lossless_new_tokens,
        cfg.seed + 505,
        cfg.lossless_candidates,
    )
    chosen = choose_decisive(slots, lambda batch: greedy_margins(target, batch))
    log(
        logger,
        f"lossless prompts: the most decisive of {cfg.lossless_candidates} windows each; "
        f"greedy choices within {NEAR_TIE} of a tie: {chosen.near_ties}",
    )
    prompts_doc["speculative_tokens"] = list(cfg.speculative_tokens)
    prompts_doc["engine"] = engine
    prompts_doc["lossless"] = [c.to_json() for c in chosen.prompts]
    prompts_doc["lossless_choice"] = {
        "candidates": cfg.lossless_candidates,
        "near_tie": NEAR_TIE,
        "near_ties": chosen.near_ties,
    }
    write_json(work.prompts, prompts_doc)
    return chosen


def _drafter_data(
    cfg: RecipeConfig, streams: dict[str, Any], target: Any, device: Any, log: Log
) -> tuple[Any, dict[str, Any], Any]:
    """The target's greedy continuations (half from files it never saw) the drafter trains on,
    their figures, and the held-out continuations it is evaluated on."""
    import numpy as np

    from .drafter_data import build_drafter_data, sample_windows

    rng = np.random.default_rng(cfg.seed + 404)
    n_unseen = round(cfg.data_sequences * cfg.data_unseen_fraction)
    data_prompts = np.concatenate(
        [
            sample_windows(streams[DRAFT], n_unseen, cfg.data_prompt_len, rng),
            sample_windows(streams[TRAIN], cfg.data_sequences - n_unseen, cfg.data_prompt_len, rng),
        ]
    )
    layer_ids = list(cfg.target_layer_ids)

    def continuations(prompts: Any, **limit: float) -> tuple[Any, dict[str, Any]]:
        return build_drafter_data(
            target,
            prompts,
            cfg.data_gen_len,
            layer_ids,
            cfg.gen_batch,
            cfg.feature_batch,
            device,
            log,
            **limit,
        )

    data, data_stats = continuations(data_prompts, time_cap_s=cfg.data_time_cap_s)
    eval_prompts = sample_windows(
        streams[HELDOUT], cfg.data_eval_sequences, cfg.data_prompt_len, rng
    )
    eval_data, _ = continuations(eval_prompts)
    log(logger, f"drafter data: {data_stats}")
    return data, data_stats, eval_data


@dataclass
class _Drafter:
    model: Any
    result: Any
    cap: float
    proxy: Any
    trained_diff: float
    equal: bool


def _train_drafter(
    cfg: RecipeConfig,
    target: _Target,
    data: Any,
    eval_data: Any,
    work: RunPaths,
    deadline: float,
    device: Any,
    log: Log,
    lap: _Laps,
) -> _Drafter:
    """The drafter trained within what is left of the budget, saved in bf16 and loaded back,
    and evaluated on the held-out continuations."""

    from .checkpoints import load_drafter
    from .drafter import build_drafter, check_on_data, drafter_config, evaluate_drafter
    from .drafter import train_drafter as train
    from .tokenizer import MASK_ID
    from .torchutil import count_params

    dconf = drafter_config(cfg, target.config, MASK_ID)
    drafter = build_drafter(dconf, cfg.seed + 1, device)
    left = deadline - time.perf_counter() - cfg.reserve_s
    cap = cfg.drafter_cap_s(left)
    over = f" ({cap - left:.0f}s over the wall budget)" if cap > left else ""
    log(logger, f"drafter: {count_params(drafter) / 1e6:.1f}M params; time cap {cap:.0f}s{over}")
    dres = train(drafter, target.model, data, cfg, cap, log)
    lap("drafter_train")
    drafter, drafter_equal = _saved_in_bf16(drafter, work.drafter, load_drafter, device)
    proxy = evaluate_drafter(drafter, target.model, eval_data, cfg.block_size)
    log(logger, f"drafter proxy on held-out continuations: {proxy}")
    trained_diff = check_on_data(drafter, target.model, eval_data)
    log(
        logger,
        f"drafter: multi-block vs reference forward on held-out data (bf16) max |diff| "
        f"{trained_diff:.3g}",
    )
    return _Drafter(drafter, dres, cap, proxy, trained_diff, drafter_equal)


def train_into(
    cfg: RecipeConfig,
    corpus: Corpus,
    digest: str,
    work: RunPaths,
    final: RunPaths,
    device_name: str | None,
    deadline: float,
    log: Log,
) -> dict[str, Any]:
    """The recipe's stages, writing into ``work``. Returns the summary (without wall time)."""
    import torch

    from .checkpoints import check_saved
    from .floors import drafter_floor, target_floor
    from .preflight import preflight
    from .reference_accept import plain_greedy, reference_summary, select_prompts
    from .torchutil import pick_device, seed_everything

    began = time.perf_counter()
    _quiet_transformers()
    device = pick_device(device_name)
    lap = _Laps(device, {}, began)
    seed_everything(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parts stay fp32; bf16 does the work
    log(logger, f"recipe {digest} on {device}; corpus {corpus.root}: {corpus.stats()}")
    pre = preflight(cfg, device, log)
    lap("preflight")

    tokens = _tokenize(cfg, corpus, work, log)
    lap("tokenizer")

    # Held-out prompts for the reference and for vLLM.
    heldout_files = corpus.of_split(HELDOUT)
    prompts = select_prompts(
        heldout_files, tokens.split_docs[HELDOUT], cfg.num_prompts, cfg.prompt_len, cfg.seed + 303
    )
    target = _train_target(cfg, tokens, prompts, work, device, log, lap)
    chosen = _write_prompts(cfg, digest, tokens, prompts, target.model, work, log)
    # The target's floor first: a target that is not decisive makes the rest worthless.
    plain = plain_greedy(cfg, target.model, prompts, chosen.margins)
    floors = target_floor(cfg, plain, log)
    lap("target_floor")

    data, data_stats, eval_data = _drafter_data(cfg, tokens.streams, target.model, device, log)
    lap("drafter_data")

    drafter = _train_drafter(cfg, target, data, eval_data, work, deadline, device, log, lap)
    del data, eval_data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    lap("drafter_save_eval")

    reload_info = check_saved(work.target, work.drafter, drafter.model, tokens.tok, log)
    reload_info.update({"target_equal": target.equal, "drafter_equal": drafter.equal})
    if not (target.equal and drafter.equal):
        raise TrainingError(f"saved models do not reload identically: {reload_info}")
    reference = reference_summary(cfg, target.model, drafter.model, plain, prompts, log)
    write_json(work.reference, reference.pop("document"))
    floors.update(drafter_floor(cfg, reference, log))
    lap("reference")
    return {
        "recipe_digest": digest,
        "recipe_version": RECIPE_VERSION,
        "output_dir": str(final.root),
        "paths": {
            "target": str(final.target),
            "drafter": str(final.drafter),
            "prompts": str(final.prompts),
            "reference": str(final.reference),
        },
        "config": cfg.to_dict(),
        "versions": _versions(),
        "preflight": pre,
        "corpus": {
            "root": corpus.root,
            "digest": corpus.digest,
            "files_skipped": corpus.skipped,
            "splits": corpus.stats(),
            "tokens": {s: int(tokens.streams[s].size) for s in SPLITS},
        },
        "tokenizer": tokens.info,
        "target": _target_summary(target),
        "drafter_data": data_stats,
        "drafter": _drafter_summary(drafter),
        "reload": reload_info,
        "reference": reference,
        "floors": floors,
        "weights_sha256": {
            "target": sha256_file(work.target / "model.safetensors"),
            "drafter": sha256_file(work.drafter / "model.safetensors"),
        },
        "vllm": {
            "target": str(final.target),
            "speculative_config": {
                "method": "dflash",
                "model": str(final.drafter),
                "num_speculative_tokens": cfg.block_size - 1,
            },
            "sampling": {"temperature": 0.0, "max_tokens": cfg.max_new_tokens, "ignore_eos": True},
            "prompts": str(final.prompts),
        },
        "timings_s": lap.timings,
    }


def _target_summary(target: _Target) -> dict[str, Any]:
    from .torchutil import count_params

    tres, losses = target.result, target.losses
    return {
        "parameters": count_params(target.model),
        "steps": tres.steps,
        "max_steps": tres.max_steps,
        "epochs_seen": tres.extra.get("epochs_seen"),
        "first_step_s": tres.extra.get("first_step_s"),
        "main_phase_steps": tres.extra.get("main_phase_steps"),
        "main_phase_s": tres.extra.get("main_phase_s"),
        "margin_checks": tres.extra.get("margin_checks"),
        "time_s": round(tres.time_s, 2),
        "time_capped": tres.time_capped,
        "final_train_loss": tres.final_loss,
        "loss_curve": tres.curve,
        "eval_loss_bf16": losses,
        "heldout_loss": losses[HELDOUT],
        "train_minus_heldout_gap": losses[HELDOUT] - losses[TRAIN],
    }


def _drafter_summary(drafter: _Drafter) -> dict[str, Any]:
    from .torchutil import count_params

    dres = drafter.result
    return {
        "parameters": count_params(drafter.model),
        "steps": dres.steps,
        "max_steps": dres.max_steps,
        "time_s": round(dres.time_s, 2),
        "time_cap_s": round(drafter.cap, 1),
        "time_capped": dres.time_capped,
        "final_loss": dres.final_loss,
        "loss_curve": dres.curve,
        "train_accuracy": dres.extra,
        "heldout_proxy": drafter.proxy,
        "equivalence_bf16_max_abs_diff": drafter.trained_diff,
    }
