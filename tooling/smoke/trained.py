"""``tooling smoke --trained``: the recipe's trained pair (trained when not cached), and each
vLLM install's acceptance on it measured against the reference ``dflash``."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..trainer.api import TrainRequest, train_in
from .acceptance import measure_engines, table_markdown


@dataclass
class TrainedAcceptance:
    data: dict[str, Any]
    """acceptance.json as the measurement wrote it."""
    table: str
    failed: list[str]
    """Engines that did not run."""


def measure_trained(workdir: Path, engines: dict[str, Path], cache_dir: Path) -> TrainedAcceptance:
    """Train (or reuse, from ``cache_dir``) the recipe's pair, then measure each engine
    (default: the vLLM this interpreter imports) against the reference."""
    # In a child of this interpreter: its GPU memory is free again when the engines start.
    # Training takes minutes; its progress goes to this terminal.
    pair = train_in(Path(sys.executable), TrainRequest(cache_dir=cache_dir, export=workdir))
    if not engines:
        import vllm  # the interpreter's own vLLM

        engines = {"this": Path(vllm.__file__).parent.parent}
    # One engine at a time: vLLM profiles free GPU memory at start-up and fails
    # when another engine grows or shrinks beside it.
    reference, rows = measure_engines(pair.output_dir, engines, workdir, workers=1)
    return TrainedAcceptance(
        data=json.loads((workdir / "acceptance.json").read_text()),
        table=table_markdown(reference, rows),
        failed=[r.engine for r in rows if r.error],
    )
