"""Fix 6: compiled graphs are keyed to the DFlash drafter's target layers.

The target's compiled forward captures the aux hidden states the drafter
reads, so the layer ids are baked into every graph vLLM caches, and the
caches are keyed by ``VllmConfig.compute_hash()``. The probe builds the real
VllmConfig for one target and one drafter folder twice, the drafter's
``target_layer_ids`` changed in between and nothing else, and asks for that
hash each time. Fixed: the two hashes differ. A third, unchanged config must
hash as the first, or the hash is not a key at all (unknown).

From the release whose VllmConfig has no ``compute_hash`` (0.34.0), the cache key's config
part is ``compute_env_and_config_hashes``' config hash (``vllm.compilation.caching``), which
the compile backend folds into the cache folder's name: the probe asks that one.
"""

from __future__ import annotations

import json
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "compile_key"
FIRST_IDS = [1, 3, 5]
OTHER_IDS = [1, 3, 6]


def config_key(config: Any) -> str:
    """The config's part of the compile cache's key, as the release computes it."""
    if hasattr(config, "compute_hash"):
        return str(config.compute_hash())
    from vllm.compilation.caching import compute_env_and_config_hashes

    return str(compute_env_and_config_hashes(config)[1])


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=FIRST_IDS
    )
    config_json = pair.drafter / "config.json"

    def key_with(ids: list[int]) -> str:
        data = json.loads(config_json.read_text())
        data["dflash_config"]["target_layer_ids"] = ids
        config_json.write_text(json.dumps(data))
        return config_key(_harness.vllm_config(pair))

    first = key_with(FIRST_IDS)
    other = key_with(OTHER_IDS)
    again = key_with(FIRST_IDS)
    if first != again:
        status = UNKNOWN
    elif first != other:
        status = PRESENT
    else:
        status = ABSENT
    evidence = (
        f"the compile cache's config key with target_layer_ids {FIRST_IDS}: {first[:10]}, "
        f"{OTHER_IDS}: {other[:10]}, {FIRST_IDS} again: {again[:10]} "
        "(fixed: the first two differ)"
    )
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form="the compile cache's config key covers target_layer_ids"
        if status == PRESENT
        else None,
        details={"first": first, "other": other, "again": again},
    )
