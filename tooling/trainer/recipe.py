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
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import EnvironmentProblem, TrainSettingsError
from ..paths import CacheLayout, default_cache_dir
from .api import TrainedPair, TrainRequest, finished_summary
from .common import Log, RunPaths, StopRequest, write_json
from .config import RecipeConfig, recipe_digest
from .corpus import SPLITS, TRAIN, Corpus, load_corpus
from .stages import train_into

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent


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
        log(logger, f"cached: {final.root} (pass --force to retrain)")
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
        summary = train_into(cfg, corpus, digest, work, final, request.device, deadline, log)
        summary["wall_s"] = time.perf_counter() - t_start
        write_json(work.summary, summary)
        log(logger, f"done in {summary['wall_s']:.1f}s: {final.root}")
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
