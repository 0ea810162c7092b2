"""Fix 10: DFlash drafts only while its first pass stays within max_model_len.

After each step the model runner decides whether the drafter runs. A drafter's
queries reach position max_seq_len + K - 1, and DFlash's first pass one more
(the bonus token and K masks at last + 1 .. last + 1 + K). 0.20.1 lets it draft
while max_seq_len + K <= max_model_len, so at max_seq_len = max_model_len - K
its last query sits at max_model_len, one past the last valid position: the
block index is clamped into the request's last block, whose slot of a valid
earlier position it overwrites.

The probe asks the V1 model runner (``CPUModelRunner``, built for a DFlash
drafter at K = 15) whether the drafter runs after a step whose longest sequence
is max_model_len - K (its first pass would reach max_model_len: it must not)
and max_model_len - K - 1 (reaching max_model_len - 1: it must). The decision
is made where vLLM makes it, in ``sample_tokens`` after sampling: the step's
state is handed to it as ``execute_model`` leaves it, sampling and the
bookkeeping around the decision are stood in for, and the drafter's entry
point (``propose_draft_token_ids``) records whether it was called. Where
``sample_tokens`` reads another step state than 0.20's, the runner's own
``_input_fits_in_drafter`` (0.23 on) is asked instead.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "drafter_max_len"
K = 15


class _Decided(Exception):
    def __init__(self, drafts: bool) -> None:
        super().__init__("drafts" if drafts else "no drafts")
        self.drafts = drafts


def sample_after_step(runner: Any, step: Any, proposed: Any, copied: Any) -> None:
    """``sample_tokens`` after a step whose drafter metadata is ``step``, sampling and the
    bookkeeping around the drafter's decision stood in for: the drafter's entry point is
    ``proposed``, the copy of its drafts to the CPU ``copied``."""
    import torch

    runner._sample = lambda logits, metadata: SimpleNamespace(
        sampled_token_ids=torch.zeros((1, 1), dtype=torch.int32), logprobs_tensors=None
    )
    runner._update_states_after_model_execute = lambda *args, **kwargs: None
    runner.valid_sampled_token_count_event = None
    runner.propose_draft_token_ids = proposed
    runner._copy_draft_token_ids_to_cpu = copied
    # execute_model's hand-over as 0.20-0.22 unpack it: scheduler output, logits, spec
    # metadata, the drafter's attention metadata, hidden states (3), EC output, graph
    # stats, slot mappings.
    runner.execute_model_state = (
        SimpleNamespace(),
        torch.zeros((1, 8)),
        None,
        step,
        None,
        None,
        None,
        None,
        None,
        None,
    )
    runner.sample_tokens(None)


def _drafts_after_step(runner: Any, max_seq_len: int) -> bool:
    """Whether ``sample_tokens`` runs the drafter after a step of that longest sequence."""

    def drafted(*args: Any, **kwargs: Any) -> Any:
        raise _Decided(True)

    def zeroed(*args: Any, **kwargs: Any) -> Any:
        raise _Decided(False)

    step = SimpleNamespace(max_seq_len=max_seq_len, num_reqs=1)
    try:
        sample_after_step(runner, step, drafted, zeroed)
    except _Decided as decided:
        return decided.drafts
    raise LookupError("sample_tokens neither ran the drafter nor zeroed its drafts")


def _decisions(runner: Any, reaches: tuple[int, ...]) -> tuple[dict[int, bool], str] | None:
    """Per first-pass reach, whether the runner drafts; and how it was asked (None: cannot)."""
    try:
        return {r: _drafts_after_step(runner, r - K) for r in reaches}, "sample_tokens"
    except (ValueError, TypeError, AttributeError, LookupError):
        if not hasattr(runner, "_input_fits_in_drafter"):
            return None
        fits = runner._input_fits_in_drafter
        return {
            r: bool(fits(SimpleNamespace(max_seq_len=r - K))) for r in reaches
        }, "_input_fits_in_drafter"


def _v2() -> ProbeResult:
    """The V2 runner's DFlash input kernel, run in Triton's interpreter (``_dflash_v2_kernel``)."""
    from . import _dflash_v2_kernel as kernel

    found = kernel.ask()
    if "error" in found:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=found["error"][:400])
    evidence = (
        f"V2 runner, DFlash K={kernel.K}, max_model_len {kernel.MAX_MODEL_LEN}, "
        f"{kernel.BLOCK}-token blocks, last valid position {kernel.LAST}: the input kernel gives "
        f"queries at positions {found['positions'][0]}..{found['positions'][-1]} the slots "
        f"{found['slots']}; "
        + (
            "positions past the end write over "
            + ", ".join(f"{p} -> the slot of {q}" for p, _, q in found["overwritten"])
            if found["overwritten"]
            else "none is the slot of a valid position"
        )
    )
    status = ABSENT if found["overwritten"] else PRESENT
    return ProbeResult(probe=NAME, status=status, evidence=evidence, details=found)


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    if not _harness.has_v1_runner():
        return _v2()
    pair = _harness.hybrid_pair()
    runner = _harness.v1_runner(_harness.vllm_config(pair, num_speculative_tokens=K))
    limit = runner.effective_drafter_max_model_len
    decided = _decisions(runner, (limit, limit - 1))
    if decided is None:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="sample_tokens takes another step state and the runner has no "
            "_input_fits_in_drafter to ask",
        )
    drafts, asked = decided
    evidence = f"DFlash K={K}, drafter max_model_len {limit}, asked through {asked}: " + "; ".join(
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
        details={
            "max_model_len": limit,
            "asked": asked,
            "drafts_at_reach": {str(r): d for r, d in drafts.items()},
        },
    )
