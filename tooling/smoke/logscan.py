"""Facts the engine states only in its log: which auxiliary hidden-state layers it captures,
and the block size it chose for a hybrid target."""

from __future__ import annotations

import re
from pathlib import Path

# vLLM 0.20.1 gpu_model_runner.py load_model():
#   logger.info("Using auxiliary layers from speculative config: %s", aux_layers)
# with a tuple, so the line ends in "(2, 4, 6)".
_AUX_LAYERS = re.compile(r"Using auxiliary layers from speculative config: \(([0-9,\s]*)\)")
# vLLM 0.20.1 platforms/interface.py _align_hybrid_block_size(), in the engine core
# before the server answers (with prefix caching the Mamba blocks follow it):
#   "Setting attention block size to %d tokens to ensure that attention page size is
#   >= mamba page size."
_BLOCK_SIZE = re.compile(r"Setting attention block size to (\d+) tokens")


def aux_layers_from_log(text: str) -> tuple[int, ...] | None:
    """The aux layer ids of the last such line in ``text``; None when the engine printed none."""
    matches = _AUX_LAYERS.findall(text)
    if not matches:
        return None
    return tuple(int(part) for part in matches[-1].replace(" ", "").split(",") if part)


def block_size_from_log(text: str) -> int | None:
    """The attention block size of the last such line in ``text``; None when the engine
    kept the configured one (it says nothing then)."""
    matches = _BLOCK_SIZE.findall(text)
    return int(matches[-1]) if matches else None


def read_log(path: Path) -> str:
    """A log's text so far ('' when the file is missing)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def aux_layers_from_log_file(path: Path) -> tuple[int, ...] | None:
    """``aux_layers_from_log`` over a log file (None when the file is missing)."""
    return aux_layers_from_log(read_log(path))
