"""vLLM's KV-cache planning as the engine core does it, on every release the probes read:
the functions moved from ``kv_cache_utils`` to ``kv_cache_planning`` from 0.29, where the
engine core also resolves one KV-cache layout before it groups the layers."""

from __future__ import annotations

from typing import Any


def kv_planning(name: str) -> Any:
    """vLLM's KV-cache planning function ``name``: in ``kv_cache_utils`` through 0.28,
    moving to ``kv_cache_planning`` from 0.29 (where the engine core plans the cache)."""
    import importlib

    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise AttributeError(f"no {name} in kv_cache_planning nor kv_cache_utils")


def resolve_kv_cache_layout(config: Any, specs: list[Any]) -> None:
    """From 0.29 the engine core resolves one KV-cache layout before it groups the layers
    (the grouping packs block-outermost layouts apart): resolve it as the core does on an
    H200, from what its FlashAttention and Gated DeltaNet backends support. Earlier
    releases have no layout to resolve."""
    try:
        from vllm.v1.attention.backends import utils
    except ImportError:
        return
    if not hasattr(utils, "resolve_kv_cache_layout"):
        return
    if getattr(config.cache_config, "kv_cache_layout", None) is not None:
        return
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    backends = (FlashAttentionBackend, GDNAttentionBackend)
    supported = [layout.name for layout in utils.get_supported_kv_cache_layouts(backends)]
    utils.resolve_kv_cache_layout(config, [supported], specs)


def kv_cache_groups(config: Any, specs: dict[str, Any]) -> list[Any]:
    """vLLM's own grouping of ``specs``, after the layout it would resolve."""
    resolve_kv_cache_layout(config, list(specs.values()))
    return list(kv_planning("get_kv_cache_groups")(config, dict(specs)))


def kv_cache_config(config: Any, specs: dict[str, Any], memory: int) -> Any:
    """The one worker's KV-cache config vLLM makes of ``specs`` in ``memory`` bytes (from
    0.29 over the global groups the engine core computes first)."""
    resolve_kv_cache_layout(config, list(specs.values()))
    configs = kv_planning("get_kv_cache_configs")
    try:
        global_groups = kv_planning("get_global_kv_cache_groups")
    except AttributeError:
        (kv_config,) = configs(config, [specs], [memory])
    else:
        (kv_config,) = configs(config, [specs], [memory], global_groups(config, [specs]))
    return kv_config


def max_memory_usage(config: Any, groups: list[Any]) -> int:
    """The bytes vLLM's own memory check asks for one request of max_model_len over
    ``groups`` (from 0.34 through the platform's KV-cache config builder)."""
    usage = kv_planning("_max_memory_usage_bytes_from_groups")
    try:
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    except ImportError:
        return int(usage(config, groups))
    return int(usage(get_kv_cache_config_builder(config), config, groups))


def null_block_reserve(
    config: Any, specs: dict[str, Any], groups: list[Any], usage: int, refusal: str
) -> int:
    """The bytes of the null block the release's start-up check holds back beside one
    request's ``usage``: none through 0.28 (whose pool then kept its null block from that
    request: fix 15), one block where the check refuses ``usage`` itself (0.34.0 reserves
    it, so the least it starts with is one block more). Asked of the release, not assumed
    by version."""
    try:
        per_block = kv_planning("_pool_bytes_per_block_from_builder")
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    except (AttributeError, ImportError):
        return 0
    try:
        kv_cache_config(config, specs, usage)
    except ValueError as e:
        if refusal not in str(e):
            raise
        return int(per_block(get_kv_cache_config_builder(config), config, groups))
    return 0
