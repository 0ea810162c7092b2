"""vLLM's real Scheduler and KV-cache manager, driven step by step on a CPU for the seed's geometry.

One ``Case`` is the serving settings a user gives and a workload drawn step by step
(arrivals, prompts of given lengths over shared prefixes, aborts, stop tokens); ``run``
builds the engine's config the way ``vllm serve`` does (``EngineArgs`` on a platform with
an H200's memory and name, so vLLM's own defaults apply), sizes the attention block with
vLLM's own block-size code for the FlashAttention backend an H200 runs, groups the KV
cache with vLLM's own grouping, and steps the Scheduler the way the engine core does
(synchronously, or with the batch queue of asynchronous scheduling). Only the model is
stood in for: each step's output accepts a drawn number of drafts.

The oracles, each a ``Finding`` kind:

- ``stall``: a step schedules nothing while a request is unfinished and nothing is in
  flight (the engine would repeat that step for ever);
- ``starve``: a prompt still prefilling is passed over in step after step that leaves part
  of the budget unused, a sequence slot free and free blocks for a whole request;
- ``livelock``: the workload does not finish within a step bound set by its own size;
- ``slot``: a KV slot written in a step lies outside the blocks the request holds then
  (the target's tokens, and DFlash's first drafter pass at last+1 .. last+1+K);
- ``mamba-state``: with prefix caching on a hybrid target (Mamba cache mode "align"), a
  prefill chunk crosses a block boundary without ending on it, so the state the block is
  cached with is another position's;
- ``stale-drafts``: with asynchronous scheduling, a request is scheduled with drafts though
  it was not in the previous batch, whose drafts the worker fills in: it would verify
  placeholder ids (the GPU fuzzer's first crash);
- ``leak``: when every request has finished, a block is still held, freed twice, or
  missing from the free list;
- ``late-refusal``: a setting accepted at start-up and refused only once the weights
  would have loaded (vLLM sizes the attention block after loading the model);
- ``crash``: vLLM's code raised.

A setting refused while the config is built (before any weights load) is ``refused``:
an answer, not a finding. Runs inside the probed interpreter: standard library, torch,
transformers and vLLM only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import _harness
from ._kvplan import kv_cache_config, kv_cache_groups, max_memory_usage, null_block_reserve

#: The seed's target (Qwen3.6-27B): every fourth of 64 layers gated attention, the rest Gated
#: DeltaNet, with its heads. Qwen3-Next is the text model of its family in vLLM 0.20.1 and
#: shares the GDN state shapes and the block-size code; the hidden width changes no KV shape.
SEED_LAYERS = 64
SEED_ATTENTION = {"num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256}
SEED_GDN = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
#: z-lab's drafter: five Qwen3 layers (four sliding, one full) of another KV shape.
DRAFTER_LAYERS = 5
DRAFTER_ATTENTION = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
VOCAB = 248320
#: An H200 as vLLM's defaults see it (``EngineArgs.get_batch_defaults``).
H200_MEMORY = 141 * 2**30
H200_NAME = "NVIDIA H200"

#: vLLM's refusal of a KV cache too small for one request, the one it can only make once the
#: weights have loaded and the memory left is known.
LATE_REFUSAL = "To serve at least one request"
OUTCOME_PASS = "pass"
OUTCOME_REFUSED = "refused"
KINDS = (
    "stall",
    "starve",
    "livelock",
    "slot",
    "mamba-state",
    "stale-drafts",
    "leak",
    "late-refusal",
    "crash",
)


@dataclass(frozen=True)
class Settings:
    """What a user sets on ``vllm serve``; None leaves vLLM's default (an H200's)."""

    k: int
    """num_speculative_tokens of the DFlash drafter; 0 serves without speculation."""
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    prefix_caching: bool | None = None
    async_scheduling: bool | None = None
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    kv_cache_dtype: str = "auto"
    gdn_state_dtype: str = "auto"
    """``mamba_ssm_cache_dtype``: "auto" (the model's bf16) or "float32"."""
    kv_memory_factor: float = 64.0
    """KV-cache memory as a multiple of what one request of max_model_len needs."""
    spec_tokens_by_batch: tuple[tuple[int, int, int], ...] = ()
    """``num_speculative_tokens_per_batch_size`` as (first, last running requests, K)
    ranges; empty: not set."""
    join_hold_steps: int = 0
    """``join_hold_steps`` of the speculative config (fix 33); 0: not set."""
    prefill_schedule_interval: int = 0
    """``--prefill-schedule-interval`` (vLLM's own prefill cadence, from a release after
    0.20.1); 0: not set."""


@dataclass(frozen=True)
class Req:
    """One request of a workload; its token ids follow from its prefix and index."""

    arrival: int
    prompt_len: int
    max_tokens: int
    prefix: int = -1
    """A shared prefix's id (its tokens are the same in every request naming it), or -1."""
    prefix_len: int = 0
    min_tokens: int = 0
    stop: bool = False
    """Ask to stop at token STOP_TOKEN, which the model emits now and then."""
    abort_at: int = -1
    """The step at which the client aborts it, or -1."""


@dataclass(frozen=True)
class Case:
    settings: Settings
    requests: tuple[Req, ...]
    seed: int = 0
    """Seeds the model's stand-in: which drafts it accepts, which tokens it emits."""

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self.settings)
        # Unset, as in every case saved before fix 33: such a case reads the same anywhere.
        if not settings["join_hold_steps"]:
            del settings["join_hold_steps"]
        if not settings["prefill_schedule_interval"]:
            del settings["prefill_schedule_interval"]
        return {
            "settings": settings,
            "requests": [asdict(r) for r in self.requests],
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        return cls(
            settings=_settings(data["settings"]),
            requests=tuple(Req(**r) for r in data["requests"]),
            seed=int(data.get("seed", 0)),
        )


def _settings(data: dict[str, Any]) -> Settings:
    """Settings from a case file, whose JSON lists the schedule's ranges as lists."""
    values = dict(data)
    values["spec_tokens_by_batch"] = tuple(
        tuple(int(x) for x in r) for r in values.get("spec_tokens_by_batch", ())
    )
    return Settings(**values)


@dataclass
class Outcome:
    outcome: str
    """"pass", "refused" or a finding's kind (KINDS)."""
    detail: str = ""
    steps: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    """The engine as built: attention block, step budget, KV blocks, the values used."""

    @property
    def is_finding(self) -> bool:
        return self.outcome in KINDS


class Finding(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


STOP_TOKEN = 7
_PAIRS: dict[str, Any] = {}


def seed_pair(root: Path) -> Any:
    """Config-only target and drafter of the seed's geometry under ``root`` (once)."""
    if str(root) in _PAIRS:
        return _PAIRS[str(root)]
    target, drafter = root / "target", root / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1792,
        "max_position_embeddings": 262144,
        "rope_theta": 1e7,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(SEED_LAYERS)
    ]
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3NextForCausalLM"],
                "model_type": "qwen3_next",
                "num_hidden_layers": SEED_LAYERS,
                "full_attention_interval": 4,
                "layer_types": layer_types,
                "partial_rotary_factor": 0.25,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                **SEED_ATTENTION,
                **SEED_GDN,
                **common,
            }
        )
    )
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "model_type": "qwen3",
                "num_hidden_layers": DRAFTER_LAYERS,
                "max_window_layers": DRAFTER_LAYERS,
                "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
                "sliding_window": 2048,
                "use_sliding_window": True,
                "rms_norm_eps": 1e-6,
                "num_target_layers": SEED_LAYERS,
                "block_size": 16,
                "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "mask_token_id": 248070},
                **DRAFTER_ATTENTION,
                **common,
            }
        )
    )
    _PAIRS[str(root)] = (target, drafter, layer_types)
    return _PAIRS[str(root)]


@contextmanager
def h200_platform() -> Iterator[None]:
    """The probes' CPU platform answering as an H200 does for the ``with`` body: its memory
    and name (vLLM's batch defaults), the FlashAttention backend vLLM would find in the
    loaded layers (the attention block), and a hybrid model's KV-cache groups kept apart."""
    _harness.install_cpu_platform()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    with _harness.replaced(
        type(current_platform),
        get_device_total_memory=classmethod(lambda cls, device_id=0: H200_MEMORY),
        get_device_name=classmethod(lambda cls, device_id=0: H200_NAME),
        _find_non_ssm_backend=classmethod(lambda cls, cfg: FlashAttentionBackend),
        support_hybrid_kv_cache=classmethod(lambda cls: True),
    ):
        yield


def engine_config(settings: Settings, root: Path) -> Any:
    """The VllmConfig ``vllm serve`` builds for ``settings`` (raises what vLLM raises)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    target, drafter, _ = seed_pair(root)
    spec = None
    if settings.k:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": settings.k}
        if settings.spec_tokens_by_batch:
            spec["num_speculative_tokens_per_batch_size"] = [
                list(r) for r in settings.spec_tokens_by_batch
            ]
        if settings.join_hold_steps:
            spec["join_hold_steps"] = settings.join_hold_steps
    # Only where set: a release without the cadence has no such argument.
    cadence = (
        {"prefill_schedule_interval": settings.prefill_schedule_interval}
        if settings.prefill_schedule_interval
        else {}
    )
    args = EngineArgs(
        **cadence,
        model=str(target),
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        enable_prefix_caching=settings.prefix_caching,
        async_scheduling=settings.async_scheduling,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        kv_cache_dtype=settings.kv_cache_dtype,
        mamba_ssm_cache_dtype=settings.gdn_state_dtype,
        speculative_config=spec,
    )
    return args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def kv_cache_specs(config: Any, layer_types: list[str]) -> dict[str, Any]:
    """Each layer's KV-cache spec, as the seed's layers give theirs once the block is sized."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

    cache = config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    dtype = (
        config.model_config.dtype
        if cache.cache_dtype == "auto"
        else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    )
    quant = get_kv_quant_mode(cache.cache_dtype)

    def attention(heads: dict[str, int]) -> Any:
        return FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=heads["num_key_value_heads"],
            head_size=heads["head_dim"],
            head_size_v=heads["head_dim"],
            dtype=dtype,
            kv_quant_mode=quant,
        )

    spec = config.speculative_config
    mamba = MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(config)),
        dtypes=model_cls.get_mamba_state_dtype_from_config(config),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type="gdn_attention",
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=spec.num_speculative_tokens if spec else 0,
    )
    specs: dict[str, Any] = {}
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = attention(SEED_ATTENTION)
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba
    if spec is not None:
        for j in range(DRAFTER_LAYERS):
            specs[f"draft_model.layers.{j}.self_attn.attn"] = attention(DRAFTER_ATTENTION)
    return specs


@dataclass
class Engine:
    """The scheduler side of an engine core, with the facts the oracles read."""

    config: Any
    scheduler: Any
    hasher: Any
    attention_groups: list[int]
    block_size: int
    facts: dict[str, Any]


def build_engine(settings: Settings, root: Path) -> Engine | Outcome:
    """The engine for ``settings``, or the outcome of a setting refused on the way."""
    from vllm.platforms import current_platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        config = engine_config(settings, root)
    except Exception as e:  # vLLM's own start-up refusal, before any weights load
        return Outcome(OUTCOME_REFUSED, _one_line(e))
    sched = config.scheduler_config
    facts: dict[str, Any] = {
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
        "budget": sched.max_num_scheduled_tokens or sched.max_num_batched_tokens,
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
    }
    # From here on vLLM has loaded the weights: what it refuses now, it refuses late.
    try:
        current_platform.update_block_size_for_backend(config)
        facts["block_size"] = config.cache_config.block_size
        _, _, layer_types = seed_pair(root)
        specs = kv_cache_specs(config, layer_types)
        memory = int(smallest_kv_memory(config, specs) * settings.kv_memory_factor)
        kv_config = kv_cache_config(config, specs, memory)
        scheduler_kv = generate_scheduler_kv_cache_config([kv_config])
        config.cache_config.num_gpu_blocks = scheduler_kv.num_blocks
        config.cache_config.block_size = min(
            g.kv_cache_spec.block_size for g in scheduler_kv.kv_cache_groups
        )
        config.validate_block_size()
    except Exception as e:
        # vLLM's own refusals at this point are its assertions and its KV-memory check;
        # anything else means this vLLM builds its engine otherwise, and the case no answer.
        late = isinstance(e, AssertionError) or LATE_REFUSAL in str(e)
        kind = "late-refusal" if late else "crash"
        return Outcome(kind, _one_line(e), facts=facts)
    block, hash_block = resolve_kv_cache_block_sizes(scheduler_kv, config)
    facts.update(
        block_size=config.cache_config.block_size,
        num_blocks=scheduler_kv.num_blocks,
        kv_groups=len(scheduler_kv.kv_cache_groups),
    )
    hasher = None
    if config.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block, hash_fn)
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=config,
        kv_cache_config=scheduler_kv,
        structured_output_manager=StructuredOutputManager(config),
        log_stats=False,
        block_size=block,
        hash_block_size=hash_block,
    )
    groups = [
        i
        for i, g in enumerate(scheduler_kv.kv_cache_groups)
        if isinstance(g.kv_cache_spec, FullAttentionSpec)
    ]
    return Engine(config, scheduler, hasher, groups, config.cache_config.block_size, facts)


def smallest_kv_memory(config: Any, specs: dict[str, Any]) -> int:
    """The least KV-cache memory this vLLM starts with: what its own check asks for one
    request of max_model_len (over the KV-cache groups it makes of ``specs``), and the null
    block where its check holds that back too."""
    groups = kv_cache_groups(config, specs)
    usage = max_memory_usage(config, groups)
    return usage + null_block_reserve(config, specs, groups, usage, LATE_REFUSAL)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300]


def prompt_tokens(index: int, req: Req) -> list[int]:
    """The request's prompt: its prefix's tokens, then tokens of its own (never STOP_TOKEN)."""
    prefix = [1000 + (req.prefix * 7919 + i * 31) % 90000 for i in range(req.prefix_len)]
    own = [100000 + (index * 104729 + i * 17) % 140000 for i in range(req.prompt_len - len(prefix))]
    return (prefix + own)[: req.prompt_len]


def engine_request(index: int, req: Req, hasher: Any) -> Any:
    """vLLM's ``Request`` for the workload's request ``index``, greedy, as the engine core
    receives it (``r<index>``, its prompt from :func:`prompt_tokens`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=req.max_tokens,
        min_tokens=min(req.min_tokens, req.max_tokens),
        stop_token_ids=[STOP_TOKEN] if req.stop else None,
        ignore_eos=True,
        temperature=0.0,
    )
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=prompt_tokens(index, req),
        sampling_params=params,
        pooling_params=None,
        block_hasher=hasher,
    )
