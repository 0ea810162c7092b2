"""Fix 23: a DFlash step the speculation budget verifies no drafts in runs no query pass.

``num_speculative_tokens_per_batch_size`` (fix 17) may verify no drafts (K = 0) above a
number of running requests: where drafting stops paying, as on a hybrid target whose Gated
DeltaNet layers verify 16 tokens a request at 64 requests. vLLM's runner still ran the
drafter's whole first pass every step, the bonus token and K masks of every request, for
drafts no step verifies. Fixed, such a step writes the drafter's context K/V of the tokens
the target computed (so later drafts attend to every position) and drafts nothing: its
drafts are zeroed, as for a batch past the drafter's max_model_len. And the target's step of
one token a request, which ran PIECEWISE, replays a full CUDA graph as a plain engine's does.

The probe asks the V1 model runner (``CPUModelRunner``, an attention-only target and a
DFlash drafter at K = 15, the budget ``BUDGET``) what ``sample_tokens`` asks of the drafter after a
step of 2 requests (K = 15 verified: the full pass) and of 3 (none verified: the context
alone, and the drafts zeroed). Sampling and the bookkeeping around the decision are stood in
for (``drafter_max_len.sample_after_step``); the drafter's entry point records what it was
asked and the copy of the drafts to the CPU whether they were zeroed. Then the runner's own
dispatch of the step that follows three requests' prompts under the budget (vLLM's real
Scheduler, as ``spec_budget_graphs`` asks it): none verifies drafts, and the step replays a
uniform FULL graph.

These run on an attention-only target. The same budget on a hybrid target's config must be
accepted too: such a step reads each request's Gated DeltaNet state from the slot its last
step accepted into (fix 24, probe ``accepted_state``), where patch 23 once refused a range
of 0 there.

Absent: the full pass at 3 requests, the step of no drafts PIECEWISE, the hybrid config
refusing the budget, or the config refusing it on either target (no such option).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import _harness
from ._v1 import without_v1_runner
from .drafter_max_len import sample_after_step
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_budget_graphs import _decoding
from .spec_prefill_dispatch import CannotDispatch, option_config

NAME = "drafting_off"
K = 15
BUDGET = {"num_speculative_tokens_per_batch_size": [[1, 2, K], [3, 1024, 0]]}


class _Copied(Exception):
    def __init__(self, zeros_only: bool) -> None:
        super().__init__("zeros" if zeros_only else "drafts")
        self.zeros_only = zeros_only


def _asked_after_step(runner: Any, num_reqs: int) -> tuple[bool, bool]:
    """(whether the drafter was asked for its context alone, whether the drafts were zeroed)
    after a step of ``num_reqs`` requests."""
    import torch

    asked: dict[str, bool] = {}

    def proposed(*args: Any, **kwargs: Any) -> Any:
        asked["context_only"] = bool(kwargs.get("context_only", False))
        return torch.zeros((num_reqs, K), dtype=torch.int32)

    def copied(*args: Any, zeros_only: bool = False, **kwargs: Any) -> Any:
        raise _Copied(zeros_only)

    step = SimpleNamespace(max_seq_len=64, num_reqs=num_reqs)
    try:
        sample_after_step(runner, step, proposed, copied)
    except _Copied as done:
        if "context_only" not in asked:
            raise LookupError("sample_tokens copied drafts without asking the drafter") from None
        return asked["context_only"], done.zeros_only
    raise LookupError("sample_tokens copied no drafts to the CPU")


def run() -> ProbeResult:
    why = "the V2 runner's DFlash speculator decides this itself (the ledger's reading)"
    if (unknown := without_v1_runner(NAME, why)) is not None:
        return unknown
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    shown = "num_speculative_tokens_per_batch_size"
    # Room for a full graph of one token a request: capture sizes are multiples of K + 1.
    config = option_config(NAME, f"DFlash K={K}", pair, K, BUDGET, shown, max_num_seqs=K + 1)
    if isinstance(config, ProbeResult):
        return config
    hybrid = option_config(NAME, "hybrid", _harness.hybrid_pair(), K, BUDGET, shown)
    accepted = not isinstance(hybrid, ProbeResult)
    runner = _harness.v1_runner(config)
    try:
        seen = {n: _asked_after_step(runner, n) for n in (2, 3)}
        (mode, uniform), drafts = _decoding(config, 3)
    except (ValueError, TypeError, AttributeError, LookupError, CannotDispatch) as e:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the runner could not be asked: " + " ".join(str(e).split())[:300],
        )
    evidence = (
        f"DFlash K={K}, budget {BUDGET[shown]}, FULL_AND_PIECEWISE: "
        + "; ".join(
            f"after a step of {n} requests the drafter is asked for "
            + ("its context alone" if context_only else "its full pass")
            + (", drafts zeroed" if zeroed else ", drafts copied")
            for n, (context_only, zeroed) in seen.items()
        )
        + f"; 3 requests' next step verifies {drafts} drafts, dispatched {mode}"
        + (" uniform" if uniform else "")
        + "; a hybrid target's config with the budget: "
        + ("accepted" if accepted else hybrid.evidence.split("refuses ", 1)[-1][:200])
    )
    if seen[2] != (False, False) or drafts != 0:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the budget is not served as written: " + evidence,
        )
    fixed = seen[3] == (True, True) and (mode, uniform) == ("FULL", True) and accepted
    return ProbeResult(
        probe=NAME,
        status=PRESENT if fixed else ABSENT,
        evidence=evidence,
        details={
            **{str(n): {"context_only": c, "zeroed": z} for n, (c, z) in seen.items()},
            "no_drafts_step": {"mode": mode, "uniform": uniform},
            "hybrid_accepted": accepted,
        },
    )
