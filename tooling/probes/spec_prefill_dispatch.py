"""Fix 7: a (K+1)-token prefill is never dispatched as a uniform spec-decode batch.

With K speculative tokens a spec-decode step schedules K+1 tokens per request;
so does the first step of a (K+1)-token prompt. Dispatched as a uniform decode,
such a prefill replays the FULL CUDA graph captured for verification, and on a
hybrid target (Gated DeltaNet, Mamba) the prompt's recurrent state is never
written: the request is wrong from its first token.

The probe asks the V1 model runner's own batch classification, the way
``execute_model`` does: vLLM's real Scheduler schedules the step, the runner
(``CPUModelRunner``, the V1 runner on a CPU device) takes the scheduler output
into its persistent batch (``_update_states``), and
``_determine_batch_execution_and_padding`` dispatches it under vLLM's default
CUDA-graph mode for a hybrid target, FULL_AND_PIECEWISE. The target is a
config-only Qwen3-Next (Gated DeltaNet and attention layers) with a DFlash
drafter, at K = 3 and K = 15. Cases, each on a fresh runner:

- the first step of one (K+1)-token prompt;
- the first step of two (K+1)-token prompts in one batch;
- control: the decode step after the first case, verifying K drafts. It must
  stay a uniform decode (FULL graph): a tree that stops replaying verification
  graphs altogether has not fixed the dispatch, and reads unknown.

Fixed means no prefill case is dispatched as a uniform decode while every
control is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "spec_prefill_dispatch"
KS = (3, 15)
BLOCK = 16
NUM_BLOCKS = 64


@dataclass(frozen=True)
class Dispatch:
    case: str
    num_spec_tokens: int
    mode: str
    uniform: bool


class CannotDispatch(Exception):
    """The release's runner or scheduler does not run the case as the probe drives it."""


def _runner_and_scheduler(config: Any) -> tuple[Any, Any]:
    sched = _harness.scheduler(config, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    # The runner's batch reads the KV-cache layout the scheduler allocates from.
    return _harness.graph_runner(config, "FULL_AND_PIECEWISE", sched.kv_cache_config), sched


def option_config(
    probe: str, lead: str, pair: Any, k: int, option: dict[str, Any], shown: Any
) -> Any:
    """The config of ``pair`` at K = ``k`` with ``option`` in its speculative config; where
    the tree refuses the option, the probe's answer: ABSENT, ``lead`` and ``shown`` of it."""
    try:
        return _harness.vllm_config(pair, num_speculative_tokens=k, speculative_args=option)
    except (TypeError, ValueError) as e:
        return ProbeResult(
            probe=probe,
            status=ABSENT,
            evidence=f"{lead}: the config refuses {shown}: " + " ".join(str(e).split())[:300],
        )


def _dispatch(runner: Any, scheduler_output: Any) -> tuple[str, bool]:
    """(graph mode, uniform) the runner picks for ``scheduler_output``, as execute_model does."""
    import numpy as np

    runner._update_states(scheduler_output)
    req_ids = runner.input_batch.req_ids
    tokens = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
    determine = runner._determine_batch_execution_and_padding
    args = {
        "num_tokens": int(scheduler_output.total_num_scheduled_tokens),
        "num_reqs": len(req_ids),
        "num_scheduled_tokens_np": tokens,
        "max_num_scheduled_tokens": int(tokens.max()),
        "use_cascade_attn": False,
    }
    accepted = inspect.signature(determine).parameters
    missing = [a for a in args if a not in accepted]
    if missing:
        raise CannotDispatch(f"the runner's batch dispatch takes no {', '.join(missing)}")
    mode, descriptor = determine(**args)[:2]
    return str(getattr(mode, "name", mode)), bool(descriptor.uniform)


def _request(rid: str, prompt_len: int, first_token: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
    )


def _cases(config: Any, k: int) -> list[Dispatch]:
    from vllm.v1.outputs import DraftTokenIds

    found = []
    # One (K+1)-token prompt, then its decode step verifying K drafts.
    runner, sched = _runner_and_scheduler(config)
    sched.add_request(_request("one", k + 1, 1))
    out = sched.schedule()
    if out.num_scheduled_tokens.get("one") != k + 1:
        raise CannotDispatch(f"the {k + 1}-token prompt was not prefilled in one step")
    found.append(Dispatch("one prefill", k, *_dispatch(runner, out)))
    sched.update_from_output(out, _harness.model_output("one", [7]))
    sched.update_draft_token_ids(DraftTokenIds(["one"], [[8] * k]))
    out = sched.schedule()
    if len(out.scheduled_spec_decode_tokens.get("one", ())) != k:
        raise CannotDispatch(f"the decode step did not carry the {k} drafts")
    found.append(Dispatch("decode (control)", k, *_dispatch(runner, out)))
    # Two (K+1)-token prompts in one step.
    runner, sched = _runner_and_scheduler(config)
    for i, rid in enumerate(("two-a", "two-b")):
        sched.add_request(_request(rid, k + 1, 1 + 100 * i))
    out = sched.schedule()
    if sorted(out.num_scheduled_tokens.values()) != [k + 1, k + 1]:
        raise CannotDispatch(f"the two {k + 1}-token prompts were not prefilled in one step")
    found.append(Dispatch("two prefills", k, *_dispatch(runner, out)))
    return found


def _describe(d: Dispatch) -> str:
    kind = "uniform decode" if d.uniform else "mixed"
    return f"K={d.num_spec_tokens} {d.case}: {d.mode} {kind}"


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    try:
        dispatches = [
            d for k in KS for d in _cases(_harness.vllm_config(pair, num_speculative_tokens=k), k)
        ]
    except CannotDispatch as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run a case: {e}")
    controls = [d for d in dispatches if d.case.startswith("decode")]
    prefills = [d for d in dispatches if not d.case.startswith("decode")]
    evidence = (
        "hybrid target, FULL_AND_PIECEWISE, the V1 runner's dispatch of each step: "
        + "; ".join(_describe(d) for d in dispatches)
    )
    if not all(d.uniform and d.mode == "FULL" for d in controls):
        status = UNKNOWN
        evidence = "a spec decode is not dispatched to the FULL graph: " + evidence
    else:
        status = ABSENT if any(d.uniform for d in prefills) else PRESENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={
            "dispatch": {
                f"K={d.num_spec_tokens} {d.case}": {"mode": d.mode, "uniform": d.uniform}
                for d in dispatches
            }
        },
    )
