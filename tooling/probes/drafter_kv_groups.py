"""Fix 18: a drafter's layers do not multiply a hybrid target's KV-cache groups.

vLLM 0.20.1 splits a hybrid model's layers into KV-cache groups of one size, the count of
its smallest layer type. With DFlash on the seed's pair the drafter's five layers are that
type, so the target's 16 attention and 48 Gated DeltaNet layers go into groups of five:
15 groups where the plain engine has 4, with 6 padding layers, and the runner builds each
group's attention metadata and block table every step.

The probe builds the config ``vllm serve`` builds for the seed's pair (``_schedsim``), with
DFlash at K = 15 and without a drafter, and lets vLLM group the seed's own layer specs
(``get_kv_cache_groups``; from 0.29 after the KV-cache layout an H200's backends
resolve: ``_kvplan``). Fixed means the drafted engine has fewer groups than groups of
its smallest type's size give, with no more padding layers, and the plain engine's
grouping is vLLM's own (groups of 16, 4 of them).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from . import _harness
from ._kvplan import kv_cache_groups
from ._schedsim import Settings, engine_config, h200_platform, kv_cache_specs, seed_pair
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "drafter_kv_groups"
K = 15
PLAIN_GROUPS = 4


def grouping(settings: Settings, root: Any) -> tuple[int, int, list[int]]:
    """vLLM's groups for the seed's layers under ``settings``: how many, how many layers a
    group has, and the layer count of each type."""
    from vllm.platforms import current_platform

    config = engine_config(settings, root)
    current_platform.update_block_size_for_backend(config)
    _, _, layer_types = seed_pair(root)
    specs = kv_cache_specs(config, layer_types)
    groups = kv_cache_groups(config, specs)
    counts = list(Counter(specs.values()).values())
    return len(groups), max(len(g.layer_names) for g in groups), counts


def _smallest_type_groups(counts: list[int]) -> tuple[int, int]:
    """Groups and padding layers when every group has the smallest type's count of layers."""
    size = min(counts)
    groups = sum(math.ceil(n / size) for n in counts)
    return groups, groups * size - sum(counts)


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    with h200_platform():
        try:
            drafted, size, counts = grouping(Settings(K, 8192, 64), root)
            plain, _, _ = grouping(Settings(0, 8192, 64), root)
        except (AttributeError, ImportError) as e:  # a release that groups elsewhere
            return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"cannot ask: {e}")
    padding = drafted * size - sum(counts)
    smallest, smallest_padding = _smallest_type_groups(counts)
    evidence = (
        f"with DFlash at K={K}: {drafted} KV-cache groups of {size} layers ({padding} padding) "
        f"for layer types of {sorted(counts)} layers; groups of the smallest type's "
        f"{min(counts)}: {smallest} ({smallest_padding} padding); without a drafter: {plain}"
    )
    details = {"drafted": drafted, "group_size": size, "padding": padding, "plain": plain}
    if plain != PLAIN_GROUPS:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"plain serving's grouping is not vLLM's 0.20 rule: {evidence}",
            details=details,
        )
    fixed = drafted < smallest and padding <= smallest_padding
    return ProbeResult(
        probe=NAME, status=PRESENT if fixed else ABSENT, evidence=evidence, details=details
    )
