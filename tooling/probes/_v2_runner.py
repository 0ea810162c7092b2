"""What the V2 model runner makes, made by its own code, for the probes that ask it where
the V2 runner serves (0.34.0 has no other):

- two KV-cache groups' attention metadata, through its ``build_attn_metadata``, which
  decides what one group hands the next, at capture and at each step;
- its CUDA-graph manager for the config ``vllm serve`` builds on an H200, which says what
  graphs it captures and where it dispatches a step once they are captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _harness


@dataclass
class V2Groups:
    """Groups of one spec, one builder each, named ``names``, in a KV-cache config of their
    own."""

    groups: list[list[Any]]
    kv_cache_config: Any

    @classmethod
    def of(
        cls, backend: Any, spec: Any, names: tuple[str, ...], builders: tuple[Any, ...]
    ) -> V2Groups:
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.worker.utils import AttentionGroup

        groups = [
            [AttentionGroup(backend, [name], spec, i, metadata_builders=[builder])]
            for i, (name, builder) in enumerate(zip(names, builders, strict=True))
        ]
        config = KVCacheConfig(
            num_blocks=4097,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([name], spec) for name in names],
        )
        return cls(groups, config)

    def build(
        self, batches: tuple[Any, ...], *, capture: bool, model_specific: Any = None
    ) -> dict[str, Any]:
        """Every layer's metadata for the step whose requests ``batches[0]`` describes, each
        group on the block table and slots of its own batch."""
        import torch
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

        first = batches[0]
        upper = getattr(first, "seq_lens_cpu_upper_bound", None)
        prefilling = getattr(first, "is_prefilling", None)
        return build_attn_metadata(
            attn_groups=self.groups,
            num_reqs=first.num_reqs,
            num_tokens=first.num_actual_tokens,
            query_start_loc_gpu=first.query_start_loc,
            query_start_loc_cpu=first.query_start_loc_cpu,
            max_query_len=first.max_query_len,
            seq_lens=first.seq_lens,
            max_seq_len=first.max_seq_len,
            block_tables=[b.block_table_tensor for b in batches],
            slot_mappings=torch.stack([b.slot_mapping for b in batches]),
            kv_cache_config=self.kv_cache_config,
            seq_lens_cpu_upper_bound=first.seq_lens.clone() if upper is None else upper,
            is_prefilling=None if prefilling is None else prefilling & (not capture),
            model_specific_attn_metadata=model_specific,
            for_cudagraph_capture=capture,
        )


def graph_manager(settings: Any, mode: str) -> tuple[Any, Any]:
    """The config ``vllm serve`` builds for the seed's pair with ``settings`` (a
    ``_schedsim.Settings``) under CUDA-graph ``mode``, vLLM's default sizes, and the V2
    runner's ``CudaGraphManager`` for it, made as the runner makes it and marked captured
    (capture needs a GPU; dispatch does not)."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    from ._schedsim import engine_config, h200_platform

    with h200_platform():
        config = engine_config(settings, _harness.scratch_dir())
        config.model_config.enforce_eager = False
        config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
        config.compilation_config.cudagraph_capture_sizes = None
        config.compilation_config.max_cudagraph_capture_size = None
        config._set_cudagraph_sizes()
        _harness.ensure_single_process_group(config)
        # The CPU platform has no CUDA graph pool; the manager only keeps its handle.
        with _harness.replaced(type(current_platform), graph_pool_handle=lambda self: object()):
            manager = CudaGraphManager(
                config,
                torch.device("cpu"),
                CUDAGraphMode[mode],
                decode_query_lens=config.get_decode_cudagraph_query_lens(
                    config.uniform_decode_query_len
                ),
            )
    manager._graphs_captured = True
    return config, manager
