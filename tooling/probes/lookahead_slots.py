"""Fix 4: the scheduler reserves every KV slot DFlash's first drafter pass writes.

DFlash's first pass writes K+1 query slots (the bonus token and K masks) at
positions last+1 .. last+1+K, where last is the request's last valid position
after the step; a position with no block of the request behind it resolves
through a stale block-table tail into another request's block. This probe
runs vLLM's real Scheduler for a DFlash SpeculativeConfig (16-token blocks)
and counts, per case, how many of those K+1 positions lie past the blocks the
scheduler gave the request for the step:

- the first prefill of a 32-token prompt, K=3 and K=15;
- a decode step in which every one of K=3 drafts is accepted (the model runner's
  output is fed back through ``update_from_output``), for every prompt length
  of one block's span, so the end of the reservation meets a block boundary
  whatever rounding the release applies.

Fixed means none falls outside in any case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "lookahead_slots"
BLOCK = 16
PREFILL_PROMPT = 32
PREFILL_KS = (3, 15)
DECODE_K = 3
#: Enough blocks that no case ever waits for memory.
NUM_BLOCKS = 64


@dataclass(frozen=True)
class Case:
    label: str
    num_spec_tokens: int
    prompt_len: int
    decode: bool


class NotScheduled(Exception):
    """The scheduler did not run the step the case needs (a release that schedules otherwise)."""


def slots_outside(config: Any, case: Case) -> int:
    """How many of the K+1 first-pass positions after the case's step have no block."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    k = case.num_spec_tokens
    rid = "probe"
    scheduler = _harness.scheduler(config, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    scheduler.add_request(
        Request(
            request_id=rid,
            prompt_token_ids=list(range(1, case.prompt_len + 1)),
            sampling_params=SamplingParams(max_tokens=64),
            pooling_params=None,
        )
    )
    out = scheduler.schedule()
    if out.num_scheduled_tokens.get(rid) != case.prompt_len:
        raise NotScheduled(f"the {case.prompt_len}-token prompt was not prefilled in one step")
    if case.decode:
        scheduler.update_from_output(out, _harness.model_output(rid, [7]))
        scheduler.update_draft_token_ids(DraftTokenIds([rid], [[8] * k]))
        out = scheduler.schedule()
        if len(out.scheduled_spec_decode_tokens.get(rid, ())) != k:
            raise NotScheduled(f"the decode step did not carry the {k} drafts")
        # Every draft accepted, plus the bonus token.
        scheduler.update_from_output(out, _harness.model_output(rid, [8] * k + [9]))
    request = scheduler.requests[rid]
    # The prefill's sampled token is not computed yet: the last valid position
    # is the last computed one (for a decode, after the accepted drafts).
    last = request.num_computed_tokens - 1
    covered = len(scheduler.kv_cache_manager.get_block_ids(rid)[0]) * BLOCK
    return sum(1 for pos in range(last + 1, last + 2 + k) if pos >= covered)


def _prompt(case: Case) -> str:
    if case.decode:
        return f"worst of the {BLOCK + 1}..{2 * BLOCK}-token prompts: {case.prompt_len}"
    return f"{case.prompt_len}-token prompt"


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    configs = {
        k: _harness.vllm_config(pair, method="dflash", num_speculative_tokens=k)
        for k in {*PREFILL_KS, DECODE_K}
    }
    prefill = [Case("first prefill", k, PREFILL_PROMPT, decode=False) for k in PREFILL_KS]
    decode = [
        Case("decode all-accepted", DECODE_K, n, decode=True)
        for n in range(BLOCK + 1, 2 * BLOCK + 1)
    ]
    try:
        results = [(c, slots_outside(configs[c.num_spec_tokens], c)) for c in prefill]
        # The worst prompt length decides the decode case.
        results.append(
            max(
                ((c, slots_outside(configs[c.num_spec_tokens], c)) for c in decode),
                key=lambda r: r[1],
            )
        )
    except NotScheduled as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot run a case: {e}")
    cases = "; ".join(
        f"{c.label} K={c.num_spec_tokens} ({_prompt(c)}): {n} of {c.num_spec_tokens + 1} outside"
        for c, n in results
    )
    return ProbeResult(
        probe=NAME,
        status=ABSENT if any(n for _, n in results) else PRESENT,
        evidence=f"{BLOCK}-token blocks, first-pass DFlash slots outside the request's blocks: "
        + cases,
        details={
            "outside": {f"{c.label} K={c.num_spec_tokens}": n for c, n in results},
            "decode_prompt_len": results[-1][0].prompt_len,
        },
    )
