"""Model folders for the smoke's CPU tests: a config and safetensors headers that declare the
weights' size, with no weights behind them (a 55 GB model in a few hundred bytes)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


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
