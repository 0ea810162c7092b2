"""Fix 16: a speculative-decoding verify step of every sequence is captured in CUDA graphs.

A spec-decode step verifies 1 + K tokens a sequence, so ``max_num_seqs`` decoding sequences
are ``max_num_seqs * (1 + K)`` tokens. vLLM 0.20.1 captures graphs up to
``min(2 * max_num_seqs * (1 + K), 512)`` tokens: at 64 sequences and K = 15 (1024 tokens)
every verify step ran without graphs.

The probe builds the config ``vllm serve`` builds (``EngineArgs`` on a platform answering
as an H200) for the seed's pair with ``--max-num-seqs 64`` and ``--max-num-batched-tokens
8192``, with DFlash at K = 15 and without a drafter, and lets vLLM's own code choose the
default capture sizes as it does on a CUDA platform (``_set_cudagraph_sizes`` under
FULL_AND_PIECEWISE). Fixed means the drafted engine captures a verify step of all 64
sequences and the plain engine's sizes are vLLM's own (2 x 64 tokens).
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._schedsim import Settings, engine_config, h200_platform
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "spec_verify_graphs"
K = 15
SEQS = 64
TOKENS = 8192
PLAIN_SIZE = min(2 * SEQS, 512)


def default_capture(settings: Settings, root: Any) -> int | None:
    """The largest capture size vLLM chooses for ``settings`` on a CUDA platform."""
    from vllm.config import CUDAGraphMode

    config = engine_config(settings, root)
    compilation = config.compilation_config
    # The CPU platform turns graphs off; a CUDA platform leaves vLLM's default mode.
    config.model_config.enforce_eager = False
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.cudagraph_capture_sizes = None
    compilation.max_cudagraph_capture_size = None
    config._set_cudagraph_sizes()
    return compilation.max_cudagraph_capture_size


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    with h200_platform():
        try:
            drafted = default_capture(Settings(K, TOKENS, SEQS), root)
            plain = default_capture(Settings(0, TOKENS, SEQS), root)
        except AttributeError as e:  # a release that sizes its graphs elsewhere
            return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot ask: {e}")
    verify = SEQS * (K + 1)
    evidence = (
        f"largest CUDA graph at --max-num-seqs {SEQS}: {drafted} tokens with DFlash at K={K} "
        f"(a verify step of every sequence: {verify}), {plain} without a drafter"
    )
    details = {"drafted": drafted, "plain": plain, "verify_step": verify}
    if plain != PLAIN_SIZE or drafted is None:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"plain serving's sizes are not vLLM's 0.20 rule: {evidence}",
            details=details,
        )
    status = PRESENT if drafted >= verify else ABSENT
    return ProbeResult(probe=NAME, status=status, evidence=evidence, details=details)
