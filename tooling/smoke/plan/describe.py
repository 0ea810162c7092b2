"""The plan for a config: the pair's figures read (a pair the smoke cannot serve, or a generated
pair the disk cannot hold, refused in one line before anything starts) and ``describe_plan``,
what a run would execute (``--dry-run``), for the GPUs given or those the serving interpreter
sees."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

from ...errors import SmokeCapacityError
from ..config import SmokeConfig
from ..pair import GIB, PairFacts, read_pair, tiny_pair
from ..preflight import query_gpus
from ..server import child_environment
from .make import plan_smoke
from .model import SmokePlan

logger = logging.getLogger(__name__)

GPU_QUERY_S = 60.0


def pair_facts(config: SmokeConfig) -> PairFacts:
    """The pair's figures: the tiny pair's from its configs, a given one's from its folders
    (SmokePairError, one line, when the smoke cannot serve it)."""
    config.validate()
    if config.tiny:
        root = config.workdir.resolve() / "models"
        return tiny_pair(config.tiny_arch, config.tiny_hidden_size, root)
    assert config.target and config.drafter
    return read_pair(config.target, config.drafter)


def pair_to_run(config: SmokeConfig) -> PairFacts:
    """``pair_facts``, and for a pair the run generates, the disk under the workdir checked
    against it: what a dry run and a run both refuse before anything starts."""
    pair = pair_facts(config)
    if config.tiny:
        check_models_disk(config.workdir.resolve() / "models", pair)
    return pair


MODELS_DISK_HEADROOM = 2 * GIB
"""Disk beyond a generated pair's weights: its tokenizer, the run's logs and compile caches."""


def check_models_disk(root: Path, pair: PairFacts) -> None:
    """Refuse a generated pair the disk under ``root`` cannot hold, in one line with both
    figures, before anything is written: at the seed's width the pair is about 57 GB, and a
    disk that fills half-way through its weights leaves a broken pair and no verdict."""
    weights = pair.target.weight_bytes + pair.drafter.weight_bytes
    need = weights + MODELS_DISK_HEADROOM
    existing = root
    while not existing.exists():
        existing = existing.parent
    # An earlier run's pair in the same workdir is written over, so its bytes are free too.
    earlier = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
    free = shutil.disk_usage(existing).free + earlier
    if need > free:
        raise SmokeCapacityError(
            f"{root}: the generated pair needs {need / GIB:.1f} GiB of disk ({weights / GIB:.1f} "
            f"GiB of weights, {MODELS_DISK_HEADROOM / GIB:.0f} for logs and caches); "
            f"{free / GIB:.1f} GiB free there"
        )


def describe_plan(config: SmokeConfig) -> SmokePlan:
    """The plan ``run_smoke`` would execute, starting no engine (``--dry-run``). The GPUs are
    ``config.gpus``, else what torch sees in the serving interpreter."""
    pair = pair_to_run(config)
    gpus = config.gpus
    if gpus is None:
        python = config.python or sys.executable
        # The query's files go to a scratch folder: a plan writes nothing (a failed query
        # names the log's last lines).
        with tempfile.TemporaryDirectory(prefix="smoke-plan-") as scratch:
            logger.debug("no --gpus: asking %s which GPUs torch sees", python)
            gpus = query_gpus(python, Path(scratch), child_environment(), GPU_QUERY_S)
    plan = plan_smoke(config, pair, gpus)
    logger.debug("plan: %s: %s", plan.layout, plan.why)
    return plan
