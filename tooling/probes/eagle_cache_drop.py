"""Fix 3: DFlash keeps every full prefix block; EAGLE's last-block drop does not apply.

Runs vLLM's real Scheduler (the KV-cache manager it builds for a DFlash
SpeculativeConfig, prefix caching on, 16-token blocks): one 200-token request
is scheduled and finished, then the same prompt again, and the scheduler says
how many tokens it takes from the prefix cache. A control run without
speculation gives the number every full block yields. Behaviour decides; the
API name that answers (ours or upstream's) is reported as the form.
"""

from __future__ import annotations

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "eagle_cache_drop"
BLOCK = 16
PROMPT_LEN = 200
#: Names under which a vLLM tree may answer "does this method drop the last block?"
DROP_APIS = ("requires_eagle_cache_drop", "needs_eagle_block_drop")


def cached_tokens_on_repeat(config) -> int:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    blocks = 64
    config.cache_config.num_gpu_blocks = blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    prompt = list(range(1, PROMPT_LEN + 1))

    def request(rid: str) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=hasher,
        )

    scheduler.add_request(request("first"))
    scheduler.schedule()
    scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(request("again"))
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    return int(new.num_computed_tokens)


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    control = cached_tokens_on_repeat(_harness.vllm_config(pair, method=None, prefix_caching=True))
    dflash_config = _harness.vllm_config(pair, method="dflash", prefix_caching=True)
    dflash = cached_tokens_on_repeat(dflash_config)
    spec = dflash_config.speculative_config
    apis = {name: bool(getattr(spec, name)()) for name in DROP_APIS if hasattr(spec, name)}
    form = ", ".join(f"{k}() -> {v}" for k, v in apis.items()) or None
    if dflash == control:
        status = PRESENT
    elif dflash == control - BLOCK:
        status = ABSENT
    else:
        status = UNKNOWN
    evidence = (
        f"repeated {PROMPT_LEN}-token prompt, {BLOCK}-token blocks: {dflash} tokens from the "
        f"prefix cache with DFlash, {control} without speculation"
    )
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form=form if status == PRESENT else None,
        details={"cached_dflash": dflash, "cached_no_spec": control, "apis": apis},
    )
