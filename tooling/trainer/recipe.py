"""The recipe: corpus -> tokenizer -> target -> drafter -> save -> reload -> reference acceptance.

``train`` writes ``<cache>/trained/<digest>/`` (``target/``, ``drafter/``,
``prompts.json``, ``reference.json``, ``summary.json``, ``recipe.json``,
``train.log``) into a temporary sibling first and renames it at the end, so a
folder under its digest is always complete. The digest covers the settings,
the corpus and this package's code; a complete folder is reused unless forced.

Heavy imports (torch, transformers, dflash) happen inside the stages, so
``digest_info`` works with the standard library and ``tokenizers`` alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..errors import EnvironmentProblem, TrainingError, TrainSettingsError
from ..paths import CacheLayout, default_cache_dir
from .api import TrainedPair, TrainRequest, finished_summary
from .common import Log, StopRequest, sha256_file, write_json
from .config import RECIPE_VERSION, RecipeConfig, recipe_digest
from .corpus import DRAFT, HELDOUT, SPLITS, TRAIN, Corpus, load_corpus

PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class RunPaths:
    """The files of one run folder."""

    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.json"

    @property
    def reference(self) -> Path:
        return self.root / "reference.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.json"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    def complete(self) -> bool:
        """Whether the folder holds a finished run (the summary is written last)."""
        return self.summary.is_file() and self.target.is_dir() and self.drafter.is_dir()


def code_digest() -> str:
    """sha256 of this package's Python files, so changed code means a new run folder."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def trained_root(cache_dir: Path | None) -> Path:
    """Where run folders live: the cache's ``trained/`` (tooling's cache, ``tooling.paths``)."""
    return CacheLayout(
        cache_dir if cache_dir is not None else default_cache_dir(os.environ)
    ).trained


def _load_corpus(cfg: RecipeConfig) -> Corpus:
    return load_corpus(
        seed=cfg.seed,
        heldout_fraction=cfg.heldout_fraction,
        draft_fraction=cfg.draft_fraction,
        max_files=cfg.max_files,
        max_file_bytes=cfg.max_file_bytes,
    )


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


def _require_packages() -> None:
    """Fail early, with one clear message, when a needed package is missing."""
    missing = []
    for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "dflash"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise EnvironmentProblem(
            f"missing Python packages: {', '.join(missing)} "
            "(dflash: pip download dflash==0.1.0 --no-deps, unpack, put on PYTHONPATH)"
        )


def _quiet_transformers() -> None:
    """No progress bars from transformers' save and load (the log says what happened)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))


def train(request: TrainRequest, log: Log) -> TrainedPair:
    """Run the whole recipe in this interpreter (or reuse a complete run folder)."""
    t_start = time.perf_counter()
    cfg = request.config()
    request.check_out_dir()
    deadline = t_start + cfg.wall_budget_s
    # Nothing here imports torch: a finished run is reused in a second, without it.
    corpus = _load_corpus(cfg)
    digest = recipe_digest(cfg, corpus.digest, code_digest())
    final = RunPaths(
        request.out_dir if request.out_dir is not None else trained_root(request.cache_dir) / digest
    )
    export = request.export
    summary = None
    if not request.force and final.complete():
        summary = finished_summary(final.summary, users=request.out_dir is not None)
    if summary is not None and summary["recipe_digest"] == digest:
        log(f"cached: {final.root} (pass --force to retrain)")
        _export(final, export)
        return TrainedPair.from_summary(summary, cached=True)
    if summary is not None and request.out_dir is not None:
        # The user's folder holds another recipe's pair: neither reused nor replaced.
        raise TrainSettingsError(
            f"--out-dir {final.root}: holds the pair of recipe "
            f"{summary['recipe_digest']}, not this recipe's {digest} "
            "(pass --force to replace it)"
        )
    _require_packages()
    work = RunPaths(final.root.parent / f".{final.root.name}.tmp-{os.getpid()}")
    shutil.rmtree(work.root, ignore_errors=True)
    work.root.mkdir(parents=True)
    log.open(work.log)
    try:
        summary = _train_into(cfg, corpus, digest, work, final, request.device, deadline, log)
        summary["wall_s"] = time.perf_counter() - t_start
        write_json(work.summary, summary)
        log(f"done in {summary['wall_s']:.1f}s: {final.root}")
        StopRequest.check()
    except BaseException:
        log.close()
        if export is not None and work.log.is_file():
            export.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work.log, export / "train.log")
        shutil.rmtree(work.root, ignore_errors=True)
        raise
    log.close()
    if final.root.exists():
        shutil.rmtree(final.root)
    os.replace(work.root, final.root)
    _export(final, export)
    return TrainedPair.from_summary(summary, cached=False)


def _export(paths: RunPaths, export: Path | None) -> None:
    """Copy the small result files (not the weights) to ``export``."""
    if export is None:
        return
    export.mkdir(parents=True, exist_ok=True)
    for src in (paths.summary, paths.prompts, paths.reference, paths.log):
        if src.is_file():
            shutil.copy2(src, export / src.name)


def _train_into(
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
    import numpy as np
    import torch

    from .checked import NEAR_TIE, choose_decisive, engine_settings, lossless_slots
    from .checkpoints import check_saved, load_drafter, load_target, same_weights
    from .drafter import (
        build_drafter,
        check_on_data,
        drafter_config,
        evaluate_drafter,
        train_drafter,
    )
    from .drafter_data import build_drafter_data, sample_windows
    from .preflight import preflight
    from .reference_accept import (
        drafter_floor,
        greedy_margins,
        plain_greedy,
        reference_summary,
        select_prompts,
        target_floor,
    )
    from .target import build_target, eval_loss, target_config, train_target
    from .tokenizer import (
        EOT_ID,
        MASK_ID,
        encode_texts,
        join_documents,
        save_hf_tokenizer,
        tokenizer_digest,
        train_tokenizer,
    )
    from .torchutil import cast_parameters, count_params, pick_device, seed_everything, sync

    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        sync(device)
        now = time.perf_counter()
        timings[name] = round(now - clock, 2)
        clock = now

    _quiet_transformers()
    device = pick_device(device_name)
    seed_everything(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parts stay fp32; bf16 does the work
    log(f"recipe {digest} on {device}; corpus {corpus.root}: {corpus.stats()}")
    pre = preflight(cfg, device, log)
    lap("preflight")

    # Tokenizer: trained on the target's training split only.
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
        f"tokenizer: {tokenizer_info}; stream tokens "
        + ", ".join(f"{s} {streams[s].size}" for s in SPLITS)
    )
    lap("tokenizer")

    # Held-out prompts for the reference and for vLLM.
    heldout_files = corpus.of_split(HELDOUT)
    prompts = select_prompts(
        heldout_files, split_docs[HELDOUT], cfg.num_prompts, cfg.prompt_len, cfg.seed + 303
    )
    # Target.
    tconf = target_config(cfg, cfg.vocab_size)
    target = build_target(tconf, cfg.seed, device)
    log(
        f"target: {count_params(target) / 1e6:.1f}M parameters, "
        f"attention {getattr(target.config, '_attn_implementation', '?')}"
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
    cast_parameters(target, torch.bfloat16)
    target.save_pretrained(work.target)
    in_memory = target
    target = load_target(work.target, device)
    target_equal = same_weights(target, in_memory)
    del in_memory
    losses = {
        s: eval_loss(target, on_device[s], cfg.target_seq_len, cfg.eval_tokens, cfg.target_batch)
        for s in SPLITS
    }
    log("target loss (bf16): " + ", ".join(f"{s} {v:.4f}" for s, v in losses.items()))
    del on_device
    lap("target_eval_save")

    prompts_doc = {
        "format": 1,
        "recipe_digest": digest,
        "tokenizer_digest": tokenizer_info["digest"],
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
        streams[HELDOUT],
        cfg.speculative_tokens,
        engine,
        cfg.lossless_new_tokens,
        cfg.seed + 505,
        cfg.lossless_candidates,
    )
    chosen = choose_decisive(slots, lambda batch: greedy_margins(target, batch))
    log(
        f"lossless prompts: the most decisive of {cfg.lossless_candidates} windows each; "
        f"greedy choices within {NEAR_TIE} of a tie: {chosen.near_ties}"
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
    # The target's floor first: a target that is not decisive makes the rest worthless.
    plain = plain_greedy(cfg, target, prompts, chosen.margins)
    floors = target_floor(cfg, plain, log)
    lap("target_floor")

    # Drafter data: the target's greedy continuations (half from files it never saw).
    rng = np.random.default_rng(cfg.seed + 404)
    n_unseen = round(cfg.data_sequences * cfg.data_unseen_fraction)
    data_prompts = np.concatenate(
        [
            sample_windows(streams[DRAFT], n_unseen, cfg.data_prompt_len, rng),
            sample_windows(streams[TRAIN], cfg.data_sequences - n_unseen, cfg.data_prompt_len, rng),
        ]
    )
    layer_ids = list(cfg.target_layer_ids)
    data, data_stats = build_drafter_data(
        target,
        data_prompts,
        cfg.data_gen_len,
        layer_ids,
        cfg.gen_batch,
        cfg.feature_batch,
        device,
        log,
        time_cap_s=cfg.data_time_cap_s,
    )
    eval_prompts = sample_windows(
        streams[HELDOUT], cfg.data_eval_sequences, cfg.data_prompt_len, rng
    )
    eval_data, _ = build_drafter_data(
        target,
        eval_prompts,
        cfg.data_gen_len,
        layer_ids,
        cfg.gen_batch,
        cfg.feature_batch,
        device,
        log,
    )
    log(f"drafter data: {data_stats}")
    lap("drafter_data")

    # Drafter.
    dconf = drafter_config(cfg, tconf, MASK_ID)
    drafter = build_drafter(dconf, cfg.seed + 1, device)
    left = deadline - time.perf_counter() - cfg.reserve_s
    cap = min(cfg.drafter_time_cap_s, max(left, 0.25 * cfg.drafter_time_cap_s))
    log(f"drafter: {count_params(drafter) / 1e6:.1f}M parameters; time cap {cap:.0f}s")
    dres = train_drafter(drafter, target, data, cfg, cap, log)
    lap("drafter_train")
    cast_parameters(drafter, torch.bfloat16)
    drafter.save_pretrained(work.drafter)
    in_memory = drafter
    drafter = load_drafter(work.drafter, device)
    drafter_equal = same_weights(drafter, in_memory)
    del in_memory
    proxy = evaluate_drafter(drafter, target, eval_data, cfg.block_size)
    log(f"drafter proxy on held-out continuations: {proxy}")
    trained_diff = check_on_data(drafter, target, eval_data)
    log(
        f"drafter: multi-block vs reference forward on held-out data (bf16) max |diff| "
        f"{trained_diff:.3g}"
    )
    del data, eval_data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    lap("drafter_save_eval")

    reload_info = check_saved(work.target, work.drafter, drafter, tok, log)
    reload_info.update({"target_equal": target_equal, "drafter_equal": drafter_equal})
    if not (target_equal and drafter_equal):
        raise TrainingError(f"saved models do not reload identically: {reload_info}")
    rt, rd = target, drafter
    reference = reference_summary(cfg, rt, rd, plain, prompts, log)
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
            "tokens": {s: int(streams[s].size) for s in SPLITS},
        },
        "tokenizer": tokenizer_info,
        "target": {
            "parameters": count_params(rt),
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
        },
        "drafter_data": data_stats,
        "drafter": {
            "parameters": count_params(rd),
            "steps": dres.steps,
            "max_steps": dres.max_steps,
            "time_s": round(dres.time_s, 2),
            "time_cap_s": round(cap, 1),
            "time_capped": dres.time_capped,
            "final_loss": dres.final_loss,
            "loss_curve": dres.curve,
            "train_accuracy": dres.extra,
            "heldout_proxy": proxy,
            "equivalence_bf16_max_abs_diff": trained_diff,
        },
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
        "timings_s": timings,
    }


def digest_info(cfg: RecipeConfig, with_tokenizer: bool) -> dict[str, Any]:
    """Digests of the corpus split (and the tokenizer), for determinism checks."""
    corpus = _load_corpus(cfg)
    split_lists = {s: [f.relpath for f in corpus.of_split(s)] for s in SPLITS}
    out: dict[str, Any] = {
        "corpus_digest": corpus.digest,
        "split_digest": hashlib.sha256(json.dumps(split_lists).encode()).hexdigest(),
        "splits": corpus.stats(),
        "recipe_digest": recipe_digest(cfg, corpus.digest, code_digest()),
    }
    if with_tokenizer:
        from .tokenizer import tokenizer_digest, train_tokenizer

        tok = train_tokenizer(
            (f.text for f in corpus.of_split(TRAIN)), cfg.vocab_size, qwen3_5=cfg.arch == "hybrid"
        )
        out["tokenizer_digest"] = tokenizer_digest(tok)
        out["tokenizer_vocab_size"] = tok.get_vocab_size()
    return out
