"""Before anything starts: which vLLM the serving interpreter imports, what would stop the
run minutes later, and the GPUs it sees (``serving.preflight`` runs in that interpreter)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import log_tail, run_child
from .config import RAY_VERSION, GpuFacts, SmokeConfig
from .serving.tiny import TinySpec

logger = logging.getLogger(__name__)

MODULE = "tooling.smoke.serving.preflight"


def run_preflight(
    python: str,
    workdir: Path,
    env: Mapping[str, str],
    timeout_s: float,
    config: SmokeConfig,
) -> dict[str, Any]:
    """Which vLLM the children import, and what would stop the run minutes later; it
    also fills the run's cache with vLLM's view of the model classes."""
    log = workdir / "logs" / "vllm-import.log"
    out = workdir / "vllm-import.json"
    argv = [python, "-m", MODULE, str(out), json.dumps(model_architectures(config))]
    if config.engine.distributed_executor_backend == "ray":
        argv.append("--ray")
    logger.debug("preflight: which vLLM %s imports (log: %s)", python, log)
    result = run_child(argv, log=log, env=env, timeout_s=timeout_s)
    if result.returncode != 0 or not out.is_file():
        raise SmokeError(f"{python} cannot import vllm: {log_tail(log)} (log: {log})")
    info: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    problem = preflight_problem(info, config, python)
    if problem:
        raise SmokeError(f"{problem} (log: {log})")
    return info


def query_gpus(python: str, workdir: Path, env: Mapping[str, str], timeout_s: float) -> GpuFacts:
    """The GPUs ``python`` sees, by torch alone (a dry run's plan needs no vLLM)."""
    log = workdir / "logs" / "gpus.log"
    out = workdir / "gpus.json"
    run_child(
        [python, "-m", MODULE, str(out), "--gpus-only"], log=log, env=env, timeout_s=timeout_s
    )
    try:
        info: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {"gpus": None, "gpu_error": log_tail(log)}
    facts = gpu_facts(info)
    if facts is None:
        raise SmokeError(
            f"{python} cannot query the GPUs ({info.get('gpu_error') or 'none visible'}): "
            "give --gpus COUNTxGIB to plan without them"
        )
    return facts


def gpu_facts(info: dict[str, Any]) -> GpuFacts | None:
    """The GPUs a preflight saw (the smallest one's memory for each), or None when none."""
    gpus = info.get("gpus")
    if not gpus:
        return None
    return GpuFacts(len(gpus), min(int(g["total"]) for g in gpus))


def model_architectures(config: SmokeConfig) -> list[str]:
    """The model classes the run's engines resolve: the tiny pair's, or those the
    given folders' config.json name (none for a hub id: vLLM then asks itself)."""
    if config.tiny:
        return list(TinySpec.for_arch(config.tiny_arch).architectures)
    names: list[str] = []
    for folder in (config.target, config.drafter):
        try:
            data = json.loads(Path(str(folder), "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        names += [n for n in data.get("architectures") or [] if isinstance(n, str)]
    return names


def preflight_problem(info: dict[str, Any], config: SmokeConfig, python: str) -> str | None:
    """The first thing the preflight found that the run cannot start with (pure)."""
    gpus = info.get("gpus")
    if gpus is None:
        return f"{python} cannot query the GPUs: {info.get('gpu_error')}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if not gpus:
        return f"no CUDA GPU is visible to {python} (CUDA_VISIBLE_DEVICES={visible})"
    if config.engine.distributed_executor_backend == "ray" and info.get("ray_error"):
        return (
            f"--distributed-executor-backend ray: vLLM's Ray executor cannot start for {python} "
            f"({info['ray_error']}): install ray=={RAY_VERSION} there (the bundle's --extra "
            f"ray=={RAY_VERSION}: ci/gpu/make-parts.sh RAY=1)"
        )
    if config.gpus is not None and len(gpus) < config.gpus.count:
        return f"--gpus names {config.gpus.count} GPUs; {len(gpus)} visible"
    share = config.engine.gpu_memory_utilization
    free, total = gpus[0]["free"], gpus[0]["total"]
    if free < share * total:
        return (
            f"GPU 0 has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; vLLM needs "
            f"--gpu-memory-utilization {share} of it ({share * total / 2**30:.1f} GiB) free "
            "to start an engine"
        )
    if config.run_fidelity and not config.quick and info.get("dflash_error"):
        return (
            f"the reference package dflash does not import for {python} "
            f"({info['dflash_error']}): install dflash==0.1.0 there, or pass --no-fidelity"
        )
    return None
