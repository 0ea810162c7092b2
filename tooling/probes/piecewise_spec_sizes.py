"""Fix 9: with speculative decoding, PIECEWISE CUDA graphs are captured at multiples of K+1.

A spec-decode step schedules K+1 tokens per request. vLLM rounds the capture
sizes to multiples of K+1 when decode graphs are FULL; spec-decode steps replay
PIECEWISE graphs too, and unaligned PIECEWISE sizes faulted mid-decode (an
illegal memory access with DFlash at K = 15 under concurrency).

The probe lets the V1 model runner resolve its CUDA-graph mode and sizes with
its own code (``_check_and_update_cudagraph_mode``, as at start-up on a GPU;
a hybrid target's graph support), starting from vLLM's default sizes up to 64,
for a DFlash drafter at K = 3 and K = 15, and reads the sizes the runner's
dispatcher then holds PIECEWISE graphs for. Fixed means every PIECEWISE size
is a multiple of K+1 in PIECEWISE mode. Control: under FULL_AND_PIECEWISE
(vLLM's default) the sizes are aligned on every release that aligns at all;
where they are not, the probe's question does not apply and it reads unknown.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "piecewise_spec_sizes"
KS = (3, 15)
MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")


def piecewise_sizes(config: Any, mode: str) -> list[int]:
    """The token counts the runner dispatches PIECEWISE graphs for under ``mode``."""
    from vllm.config import CUDAGraphMode

    kv_cache_config = _harness.scheduler(config, block_size=16, num_blocks=64).kv_cache_config
    runner = _harness.graph_runner(config, mode, kv_cache_config)
    keys = runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
    return sorted(key.num_tokens for key in keys)


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    sizes = {
        (k, mode): piecewise_sizes(_harness.vllm_config(pair, num_speculative_tokens=k), mode)
        for k in KS
        for mode in MODES
    }
    unaligned = {key: [n for n in found if n % (key[0] + 1)] for key, found in sizes.items()}
    evidence = "PIECEWISE graph sizes the runner dispatches: " + "; ".join(
        f"K={k} {mode}: {found}" for (k, mode), found in sizes.items()
    )
    if any(
        unaligned[(k, "FULL_AND_PIECEWISE")] or not sizes[(k, "FULL_AND_PIECEWISE")] for k in KS
    ):
        status = UNKNOWN
        evidence = "FULL_AND_PIECEWISE sizes are not aligned to K+1 either: " + evidence
    else:
        status = ABSENT if any(unaligned[(k, "PIECEWISE")] for k in KS) else PRESENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={f"K={k} {mode}": found for (k, mode), found in sizes.items()},
    )
