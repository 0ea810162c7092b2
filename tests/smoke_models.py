"""Model folders for the smoke's CPU tests: a config and safetensors headers that declare the
weights' size, with no weights behind them (a 55 GB model in a few hundred bytes)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tooling.smoke.serving.tiny import TinySpec, drafter_config, hybrid_config

#: z-lab's Qwen3.6-27B-DFlash drafter, as declared beside a seed-shaped target.
SEED_DRAFTER_BYTES = int(3.5 * 10**9)


def write_model(folder: Path, config: dict, nbytes: int, shards: int = 1) -> None:
    """``config.json`` and safetensors headers declaring ``nbytes`` of bf16 weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i in range(shards):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        size = nbytes // shards
        header = json.dumps(
            {
                "__metadata__": {"format": "pt"},
                f"w{i}": {"dtype": "BF16", "shape": [size // 2], "data_offsets": [0, size]},
            }
        ).encode()
        (folder / name).write_bytes(struct.pack("<Q", len(header)) + header)
        weight_map[f"w{i}"] = name
    if shards > 1:
        index = {"weight_map": weight_map}  # no total_size: the headers are summed
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def write_seed_pair(target: Path, drafter: Path, target_bytes: int, shards: int = 1) -> None:
    """A pair of the seed's family at its full width 5120 (Qwen3.6-27B's configs, z-lab's
    drafter layout), the target declaring ``target_bytes`` over ``shards`` files."""
    spec = TinySpec.for_arch("seed", hidden_size=5120)
    write_model(target, hybrid_config(spec), target_bytes, shards=shards)
    write_model(drafter, drafter_config(spec), SEED_DRAFTER_BYTES)
