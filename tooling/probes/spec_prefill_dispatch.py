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
  graphs altogether has not fixed the dispatch, and reads unknown;
- control, plain serving (no drafter, V1 only): the decode step after a prompt, which
  must stay a uniform decode on the FULL graph too: the fix asks nothing of a step
  without speculation.

Fixed means no prefill case is dispatched as a uniform decode while every
control is.

A release without the V1 runner (0.34.0) serves DFlash on the V2 runner, which classifies
a step in ``GPUModelRunner.gather_batch_req_state`` from its per-request state (a uniform
decode token count, or none): the probe asks that method, the scheduler's output in, the
runner's request state (``RequestState``) fed as the runner feeds it, the bookkeeping
after a step (the prompt counted computed) stood in for.
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
    probe: str,
    lead: str,
    pair: Any,
    k: int,
    option: dict[str, Any],
    shown: Any,
    max_num_seqs: int = 4,
) -> Any:
    """The config of ``pair`` at K = ``k`` with ``option`` in its speculative config; where
    the tree refuses the option, the probe's answer: ABSENT, ``lead`` and ``shown`` of it."""
    try:
        return _harness.vllm_config(
            pair, num_speculative_tokens=k, speculative_args=option, max_num_seqs=max_num_seqs
        )
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


def _plain_control(config: Any) -> Dispatch:
    """Plain serving (no drafter): the decode step after a prompt. It must stay a uniform
    decode on the FULL graph: the fix asks nothing of a step without speculation."""
    runner, sched = _runner_and_scheduler(config)
    sched.add_request(_request("plain", BLOCK, 1))
    out = sched.schedule()
    _dispatch(runner, out)
    sched.update_from_output(out, _harness.model_output("plain", [7]))
    out = sched.schedule()
    if out.num_scheduled_tokens.get("plain") != 1:
        raise CannotDispatch("the plain decode step did not schedule one token")
    return Dispatch("plain decode (control)", 0, *_dispatch(runner, out))


class _V2Batch:
    """The V2 runner's batch classification over its request state (see the module)."""

    def __init__(self, config: Any, k: int) -> None:
        import torch
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.states import RequestState

        self.classify = GPUModelRunner.gather_batch_req_state
        # Only what gather_batch_req_state reads of its runner.
        self.runner = object.__new__(GPUModelRunner)
        self.runner.decode_query_len = 1 + k
        self.runner.use_pp = False
        self.runner.adaptive_verification = None
        self.runner.pcp_manager = None
        self.runner.req_states = RequestState(
            max_num_reqs=8,
            max_model_len=config.model_config.max_model_len,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            num_speculative_steps=k,
            vocab_size=1000,
            device=torch.device("cpu"),
        )

    def dispatch(self, out: Any) -> tuple[str, bool]:
        states = self.runner.req_states
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids)
            states.add_request(new.req_id, len(prompt), prompt, new.num_computed_tokens, 64)
        _, uniform = self.classify(self.runner, out, False)
        # No graph mode: the V2 runner picks its graph after this classification.
        return "", uniform is not None

    def prompt_done(self, rid: str, prompt_len: int) -> None:
        """What the runner records after a step that finished ``rid``'s prompt."""
        states = self.runner.req_states
        states.num_computed_prefill_tokens[states.req_id_to_index[rid]] = prompt_len


def _v2_cases(config: Any, k: int) -> list[Dispatch]:
    from vllm.v1.outputs import DraftTokenIds

    found = []
    sched = _harness.scheduler(config, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    batch = _V2Batch(config, k)
    sched.add_request(_request("one", k + 1, 1))
    out = sched.schedule()
    if out.num_scheduled_tokens.get("one") != k + 1:
        raise CannotDispatch(f"the {k + 1}-token prompt was not prefilled in one step")
    found.append(Dispatch("one prefill", k, *batch.dispatch(out)))
    sched.update_from_output(out, _harness.model_output("one", [7]))
    batch.prompt_done("one", k + 1)
    sched.update_draft_token_ids(DraftTokenIds(["one"], [[8] * k]))
    out = sched.schedule()
    if len(out.scheduled_spec_decode_tokens.get("one", ())) != k:
        raise CannotDispatch(f"the decode step did not carry the {k} drafts")
    found.append(Dispatch("decode (control)", k, *batch.dispatch(out)))
    sched = _harness.scheduler(config, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    batch = _V2Batch(config, k)
    for i, rid in enumerate(("two-a", "two-b")):
        sched.add_request(_request(rid, k + 1, 1 + 100 * i))
    out = sched.schedule()
    if sorted(out.num_scheduled_tokens.values()) != [k + 1, k + 1]:
        raise CannotDispatch(f"the two {k + 1}-token prompts were not prefilled in one step")
    found.append(Dispatch("two prefills", k, *batch.dispatch(out)))
    return found


def _name(d: Dispatch) -> str:
    return f"K={d.num_spec_tokens} {d.case}" if d.num_spec_tokens else d.case


def _describe(d: Dispatch) -> str:
    kind = "uniform decode" if d.uniform else "mixed"
    return f"{_name(d)}: {d.mode + ' ' if d.mode else ''}{kind}"


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    v2 = not _harness.has_v1_runner()
    cases, runner = (_v2_cases, "V2") if v2 else (_cases, "V1")
    try:
        dispatches = [
            d for k in KS for d in cases(_harness.vllm_config(pair, num_speculative_tokens=k), k)
        ]
        if not v2:
            dispatches.append(_plain_control(_harness.vllm_config(pair, method=None)))
    except CannotDispatch as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run a case: {e}")
    controls = [d for d in dispatches if d.case.endswith("(control)")]
    prefills = [d for d in dispatches if not d.case.endswith("(control)")]
    evidence = (
        f"hybrid target, FULL_AND_PIECEWISE, the {runner} runner's dispatch of each step: "
        + "; ".join(_describe(d) for d in dispatches)
    )
    # The V2 runner's classification is the uniform count alone; its graph comes after.
    if not all(d.uniform and (v2 or d.mode == "FULL") for d in controls):
        status = UNKNOWN
        evidence = "a decode step is not dispatched to the FULL graph: " + evidence
    else:
        status = ABSENT if any(d.uniform for d in prefills) else PRESENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={
            "dispatch": {_name(d): {"mode": d.mode, "uniform": d.uniform} for d in dispatches}
        },
    )
