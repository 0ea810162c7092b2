"""Fix 3: DFlash keeps every full prefix block; EAGLE's last-block drop does not apply.

Runs vLLM's real Scheduler (the KV-cache manager it builds for a DFlash
SpeculativeConfig, prefix caching on, 16-token blocks): one 200-token request
is scheduled and finished, then the same prompt again, and the scheduler says
how many tokens it takes from the prefix cache. Two KV layouts: attention
only, and a hybrid target (an attention group and a Mamba group, mamba cache
mode "align", chunked prefill), where the scheduler also prunes its
block-aligned prefill chunks for EAGLE. A control run without speculation
gives, per layout, the number every full block yields. Behaviour decides; the
API name that answers (ours or upstream's) is reported as the form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

if TYPE_CHECKING:
    from vllm.config import VllmConfig

NAME = "eagle_cache_drop"
BLOCK = 16
PROMPT_LEN = 200
#: Names under which a vLLM tree may answer "does this method drop the last block?"
DROP_APIS = ("requires_eagle_cache_drop", "needs_eagle_block_drop")


def cached_tokens_on_repeat(config: Any, *, hybrid: bool = False) -> int:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    scheduler = _harness.scheduler(config, block_size=BLOCK, num_blocks=64, mamba=hybrid)
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


@dataclass(frozen=True)
class Layout:
    """Tokens the repeated prompt takes from the prefix cache, with DFlash and without."""

    name: str
    dflash: int
    no_spec: int

    def describe(self) -> str:
        return f"{self.name}: {self.dflash} with DFlash, {self.no_spec} without speculation"


def _layout(pair: Any, name: str, *, hybrid: bool) -> tuple[Layout, VllmConfig]:
    mode = "align" if hybrid else "none"
    configs = {
        method: _harness.vllm_config(
            pair, method=method, prefix_caching=True, mamba_cache_mode=mode
        )
        for method in ("dflash", None)
    }
    cached = {m: cached_tokens_on_repeat(c, hybrid=hybrid) for m, c in configs.items()}
    return Layout(name, cached["dflash"], cached[None]), configs["dflash"]


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    attention, dflash_config = _layout(pair, "attention only", hybrid=False)
    hybrid, _ = _layout(pair, 'attention + Mamba ("align")', hybrid=True)
    layouts = (attention, hybrid)
    spec = dflash_config.speculative_config
    apis = {name: bool(getattr(spec, name)()) for name in DROP_APIS if hasattr(spec, name)}
    form = ", ".join(f"{k}() -> {v}" for k, v in apis.items()) or None
    if all(lay.dflash == lay.no_spec for lay in layouts):
        status = PRESENT
    elif any(lay.dflash == lay.no_spec - BLOCK for lay in layouts):
        # One layout dropping exactly the last block is the bug, whatever the
        # other does (0.28.0 takes nothing from the hybrid cache for DFlash).
        status = ABSENT
    else:
        status = UNKNOWN
    evidence = (
        f"repeated {PROMPT_LEN}-token prompt, {BLOCK}-token blocks, tokens from the prefix "
        "cache: " + "; ".join(lay.describe() for lay in layouts)
    )
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form=form if status == PRESENT else None,
        details={
            "cached_dflash": attention.dflash,
            "cached_no_spec": attention.no_spec,
            "hybrid_cached_dflash": hybrid.dflash,
            "hybrid_cached_no_spec": hybrid.no_spec,
            "apis": apis,
        },
    )
