"""Fix 39: with prefix caching, a verify step in which no request can complete a block does
not wait for its accepted counts.

With prefix caching a hybrid target's runner keeps its recurrent states block by block
(Mamba cache mode "align"). After each verify step vLLM 0.20.1's V1 runner read every
request's accepted count back from the GPU by ``.cpu()``, which waits for the step's forward
and sampling, so that ``postprocess_mamba`` could copy a request's state into a block the
tokens it keeps complete. Only a step in which some request's kept tokens can reach a
multiple of the block size needs them at once: a request keeps its tokens before the drafts
and 1 to drafts + 1 more. In any other step the counts can reach the host as they do without
prefix caching, by a copy the next step's preparation waits for.

The probe drives vLLM's real Scheduler over an attention group and a Mamba group (cache mode
"align", blocks of ``BLOCK`` tokens) and the V1 model runner on the CPU (``CPUModelRunner``)
for a hybrid target with a DFlash drafter at K = 3. Its ``_update_states`` takes each step's
scheduler output, and its ``_update_states_after_model_execute`` the rejection sampler's
tokens (-1 past the last accepted). Two requests prefill 26-token prompts, then verify 3
drafts each in three steps (``ACCEPTED``), so that a request's range of kept tokens (its
tokens before the drafts, then up to drafts + 1 more) holds a block's end:

1. for neither request;
2. for ``END`` alone, as the range's last token (kept only if every draft is accepted);
3. for ``START`` alone, as the range's first (kept whatever is accepted).

Stood in for: the model's state-copy functions and the copy-buffer set-up (the block size is
read from them), the CUDA event the runner records for the copy, and the state copy itself
(``postprocess_mamba``, or from 0.22.0 ``postprocess_mamba_align_gpu``, which copies on the
GPU from the device's counts): a recorder of the counts it decides by; the state tensors are
not made. A ``TorchFunctionMode`` records each ``.cpu()``, ``.numpy()``, ``.tolist()`` or
``.item()`` of the device's counts.

Present: after step 1 the counts are not read back at once (they reach the host by a copy
and an event, or go to a state copy made on the GPU); after steps 2 and 3 the state copy
decides by the counts the step accepted. Absent: step 1 reads the counts back at once.
Unknown: a count that is wrong, a state copy missing after step 2 or 3 or deciding by wrong
counts, ranges other than planned (a tree that schedules the prompts otherwise), or a tree
the probe cannot drive (the V2 runner keeps its accepted counts and "align" copies on the
device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from . import _harness
from ._v1 import (
    CannotStep,
    NotServedByV1,
    RecordedEvent,
    count_reads,
    state_copies_recorded,
    v1_steps,
)
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "align_counts_deferred"
K = 3
BLOCK = 16
#: The request whose range of kept tokens ends at a block's end in verify step 2, and the one
#: whose range starts at one in step 3.
END, START = "end", "start"
PROMPTS = {END: 26, START: 26}
#: Tokens each verify step accepts, the bonus token included, by request.
ACCEPTED = ({END: 2, START: 1}, {END: 4, START: 4}, {END: 3, START: 2})
#: The request whose range holds a block's end in each verify step.
COMPLETES = (None, END, START)


@dataclass
class After:
    """What the runner did after one verify step."""

    host: dict[str, int]
    """Each request's count in the input batch's host array after the step."""
    reads: list[str] = field(default_factory=list)
    events: int = 0
    copies: list[dict[str, int]] = field(default_factory=list)
    """The counts ``postprocess_mamba`` was handed, one entry a call."""
    completes: list[str] = field(default_factory=list)
    """The requests whose range of kept tokens held a block's end, by the step's own
    counts: the probe's premise, checked before its verdict."""


class _Served:
    def __init__(self) -> None:
        config = _harness.vllm_config(
            _harness.hybrid_pair(),
            num_speculative_tokens=K,
            block_size=BLOCK,
            prefix_caching=True,
            mamba_cache_mode="align",
        )
        if not _harness.serves_v1(config):
            raise NotServedByV1("the config chooses the V2 model runner")
        self.scheduler = _harness.scheduler(config, block_size=BLOCK, num_blocks=64, mamba=True)
        self.runner = runner = _harness.v1_runner(config)
        kv_cache = self.scheduler.kv_cache_config
        runner.kv_cache_config = kv_cache
        runner.may_reinitialize_input_batch(kv_cache, [BLOCK] * len(kv_cache.kv_cache_groups))
        runner.model = SimpleNamespace(get_mamba_state_copy_func=lambda: ())
        spec = kv_cache.kv_cache_groups[-1].kv_cache_spec
        bufs = SimpleNamespace(mamba_spec=spec)
        runner._get_mamba_copy_bufs = lambda: bufs
        runner._get_mamba_bufs = lambda: bufs
        runner.mamba_state_idx = {}

    def step(self, accepted: dict[str, int] | None) -> After | None:
        """One scheduled step through the runner: a prefill (``accepted`` None) or a verify
        step accepting ``accepted[r]`` tokens of each request; K drafts each follow."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.v1.outputs import DraftTokenIds

        sched, runner = self.scheduler, self.runner
        out = sched.schedule()
        rids = list(PROMPTS)
        drafts = {r: len(out.scheduled_spec_decode_tokens.get(r, ())) for r in rids}
        if drafts != dict.fromkeys(rids, 0 if accepted is None else K):
            raise CannotStep(f"a step scheduled drafts {drafts}")
        with set_current_vllm_config(runner.vllm_config):
            runner._update_states(out)
        rows = list(runner.input_batch.req_ids)
        completes = []
        for rid in rows:
            end = runner.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
            if end // BLOCK * BLOCK >= end - drafts[rid]:
                completes.append(rid)
        counts = dict.fromkeys(rows, 1) if accepted is None else accepted
        tokens = torch.full((len(rows), 1 if accepted is None else K + 1), -1, dtype=torch.int32)
        for i, rid in enumerate(rows):
            tokens[i, : counts[rid]] = 9
        host = runner.input_batch.num_accepted_tokens_cpu
        copies: list[dict[str, int]] = []

        def _copy(*args: Any, **kwargs: Any) -> None:
            # The counts the copy decides by: the host's, or on a release that makes the
            # copy on the GPU (0.22.0's postprocess_mamba_align_gpu) the device's it is handed.
            counts = kwargs.get("num_accepted_tokens_gpu", host)
            copies.append({rid: int(counts[i]) for i, rid in enumerate(rows)})

        event = RecordedEvent()
        runner.num_accepted_tokens_event = event
        host[: len(rows)] = 0
        with (
            state_copies_recorded("postprocess_mamba", _copy),
            count_reads(runner.num_accepted_tokens.gpu) as reads,
        ):
            runner._update_states_after_model_execute(tokens, out)
        # A prefill chunk short of its prompt's end samples nothing the scheduler keeps.
        # (The scheduler counts a step's tokens computed when it schedules them.)
        done = [r for r in rows if sched.requests[r].num_computed_tokens >= PROMPTS[r]]
        sched.update_from_output(
            out, _harness.model_outputs({r: [9] * counts[r] if r in done else [] for r in rows})
        )
        if len(done) == len(rows):
            sched.update_draft_token_ids(DraftTokenIds(rows, [[8] * K for _ in rows]))
        if accepted is None:
            return None
        found = {rid: int(host[i]) for i, rid in enumerate(rows)}
        return After(found, reads, event.recorded, copies, completes)


def _request(rid: str, length: int, first_token: int) -> Any:
    """A request whose prompt's blocks are hashed, as prefix caching needs."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first_token, first_token + length)),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _steps() -> list[After]:
    served = _Served()
    for i, (rid, length) in enumerate(PROMPTS.items()):
        served.scheduler.add_request(_request(rid, length, 1 + 100 * i))
    # The prompts prefill in one step or, chunked at blocks, in several.
    for _ in range(max(PROMPTS.values()) // BLOCK + 1):
        served.step(None)
        if all(served.scheduler.requests[r].spec_token_ids for r in PROMPTS):
            break
    else:
        raise CannotStep("the prompts did not finish prefilling")
    steps = [served.step(accepted) for accepted in ACCEPTED]
    found = [after for after in steps if after is not None]
    ranges = [after.completes for after in found]
    if ranges != [[rid] if rid else [] for rid in COMPLETES]:
        raise CannotStep(f"the verify steps' ranges held a block's end for {ranges}")
    return found


def _waited(after: After) -> bool:
    return bool(after.reads)


def run() -> ProbeResult:
    why = "the V2 runner keeps accepted counts and the align copies on the device"
    steps = v1_steps(NAME, why, _steps)
    if isinstance(steps, ProbeResult):
        return steps
    wrong = []
    for n, (after, want, rid) in enumerate(zip(steps, ACCEPTED, COMPLETES, strict=True), 1):
        # A release whose GPU copy also copies the counts to the host leaves that to it.
        if after.host != want and not (after.copies and not after.reads):
            wrong.append(f"verify step {n}: host counts {after.host}, accepted {want}")
        if after.copies not in ([want], [] if rid is None else [want]):
            wrong.append(
                f"verify step {n} ({rid or 'no request'} can complete a block): "
                f"state copies {after.copies}"
            )
        if not after.reads and not after.events and not after.copies:
            wrong.append(f"verify step {n}: the counts reached neither the host nor a copy")
    first = steps[0]
    evidence = (
        f"hybrid target, DFlash K={K}, blocks of {BLOCK}: verify step 1 (no request can "
        "complete a block) "
        + (
            f"read the counts back at once ({', '.join(first.reads)})"
            if _waited(first)
            else f"did not wait (events {first.events})"
        )
        + f", state copies {len(first.copies)}; "
        + "; ".join(
            f"step {n} ({rid} can) "
            + ("read them back" if _waited(after) else "did not wait")
            + f", the state copy handed {after.copies}"
            for n, (after, rid) in enumerate(zip(steps[1:], COMPLETES[1:], strict=True), 2)
        )
    )
    if wrong:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence="; ".join(wrong) + "; " + evidence)
    return ProbeResult(
        probe=NAME,
        status=ABSENT if _waited(first) else PRESENT,
        evidence=evidence,
        details={f"step {n}": after.__dict__ for n, after in enumerate(steps, 1)},
    )
