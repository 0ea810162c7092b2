"""Fix 10: DFlash drafts only while its first pass stays within max_model_len.

After each step the model runner decides whether the drafter runs. A drafter's
queries reach position max_seq_len + K - 1, and DFlash's first pass one more
(the bonus token and K masks at last + 1 .. last + 1 + K). 0.20.1 lets it draft
while max_seq_len + K <= max_model_len, so at max_seq_len = max_model_len - K
its last query sits at max_model_len, one past the last valid position: the
block index is clamped into the request's last block, whose slot of a valid
earlier position it overwrites.

The probe asks the V1 model runner (``CPUModelRunner``, built for a DFlash
drafter at K = 15) whether the drafter may run for a batch whose longest
sequence is max_model_len - K (its first pass would reach max_model_len: it
must not) and max_model_len - K - 1 (reaching max_model_len - 1: it must).
The decision is the runner's ``_input_fits_in_drafter``; a runner that makes
it inline in ``sample_tokens`` (0.20, 0.21, 0.22) cannot be asked alone, and
the probe reads unknown there.
"""

from __future__ import annotations

from types import SimpleNamespace

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "drafter_max_len"
K = 15


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5], hybrid_target=True
    )
    runner = _harness.v1_runner(_harness.vllm_config(pair, num_speculative_tokens=K))
    if not hasattr(runner, "_input_fits_in_drafter"):
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the runner decides whether the drafter runs inline in sample_tokens, "
            "which the probe cannot ask alone",
        )
    limit = runner.effective_drafter_max_model_len
    drafts = {
        reach: bool(runner._input_fits_in_drafter(SimpleNamespace(max_seq_len=reach - K)))
        for reach in (limit, limit - 1)
    }
    evidence = f"DFlash K={K}, drafter max_model_len {limit}: " + "; ".join(
        f"longest sequence {reach - K} (first pass up to position {reach}): "
        + ("drafts" if ran else "does not draft")
        for reach, ran in drafts.items()
    )
    if not drafts[limit - 1]:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the drafter stops before its queries reach the last position: " + evidence,
        )
    return ProbeResult(
        probe=NAME,
        status=ABSENT if drafts[limit] else PRESENT,
        evidence=evidence,
        details={"max_model_len": limit, "drafts_at_reach": {str(r): d for r, d in drafts.items()}},
    )
