"""What every probe needs to run vLLM's own code on a CPU: a platform, configs, a process group.

This module runs inside the probed interpreter, beside whichever vLLM it finds
first on ``sys.path``. It imports only the standard library, torch,
transformers and vLLM, never the rest of the toolchain.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_installed = False


def install_cpu_platform() -> None:
    """Give vLLM a platform on a machine without a GPU.

    vLLM's CUDA platform needs a driver and the unspecified fallback picks no
    attention backend and no device. The probes question the DFlash code, not
    platform detection, so they run on a small CPU platform that selects the
    FLASH_ATTN backend, the one a DFlash drafter runs on on sm90. It must be in
    place before any vLLM module binds ``current_platform``.
    """
    global _installed
    if _installed:
        return
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    class ProbeCpuPlatform(UnspecifiedPlatform):
        device_type = "cpu"
        device_name = "cpu"

        @classmethod
        def get_attn_backend_cls(
            cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
        ) -> str:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            return AttentionBackendEnum.FLASH_ATTN.get_path()

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            # Pinned host buffers need an accelerator's allocator.
            return False

        @classmethod
        def use_custom_allreduce(cls) -> bool:
            # As on CUDA, so a config's choice of all-reduce is the one a GPU gets.
            return True

    platforms._current_platform = ProbeCpuPlatform()
    # Releases from 0.26 read pin-memory support once, at import, into the default of every
    # CPU/GPU buffer: it must be this platform's answer before that module is imported.
    import vllm.utils.torch_utils as torch_utils

    if hasattr(torch_utils, "PIN_MEMORY"):
        torch_utils.PIN_MEMORY = False
    # vLLM inspects model classes in a fresh interpreter so the parent never
    # initialises CUDA. That child would detect the real platform (on a GPU host
    # with no visible device it fails); the probe never touches CUDA, so the
    # inspection runs here, under the CPU platform.
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    # Without a GPU vLLM imports a stand-in for Triton, which lacks cdiv and next_power_of_2;
    # the GDN builder's chunk bookkeeping and DFlash's input kernel's grid call them on ints.
    from vllm.triton_utils import triton

    if not hasattr(triton, "cdiv"):
        triton.cdiv = lambda x, y: (x + y - 1) // y
    if not hasattr(triton, "next_power_of_2"):
        triton.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
    _installed = True


@dataclass
class TinyPair:
    """Config-only tiny target and DFlash drafter folders (no weights needed)."""

    target: Path
    drafter: Path


def write_tiny_pair(
    root: Path,
    *,
    target_layers: int,
    target_layer_ids: list[int],
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    hybrid_target: bool = False,
) -> TinyPair:
    """``hybrid_target``: a Qwen3-Next target (Gated DeltaNet and attention layers, the
    text-only model of Qwen3.6's family) instead of an attention-only Qwen3."""
    from transformers import Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    target = root / "target"
    if hybrid_target:
        from transformers import Qwen3NextConfig

        Qwen3NextConfig(
            num_hidden_layers=target_layers,
            architectures=["Qwen3NextForCausalLM"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **common,
        ).save_pretrained(target)
    else:
        Qwen3Config(
            num_hidden_layers=target_layers, architectures=["Qwen3ForCausalLM"], **common
        ).save_pretrained(target)
    extra: dict[str, Any] = {}
    if layer_types is not None:
        extra.update(layer_types=layer_types, max_window_layers=len(layer_types))
    if sliding_window is not None:
        extra.update(sliding_window=sliding_window, use_sliding_window=True)
    drafter_cfg = Qwen3Config(
        num_hidden_layers=len(layer_types) if layer_types else 2,
        architectures=["DFlashDraftModel"],
        **common,
        **extra,
    )
    drafter_cfg.dflash_config = {
        "target_layer_ids": target_layer_ids,
        "mask_token_id": 511,
        "block_size": 4,
    }
    drafter_cfg.num_target_layers = target_layers
    drafter_cfg.save_pretrained(root / "drafter")
    return TinyPair(target=target, drafter=root / "drafter")


def hybrid_pair(root: Path | None = None) -> TinyPair:
    """The hybrid probes' pair: an 8-layer Qwen3-Next target whose layers 1, 3 and 5 the
    DFlash drafter reads, in ``root`` (default: a scratch folder)."""
    return write_tiny_pair(
        root or scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5], hybrid_target=True
    )


def vllm_config(
    pair: TinyPair,
    *,
    method: str | None = "dflash",
    block_size: int = 16,
    prefix_caching: bool = False,
    cache_dtype: str = "auto",
    num_speculative_tokens: int = 3,
    mamba_cache_mode: str = "none",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    speculative_args: dict[str, Any] | None = None,
    max_num_seqs: int = 4,
) -> Any:
    """A real VllmConfig for ``pair``, built the way the engine builds it;
    ``speculative_args``: more of ``--speculative-config``."""
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=str(pair.target),
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=1024,
    )
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    spec = None
    if method is not None:
        spec = SpeculativeConfig(
            method=method,
            model=str(pair.drafter),
            num_speculative_tokens=num_speculative_tokens,
            target_model_config=model,
            target_parallel_config=parallel,
            **(speculative_args or {}),
        )
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            cache_dtype=cache_dtype,
            mamba_cache_mode=mamba_cache_mode,
        ),
        speculative_config=spec,
        parallel_config=parallel,
    )


def kv_cache_groups(block_size: int, *, mamba: bool = False) -> list[Any]:
    """One attention KV-cache group, and with ``mamba`` a Mamba group (cache mode "align")."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    groups = [
        KVCacheGroupSpec(
            ["layer"],
            FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
    ]
    if mamba:
        groups.append(
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=((1,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            )
        )
    return groups


def scheduler(config: Any, *, block_size: int, num_blocks: int, mamba: bool = False) -> Any:
    """vLLM's real Scheduler for ``config`` over ``num_blocks`` blocks of ``kv_cache_groups``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=kv_cache_groups(block_size, mamba=mamba),
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=False,
    )


def has_v1_runner() -> bool:
    """Whether the probed tree has the V1 model runner (0.34.0 has V2 alone): its spec."""
    from importlib.util import find_spec

    return find_spec("vllm.v1.worker.gpu_model_runner") is not None


def serves_v1(config: Any) -> bool:
    """Whether the V1 runner serves ``config``: from 0.31.0 to 0.33.0 the config chooses."""
    return has_v1_runner() and not getattr(config, "use_v2_model_runner", False)


def has_v1_dflash_proposer() -> bool:
    """Whether the probed tree has V1's DFlash proposer (gone from 0.34.0)."""
    from importlib.util import find_spec

    return find_spec("vllm.v1.spec_decode.dflash") is not None


def model_output(rid: str, sampled: list[int]) -> Any:
    """What the model runner returns for one request that sampled ``sampled``."""
    return model_outputs({rid: sampled})


def model_outputs(sampled: dict[str, list[int]]) -> Any:
    """What the model runner returns for requests that each sampled their tokens."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    rids = list(sampled)
    index: dict[str, Any] = {}
    # 0.34.0 derives the index from req_ids and takes no such argument.
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        index["req_id_to_index"] = {rid: i for i, rid in enumerate(rids)}
    tokens = [sampled[rid] for rid in rids]
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=tokens, **index)


#: vLLM's default capture sizes up to 64 tokens: 1, 2, 4, then every multiple of 8.
CAPTURE_SIZES = [1, 2, 4, *range(8, 65, 8)]


def v1_runner(config: Any) -> Any:
    """vLLM's V1 model runner for ``config`` on the CPU (``CPUModelRunner``, a subclass that
    only moves its buffers to the CPU)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    # The CPU runner has no CUDA streams or events for asynchronous scheduling, which
    # nothing a probe asks of the runner depends on.
    config.scheduler_config.async_scheduling = False
    ensure_single_process_group(config)
    with set_current_vllm_config(config):
        return CPUModelRunner(config, torch.device("cpu"))


def graph_runner(config: Any, cudagraph_mode: str, kv_cache_config: Any) -> Any:
    """A V1 model runner on the CPU (``CPUModelRunner``) whose CUDA-graph mode, capture
    sizes and dispatch keys are resolved by the runner's own code as on a GPU, for a hybrid
    target: the graph support is its Gated DeltaNet layers'.

    The CPU platform resolves graphs off, so ``cudagraph_mode`` (a ``CUDAGraphMode`` name)
    and the default capture sizes are set first, as a CUDA platform would.
    """
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    compilation.cudagraph_capture_sizes = list(CAPTURE_SIZES)
    compilation.max_cudagraph_capture_size = CAPTURE_SIZES[-1]
    runner = v1_runner(config)
    with set_current_vllm_config(config):
        runner.kv_cache_config = kv_cache_config
        runner._check_and_update_cudagraph_mode(
            [{GDNAttentionBackend}], kv_cache_config.kv_cache_groups
        )
    return runner


_distributed = False


def ensure_single_process_group(config: Any) -> None:
    """A world of one over gloo, which model layers need to ask their TP size."""
    global _distributed
    if _distributed:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    _distributed = True


class _KernelRecorder:
    """Stands in for a GPU kernel or its launcher: records each call's arguments, computes nothing.

    Triton kernels are called as ``kernel[grid](**args)``, launchers and
    FlashAttention's wrappers as ``fn(**args)``; both forms land in ``calls``.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> _KernelRecorder:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(dict(kwargs, _args=args))


@contextmanager
def replaced(module: Any, **values: Any) -> Iterator[None]:
    """``module``'s attributes ``values`` (added where it lacks them) for the ``with`` body,
    then as they were: what a CPU lacks of a GPU's kernels, for the code that calls them."""
    missing = object()
    saved = {name: getattr(module, name, missing) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


@contextmanager
def recording(module: Any, *names: str) -> Iterator[_KernelRecorder]:
    """Replace each of ``names`` in ``module`` by one recorder, for the ``with`` body.

    The names that exist are the CUDA entry points a vLLM release calls; the
    recorder keeps what they were given, which is what the probes ask about.
    """
    recorder = _KernelRecorder()
    with replaced(module, **dict.fromkeys(names, recorder)):
        yield recorder


def dflash_v2_query_metadata(config: Any) -> Any:
    """The attention metadata of the DFlash drafter's query pass on the V2 runner (0.34.0,
    which has no V1 proposer): two requests of ``1 + K`` queries over 20 and 11 tokens of
    context, as ``v1/worker/gpu/attn_utils.build_attn_metadata`` hands each KV-cache group
    (the V2 speculator gives each group its causality, ``get_draft_attn_causal``)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    queries = 1 + config.speculative_config.num_speculative_tokens
    query_start = torch.tensor([0, queries, 2 * queries], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start,
        query_start_loc_cpu=query_start.clone(),
        seq_lens=torch.tensor([20 + queries, 11 + queries], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=2 * queries,
        max_query_len=queries,
        max_seq_len=20 + queries,
        block_table_tensor=torch.arange(8, dtype=torch.int32).view(2, 4),
        slot_mapping=torch.zeros(2 * queries, dtype=torch.int64),
    )


def dflash_proposer_metadata(config: Any) -> Any:
    """The attention metadata V1's DFlashProposer builds for its drafter's queries.

    Runs the real proposer's ``set_inputs_first_pass`` on a crafted target
    batch (two requests, 5 and 3 new tokens, 20 and 11 tokens long). The Triton
    kernel that fills the drafter's input buffers on the GPU is recorded, not
    run: the metadata is built around it, not by it. Returns the proposer's
    metadata, or raises what the proposer raised.
    """
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode import dflash

    query_start = torch.tensor([0, 5, 8], dtype=torch.int32)
    target = CommonAttentionMetadata(
        query_start_loc=query_start,
        query_start_loc_cpu=query_start.clone(),
        seq_lens=torch.tensor([20, 11], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=8,
        max_query_len=5,
        max_seq_len=20,
        block_table_tensor=torch.arange(8, dtype=torch.int32).view(2, 4),
        slot_mapping=torch.zeros(8, dtype=torch.int64),
    )
    hidden = config.speculative_config.draft_model_config.hf_config.hidden_size
    with set_current_vllm_config(config):
        proposer = dflash.DFlashProposer(config, torch.device("cpu"))
        kernels = ("copy_and_expand_dflash_inputs_kernel", "_copy_and_expand_dflash_inputs")
        with recording(dflash, *kernels):
            _, _, metadata = proposer.set_inputs_first_pass(
                target_token_ids=torch.zeros(8, dtype=torch.int32),
                next_token_ids=torch.zeros(2, dtype=torch.int32),
                target_positions=torch.arange(8),
                target_hidden_states=torch.zeros(8, 3 * hidden),
                token_indices_to_sample=None,
                cad=target,
                num_rejected_tokens_gpu=None,
            )
    return metadata


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="dflash-probe-", dir=os.environ.get("TMPDIR")))
