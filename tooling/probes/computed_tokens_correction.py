"""Fix 36: asynchronous spec decode corrects a step's computed tokens in one kernel launch.

With asynchronous scheduling the scheduler counts every draft of the last step as accepted,
and the V1 runner corrects each request's computed tokens on the device from the counts the
last step really accepted (``update_num_computed_tokens_for_batch_change``). vLLM 0.20.1 does
it with about a dozen tensor operations (a clamp, three gathers, three comparisons, a cast,
an add, two selects and two copies), each a launch on the GPU host's critical path at every
verify step, for a handful of integers a request.

The probe runs the tree's own function in Triton's interpreter on the CPU on a step whose
rows moved in the persistent batch: a request in a new row, one that was not in the last
step, one whose last step had no drafts, and one whose row another request's last step held
(so a row's read and another row's write meet at one index). Each row's computed and
accepted counts are checked against the rule computed here.

Present: every count is right and the function dispatches at most ``MAX_OPS`` tensor
operations outside Triton kernels. Absent: right, with more. Unknown: any count wrong, or
the function could not be run.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._interpreted import Uncounted, counted_verdict, interpreted_or_unknown
from .gdn_uniform_metadata import _counted as counted_ops
from .result import ProbeResult

NAME = "computed_tokens_correction"
#: Operations outside Triton kernels the correction may dispatch: none, with one to spare.
MAX_OPS = 1
#: The last step's rows: drafts each verified, tokens each accepted (bonus included), and
#: the computed tokens the device held for each before this step's correction.
PREV_DRAFTS = [15, 0, 7, 15, 3]
PREV_VALID = [4, 1, 8, 5, 2]
PREV_COMPUTED = [100, 40, 250, 16, 77]
#: This step's rows: each one's row in the last step (-1: not in it), and the computed
#: tokens the scheduler counted (every draft accepted) and the accepted counts the device
#: held before the correction.
PREV_POSITIONS = [3, -1, 0, 1, 2]
CPU_COMPUTED = [32, 12, 116, 41, 260]
ACCEPTED_BEFORE = [1, 1, 1, 1, 1]
BUFFER = 8


def expected() -> dict[str, list[int]]:
    """The rule: a row whose request had drafts in the last step takes that step's computed
    tokens plus what it accepted, and its accepted count; any other row keeps the
    scheduler's count and its accepted count."""
    computed, accepted = [], []
    for row, prev in enumerate(PREV_POSITIONS):
        if prev >= 0 and PREV_DRAFTS[prev] > 0:
            computed.append(PREV_COMPUTED[prev] + PREV_VALID[prev])
            accepted.append(PREV_VALID[prev])
        else:
            computed.append(CPU_COMPUTED[row])
            accepted.append(ACCEPTED_BEFORE[row])
    return {"computed": computed, "accepted": accepted}


def corrected() -> dict[str, Any]:
    """The tree's correction on the probe's step: the counts it leaves and the operations it
    dispatched outside Triton kernels (run where Triton interprets)."""
    import torch
    import vllm.v1.spec_decode.utils as module

    rows = len(PREV_POSITIONS)
    padded = [*PREV_COMPUTED, *[0] * (BUFFER - len(PREV_COMPUTED))]
    num_computed = torch.tensor(padded, dtype=torch.int32)
    accepted = torch.tensor([*ACCEPTED_BEFORE, *[0] * (BUFFER - rows)], dtype=torch.int32)
    drafts = torch.tensor([*PREV_DRAFTS, *[0] * (BUFFER - len(PREV_DRAFTS))], dtype=torch.int32)
    args = (
        num_computed,
        accepted[:rows],
        torch.tensor(PREV_POSITIONS, dtype=torch.int64),
        torch.tensor(PREV_VALID, dtype=torch.int32),
        drafts,
        torch.tensor(CPU_COMPUTED, dtype=torch.int32),
    )
    kernels = {
        name: Uncounted(value)
        for name, value in vars(module).items()
        if type(value).__name__ in ("JITFunction", "InterpretedFunction")
    }
    with _harness.replaced(module, **kernels):
        _, ops = counted_ops(lambda: module.update_num_computed_tokens_for_batch_change(*args))
    return {
        "computed": num_computed[:rows].tolist(),
        "accepted": accepted[:rows].tolist(),
        "ops": ops,
        "expected": expected(),
    }


def run() -> ProbeResult:
    found = interpreted_or_unknown(NAME, "corrected", "the correction could not be run")
    if isinstance(found, ProbeResult):
        return found
    want = found["expected"]
    wrong = [
        f"{key} {found[key]}, expected {want[key]}"
        for key in ("computed", "accepted")
        if found[key] != want[key]
    ]
    ops = found["ops"]
    evidence = (
        f"{len(PREV_POSITIONS)} rows moved in the persistent batch (one new, one whose last "
        f"step had no drafts): counts right; the correction dispatches {ops} tensor operations "
        f"outside Triton kernels (at most {MAX_OPS}: one kernel launch)"
    )
    what = "the corrected counts are"
    return counted_verdict(NAME, wrong, what, ops, MAX_OPS, evidence, {"found": found})
