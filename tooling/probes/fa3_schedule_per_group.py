"""Fix 12: every KV-cache group's CUDA graphs read their own FA3 schedule.

Under full CUDA graphs a FlashAttention metadata builder keeps FA3's ahead-of-time
schedule in a buffer of its own, and the graphs it captured read that buffer. The model
runner builds one KV-cache group's metadata and hands it to every other group of the same
spec (``update_block_table``); a DFlash drafter splits a hybrid target's attention layers
into such groups. Where the schedule stays in the first group's buffer, the other groups'
layers replay what their own buffer kept from the last capture: a batch of one, for
which FA3 writes no output in a batch of more.

The probe makes two of this release's FlashAttention builders for one attention spec, from
the real config of a hybrid target with a DFlash drafter under FULL_AND_PIECEWISE graphs,
as FA3 runs them on an H100/H200. A CPU has neither FlashAttention nor its scheduler (a
CUDA kernel), so the version reads 3 and a stand-in scheduler returns a schedule filled with
its batch size. Both builders capture a batch of 4 requests of K+1 tokens, then of 1 (the
runner captures largest first); then a step of 4 requests is built by the first builder
and handed to the second. Fixed means the second builder's buffer holds the step's schedule;
stock leaves the capture of 1 there. Control: the first builder's buffer holds the step's
schedule; where neither builder keeps a schedule under full graphs, the question does not
apply (unknown).

Where the V2 runner serves (0.34.0 has no other), the captures and the step go through its
own ``build_attn_metadata`` over the two groups, which decides whether one group's metadata
is handed to the other; the question is the same: whether the second group's graphs read
the step's schedule.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._v2_runner import V2Groups
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "fa3_schedule_per_group"
K = 3
STEP_REQUESTS = 4
NAMES = ("group-a", "group-b")


def _schedule(batch_size: int, **_: Any) -> Any:
    """FA3's schedule layout for ``batch_size`` (a semaphore, then three vectors of
    round_up(batch, 4)), every entry the batch size, so a buffer says whose it is."""
    import torch

    padded = (batch_size + 3) // 4 * 4
    return torch.full((1 + 3 * padded,), batch_size, dtype=torch.int32)


def _batch(requests: int) -> Any:
    """Common metadata of ``requests`` requests verifying K drafts each (K+1 tokens)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    tokens = K + 1
    starts = torch.arange(requests + 1, dtype=torch.int32) * tokens
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=torch.full((requests,), 40, dtype=torch.int32),
        num_reqs=requests,
        num_actual_tokens=requests * tokens,
        max_query_len=tokens,
        max_seq_len=40,
        block_table_tensor=torch.zeros((requests, 4), dtype=torch.int32),
        slot_mapping=torch.zeros(requests * tokens, dtype=torch.int64),
    )


def _v1_steps(first: Any, second: Any, spec: Any) -> tuple[Any, Any, str]:
    """The second group's captured metadata and the first's step, as 0.20.1's V1 runner
    makes them: each group captures on its own build; each step one is handed on."""
    import torch

    captured = {}
    for requests in (STEP_REQUESTS, 1):
        for builder in (first, second):
            captured[builder, requests] = builder.build_for_cudagraph_capture(_batch(requests))
    built = first.build(common_prefix_len=0, common_attn_metadata=_batch(STEP_REQUESTS))
    second.update_block_table(
        built, torch.zeros((STEP_REQUESTS, 4), dtype=torch.int32), built.slot_mapping
    )
    return captured[second, STEP_REQUESTS], built, "handed from one builder to the other"


def _v2_steps(first: Any, second: Any, spec: Any) -> tuple[Any, Any, str]:
    """The same, made by the V2 runner's own ``build_attn_metadata``."""
    from vllm.v1.attention.backends import flash_attn

    groups = V2Groups.of(flash_attn.FlashAttentionBackend, spec, NAMES, (first, second))
    captured = {
        requests: groups.build((_batch(requests),) * 2, capture=True)[NAMES[1]]
        for requests in (STEP_REQUESTS, 1)
    }
    step = groups.build((_batch(STEP_REQUESTS),) * 2, capture=False)
    return captured[STEP_REQUESTS], step[NAMES[0]], "built by the V2 runner's build_attn_metadata"


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    import torch
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    pair = _harness.hybrid_pair()
    config = _harness.vllm_config(pair, num_speculative_tokens=K)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = 32
    model = config.model_config
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        dtype=torch.bfloat16,
    )
    with (
        set_current_vllm_config(config),
        _harness.replaced(
            flash_attn, get_flash_attn_version=lambda *a, **k: 3, get_scheduler_metadata=_schedule
        ),
    ):
        first, second = (
            flash_attn.FlashAttentionMetadataBuilder(spec, [name], config, torch.device("cpu"))
            for name in NAMES
        )
        buffers = [getattr(b, "scheduler_metadata", None) for b in (first, second)]
        if any(buffer is None for buffer in buffers):
            return ProbeResult(
                probe=NAME,
                status=UNKNOWN,
                evidence="no FlashAttention builder keeps an FA3 schedule under full CUDA "
                "graphs here: the question does not apply",
            )
        steps = _v1_steps if _harness.serves_v1(config) else _v2_steps
        captured, built, how = steps(first, second, spec)
    n = built.scheduler_metadata.shape[0]
    holds = {
        "first builder's buffer": sorted({int(x) for x in first.scheduler_metadata[:n]}),
        "second builder's buffer": sorted({int(x) for x in second.scheduler_metadata[:n]}),
    }
    # The buffer the second group's graph was captured reading is the one it replays.
    reads_own = captured.scheduler_metadata.data_ptr() == second.scheduler_metadata.data_ptr()
    read = holds["second builder's buffer" if reads_own else "first builder's buffer"]
    evidence = (
        f"after captures of {STEP_REQUESTS} and 1 requests and a step of {STEP_REQUESTS} "
        f"{how}, the schedule's batch sizes: {holds}; the second group's graph "
        f"reads {'its own' if reads_own else 'the first'} builder's buffer"
    )
    if holds["first builder's buffer"] != [STEP_REQUESTS]:
        status = UNKNOWN
        evidence = "the first builder's own step left another schedule: " + evidence
    else:
        status = PRESENT if read == [STEP_REQUESTS] else ABSENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={**holds, "second group's graph reads its own buffer": reads_own},
    )
