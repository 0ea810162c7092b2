"""``vllm serve`` for the smoke: the command line (pure), the environment, and a managed server.

The server runs as ``python -m vllm.entrypoints.cli.main serve``: an install
with ``pip install --target`` has no ``vllm`` console script. It listens on
127.0.0.1 on a free port. ``started`` yields as soon as the process runs (several
servers can compile at once) and ``RunningServer.wait_healthy`` waits for
``/health``; leaving the block always stops the whole process group, keeping the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import StopOutcome, log_tail, start_group, stop_group
from . import client
from .config import EngineSettings

logger = logging.getLogger(__name__)

SERVED_MODEL_NAME = "smoke"
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class ServeOptions:
    """One server: the target, the drafter (None: no speculation), the shared engine flags."""

    target: str
    drafter: str | None
    engine: EngineSettings = field(default_factory=EngineSettings)
    prefix_caching: bool = True
    host: str = LOCALHOST
    port: int = 8000
    served_model_name: str = SERVED_MODEL_NAME
    language_model_only: bool = False
    gdn_prefill_backend: str | None = None
    """A multimodal target (Qwen3.5/3.6) served for text only: no vision tower, no processor."""
    extra_args: tuple[str, ...] = ()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def speculative_config(drafter: str, engine: EngineSettings) -> dict[str, Any]:
    """The ``--speculative-config`` value for a DFlash drafter."""
    return {
        "method": "dflash",
        "model": drafter,
        "num_speculative_tokens": engine.num_speculative_tokens,
        **dict(engine.speculative_options),
    }


def build_serve_command(options: ServeOptions, python: str | None = None) -> list[str]:
    """The argv that starts ``vllm serve`` for ``options`` with interpreter ``python``."""
    engine = options.engine
    cmd = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        options.target,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--served-model-name",
        options.served_model_name,
        # DFlash needs non-causal attention; FLASH_ATTN is the sm90 backend that
        # has it and the one whose sliding window is causal like the reference.
        "--attention-backend",
        engine.attention_backend,
        "--max-model-len",
        str(engine.max_model_len),
        "--gpu-memory-utilization",
        str(engine.gpu_memory_utilization),
        "--seed",
        str(engine.seed),
        "--kv-cache-dtype",
        engine.kv_cache_dtype,
        "--tensor-parallel-size",
        str(engine.tensor_parallel_size),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        # Greedy means greedy: no sampling defaults from the model's generation_config.
        "--generation-config",
        "vllm",
        # Per-request cached-token counts, evidence beside /metrics for the prefix check.
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if options.prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    if engine.block_size is not None:
        # None: vLLM picks (a hybrid target's attention blocks match the Mamba page).
        cmd += ["--block-size", str(engine.block_size)]
    if options.language_model_only:
        cmd.append("--language-model-only")
    if options.gdn_prefill_backend is not None:
        cmd += ["--gdn-prefill-backend", options.gdn_prefill_backend]
    if engine.enforce_eager:
        cmd.append("--enforce-eager")
    if engine.disable_custom_all_reduce:
        cmd.append("--disable-custom-all-reduce")
    backend = executor_backend(options)
    if backend is not None:
        cmd += ["--distributed-executor-backend", backend]
    if options.drafter is not None:
        spec = speculative_config(options.drafter, engine)
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    cmd += list(options.extra_args)
    return cmd


def executor_backend(options: ServeOptions) -> str | None:
    """The executor a server is asked for: the engine's, for the server with the drafter
    only. The plain server is the lossless checks' control and keeps vLLM's own choice, so a
    Ray run starts one Ray instance, not one per server: Ray does not support several local
    instances on one host."""
    return options.engine.distributed_executor_backend if options.drafter is not None else None


def serve_environment(options: ServeOptions, base: Mapping[str, str]) -> dict[str, str]:
    """A server's environment: ``base`` (a child environment), and for the Ray executor a
    Ray instance of the server's own.

    ``ray.init()`` joins the cluster that ``RAY_ADDRESS`` names, or one ``ray start`` left
    on this host; its workers would then run where the plan did not place them, with that
    cluster's environment (no PYTHONPATH to the build under test). ``local`` starts a new
    instance on this server's GPUs, whose workers inherit this environment.
    """
    env = dict(base)
    if executor_backend(options) == "ray":
        env["RAY_ADDRESS"] = "local"
    return env


def child_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for vLLM children: the caller's (PYTHONPATH included), offline.

    The repository is appended to PYTHONPATH so children started with
    ``-m tooling.smoke...`` import this checkout, after any ``--target`` install
    folder already there.
    """
    from ..paths import REPO_DIR

    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_DIR) not in paths:
        paths.append(str(REPO_DIR))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # Log lines reach the file as they happen, so a time-out still has them.
        PYTHONUNBUFFERED="1",
    )
    return env


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    """A started server; ``startup_s`` is set once it answered /health, ``stop`` when
    its block exits."""

    base_url: str
    pid: int
    log: Path
    startup_s: float
    stop: StopOutcome | None = None
    is_running: Callable[[], bool] = lambda: True
    started_at: float = field(default_factory=time.monotonic)

    def wait_healthy(self, timeout_s: float) -> float:
        """Wait for /health; ``startup_s`` counts from the start, not from this call."""
        wait_for_health(self.base_url, self.is_running, timeout_s=timeout_s, log=self.log)
        self.startup_s = time.monotonic() - self.started_at
        return self.startup_s


def wait_for_health(
    base_url: str, is_running: Any, *, timeout_s: float, log: Path, poll_s: float = 0.5
) -> float:
    """Poll ``/health`` until it answers 200; return the seconds it took.

    ``is_running()`` says whether the server process is still alive. Raises
    SmokeError when it exits first or ``timeout_s`` passes.
    """
    start = time.monotonic()
    while True:
        if client.is_healthy(base_url):
            return time.monotonic() - start
        if not is_running():
            raise SmokeError(
                f"server exited before {base_url}/health answered: {log_tail(log)} (log: {log})"
            )
        if time.monotonic() - start >= timeout_s:
            raise SmokeError(
                f"{base_url}/health did not answer within {timeout_s:.0f}s (log: {log})"
            )
        time.sleep(poll_s)


@contextlib.contextmanager
def started(
    cmd: Sequence[str],
    *,
    base_url: str,
    log: Path,
    env: Mapping[str, str],
    stop_grace_s: float = 20.0,
) -> Iterator[RunningServer]:
    """Start ``cmd`` and yield at once (``wait_healthy`` is the caller's); always stop
    its process group. Errors, time-outs and KeyboardInterrupt inside the block all
    pass through the same stop (SIGTERM, grace, SIGKILL)."""
    proc = start_group(cmd, log=log, env=env)
    alive = lambda: proc.poll() is None  # noqa: E731
    server = RunningServer(base_url, proc.pid, log, startup_s=0.0, is_running=alive)
    try:
        yield server
    finally:
        server.stop = stop_group(proc, grace_s=stop_grace_s)


@contextlib.contextmanager
def serve(
    options: ServeOptions,
    *,
    log: Path,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = 20.0,
) -> Iterator[RunningServer]:
    """``vllm serve`` for ``options``, started (not yet healthy: ``wait_healthy``)
    inside the block and stopped after it."""
    cmd = build_serve_command(options, python)
    logger.debug("serve %s at %s (log: %s)", options.target, options.base_url, log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
    with started(
        cmd,
        base_url=options.base_url,
        log=log,
        env=serve_environment(options, child_environment(env)),
        stop_grace_s=stop_grace_s,
    ) as server:
        yield server
