"""Facts the engine states only in its log: which auxiliary hidden-state layers it captures."""

from __future__ import annotations

import re
from pathlib import Path

# vLLM 0.20.1 gpu_model_runner.py load_model():
#   logger.info("Using auxiliary layers from speculative config: %s", aux_layers)
# with a tuple, so the line ends in "(2, 4, 6)".
_AUX_LAYERS = re.compile(r"Using auxiliary layers from speculative config: \(([0-9,\s]*)\)")


def aux_layers_from_log(text: str) -> tuple[int, ...] | None:
    """The aux layer ids of the last such line in ``text``; None when the engine printed none."""
    matches = _AUX_LAYERS.findall(text)
    if not matches:
        return None
    return tuple(int(part) for part in matches[-1].replace(" ", "").split(",") if part)


def aux_layers_from_log_file(path: Path) -> tuple[int, ...] | None:
    """``aux_layers_from_log`` over a log file (None when the file is missing)."""
    try:
        return aux_layers_from_log(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
