"""Fix 1: DFlash target layers are captured at ``target_layer_ids + 1``.

Asks vLLM's own aux-layer resolution (the V1 model runner's, and the V2
runner's where the tree has one) which hidden states it would capture for a
drafter with ``target_layer_ids`` [1, 16, 31, 46, 61], loaded through the real
SpeculativeConfig. EAGLE3's ``eagle_aux_hidden_state_layer_ids`` are asked too:
they are already in vLLM's convention and must come back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "layer_offset"
TARGET_LAYER_IDS = [1, 16, 31, 46, 61]
EAGLE3_IDS = [2, 17, 32]


def _resolvers() -> list[tuple[str, Callable[[Any], Sequence[int]]]]:
    """(label, function of a SpeculativeConfig) for every aux-layer resolver in the tree: the
    V1 runner's (gone from 0.34.0) and the V2 runner's (from the release that has one)."""
    found: list[tuple[str, Callable[[Any], Sequence[int]]]] = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        pass
    else:

        def v1(spec: Any) -> Sequence[int]:
            runner = object.__new__(GPUModelRunner)
            runner.speculative_config = spec
            return GPUModelRunner._get_eagle3_aux_layers_from_config(runner)

        found.append(("v1 runner", v1))
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils
    except ImportError:
        return found
    found.append(("v2 runner", eagle3_utils.get_eagle3_aux_layers_from_config))
    return found


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=64, target_layer_ids=TARGET_LAYER_IDS
    )
    spec = _harness.vllm_config(pair).speculative_config
    eagle3 = SimpleNamespace(
        draft_model_config=SimpleNamespace(
            hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=EAGLE3_IDS)
        )
    )
    fixed = tuple(i + 1 for i in TARGET_LAYER_IDS)
    # resolver label -> the layers it resolves for the DFlash and the EAGLE3 config.
    seen: dict[str, dict[str, Sequence[int] | None]] = {}
    verdicts = []
    for label, resolve in _resolvers():
        dflash_layers = resolve(spec)
        eagle3_layers = resolve(eagle3)
        seen[label] = {"dflash": dflash_layers, "eagle3": eagle3_layers}
        if dflash_layers is None:
            # This resolver does not read DFlash configs at all (0.20's V2
            # runner, which refuses DFlash), so it is not a DFlash path.
            continue
        if tuple(eagle3_layers or ()) != tuple(EAGLE3_IDS):
            verdicts.append(UNKNOWN)
        elif tuple(dflash_layers or ()) == fixed:
            verdicts.append(PRESENT)
        else:
            verdicts.append(ABSENT)
    shown = "; ".join(
        f"{label}: dflash {v['dflash']}, eagle3 {v['eagle3']}" for label, v in seen.items()
    )
    evidence = f"target_layer_ids {TARGET_LAYER_IDS} -> {shown} (fixed: {fixed})"
    status = (
        UNKNOWN
        if not verdicts
        else PRESENT
        if all(v == PRESENT for v in verdicts)
        else UNKNOWN
        if UNKNOWN in verdicts
        else ABSENT
    )
    if status == UNKNOWN:
        evidence = "EAGLE3 aux layers changed, the resolver is broken: " + evidence
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        form=", ".join(k for k, v in seen.items() if v["dflash"] is not None)
        if status == PRESENT
        else None,
        details={k: {kk: list(vv) if vv else vv for kk, vv in v.items()} for k, v in seen.items()},
    )
