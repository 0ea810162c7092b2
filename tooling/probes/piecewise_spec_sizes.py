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
V2_KS = (3, 5, 7, 15)
"""On the V2 runner's token grid (1, 2, 4, then multiples of 8 and 16) a K+1 that is a power
of two always lands on a multiple of itself; K = 5 is one that does not."""
MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")


def piecewise_sizes(config: Any, mode: str) -> list[int]:
    """The token counts the runner dispatches PIECEWISE graphs for under ``mode``."""
    from vllm.config import CUDAGraphMode

    kv_cache_config = _harness.scheduler(config, block_size=16, num_blocks=64).kv_cache_config
    runner = _harness.graph_runner(config, mode, kv_cache_config)
    keys = runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
    return sorted(key.num_tokens for key in keys)


def _v2_padded(k: int) -> dict[int, int]:
    """Under PIECEWISE, each verify step of n requests at ``k`` that the V2 runner's graph
    manager replays at a size not a multiple of k+1: n -> that size."""
    from vllm.config import CUDAGraphMode

    from ._schedsim import Settings
    from ._v2_runner import graph_manager

    config, manager = graph_manager(Settings(k=k, max_num_seqs=64), "PIECEWISE")
    ceiling = config.compilation_config.max_cudagraph_capture_size
    padded = {}
    for n in range(1, ceiling // (k + 1) + 1):
        desc = manager.dispatch(
            num_reqs=n,
            num_tokens=n * (k + 1),
            uniform_token_count=k + 1,
            num_active_loras=0,
            max_query_len=k + 1,
        )
        if desc.cg_mode == CUDAGraphMode.PIECEWISE and desc.num_tokens % (k + 1):
            padded[n] = desc.num_tokens
    return padded


def _v2() -> ProbeResult:
    padded = {k: _v2_padded(k) for k in V2_KS}
    found = "; ".join(
        f"K={k}: " + (", ".join(f"{n} requests -> {s}" for n, s in list(p.items())[:6]) or "none")
        for k, p in padded.items()
    )
    return ProbeResult(
        probe=NAME,
        status=UNKNOWN,
        evidence="the V2 runner keys PIECEWISE graphs by token count for every batch; verify "
        f"steps it replays at a size not a multiple of K+1: {found} (whether that faults "
        "needs a GPU)",
        details={f"K={k}": {str(n): s for n, s in p.items()} for k, p in padded.items()},
    )


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    if not _harness.has_v1_runner():
        return _v2()
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
