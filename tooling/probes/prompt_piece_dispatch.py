"""Fix 29: a prompt's last piece of one token is not dispatched as a decode step of no drafts.

A speculation budget's range of 0 (fix 23) keys full CUDA graphs of one token a request, as
a plain engine's decode step. On a hybrid target those graphs are captured on the Gated
DeltaNet builder's speculative path (fix 24: every decode reads the state slot its last step
accepted into). A chunked prompt whose last piece is one token has no drafts either, and fix
7's test (every request verifies the step's K drafts) took it for a decode: the step replayed
that graph while the builder gave the prompt's row the non-speculative path, so its layers read
and wrote the slots the speculative buffers held from their last step. On the trained pair (one
H100, K = 15, budget [[1, 8, 15], [9, 1024, 0]]) a 1025-token prompt, chunked 1024 + 1, came
back wrong from its first token.

The probe asks the V1 model runner's own dispatch (``CPUModelRunner`` under
FULL_AND_PIECEWISE, vLLM's real Scheduler scheduling each step, as ``spec_budget_graphs`` asks
it) for a hybrid target with a DFlash drafter at K = 15 and the budget ``BUDGET``:

- a step of a decode of one token and a prompt's last piece of one token (a first step of
  ``CHUNK`` tokens each left one token of the second prompt);
- control: the step after it, two decodes of one token each, which replays the budget's full
  graph (a tree without that graph reads unknown);
- the step after that, which a prompt of one token joins (its first piece is one token too;
  ``tests/test_dispatch_drawn.py`` drew it).

Present: the control replays a uniform FULL graph and neither step with a prompt's piece
does. Absent: either does.

Unknown where the V2 runner serves (0.34.0): it classifies a step from its own request state,
which this probe does not drive.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._v1 import without_v1_runner
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import (
    CannotDispatch,
    _dispatch,
    _request,
    _runner_and_scheduler,
    option_config,
)

NAME = "prompt_piece_dispatch"
K = 15
BUDGET = [[1, 1, K], [2, 1024, 0]]
#: The first prompt's length, and the first step's piece of each prompt.
CHUNK = 20
#: Enough requests for the one-token graphs, which the capture sizes pad to K + 1 tokens.
MAX_NUM_SEQS = K + 1


def _steps(config: Any) -> tuple[tuple[str, bool], ...]:
    """The dispatch of the step with a prompt's one-token piece, of the step after it (two
    decodes), and of the step after that, which a one-token prompt joins."""
    runner, sched = _runner_and_scheduler(config)
    sched.add_request(_request("decode", CHUNK, 1))
    sched.add_request(_request("prompt", CHUNK + 1, 101))
    budget = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = 2 * CHUNK
    out = sched.schedule()
    sched.max_num_scheduled_tokens = budget
    if out.num_scheduled_tokens != {"decode": CHUNK, "prompt": CHUNK}:
        raise CannotDispatch(f"the first step scheduled {out.num_scheduled_tokens}")
    _dispatch(runner, out)
    sched.update_from_output(out, _harness.model_outputs({"decode": [7], "prompt": []}))
    out = sched.schedule()
    if out.num_scheduled_tokens != {"decode": 1, "prompt": 1} or out.scheduled_spec_decode_tokens:
        raise CannotDispatch(
            f"the second step scheduled {out.num_scheduled_tokens} with drafts "
            f"{dict(out.scheduled_spec_decode_tokens)}"
        )
    piece = _dispatch(runner, out)
    sched.update_from_output(out, _harness.model_outputs({"decode": [8], "prompt": [9]}))
    out = sched.schedule()
    if out.num_scheduled_tokens != {"decode": 1, "prompt": 1}:
        raise CannotDispatch(f"the third step scheduled {out.num_scheduled_tokens}")
    decodes = _dispatch(runner, out)
    sched.update_from_output(out, _harness.model_outputs({"decode": [8], "prompt": [9]}))
    sched.add_request(_request("one", 1, 201))
    out = sched.schedule()
    if out.num_scheduled_tokens != {"decode": 1, "prompt": 1, "one": 1}:
        raise CannotDispatch(f"the fourth step scheduled {out.num_scheduled_tokens}")
    return piece, decodes, _dispatch(runner, out)


def run() -> ProbeResult:
    why = "the V2 runner classifies a step from its own request state, not driven here"
    if (unknown := without_v1_runner(NAME, why)) is not None:
        return unknown
    pair = _harness.hybrid_pair()
    option = {"num_speculative_tokens_per_batch_size": BUDGET}
    config = option_config(
        NAME, "no speculation budget here", pair, K, option, BUDGET, max_num_seqs=MAX_NUM_SEQS
    )
    if isinstance(config, ProbeResult):
        return config
    if not _harness.serves_v1(config):
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence="the config chooses the V2 runner")
    try:
        piece, decodes, joined = _steps(config)
    except CannotDispatch as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run a case: {e}")
    seen = {
        "a decode and a prompt's one-token piece": piece,
        "two decodes of one token (control)": decodes,
        "two decodes and a one-token prompt": joined,
    }
    evidence = (
        f"hybrid target, K = {K}, budget {BUDGET}, FULL_AND_PIECEWISE, the V1 runner's "
        "dispatch: "
        + "; ".join(f"{case}: {m}{' uniform' if u else ''}" for case, (m, u) in seen.items())
    )
    if decodes != ("FULL", True):
        status = UNKNOWN
        evidence = "the budget's step of no drafts does not replay its FULL graph: " + evidence
    else:
        status = ABSENT if ("FULL", True) in (piece, joined) else PRESENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={case: {"mode": m, "uniform": u} for case, (m, u) in seen.items()},
    )
