"""``tooling smoke --trained``: the recipe's trained pair (trained when not cached), and each
vLLM install's acceptance on it measured against the reference ``dflash``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from .acceptance import measure_engines, table_markdown


def run_trainer(*args: str, capture: bool = True) -> str:
    """``python -m tooling.trainer ARGS``: what it printed (``capture``), else its output
    goes to this terminal. SmokeError naming the step, its exit code and, when captured,
    its last error line, when it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "tooling.trainer", *args], capture_output=capture, text=True
    )
    if done.returncode != 0:
        lines = (done.stderr or "").strip().splitlines()
        why = lines[-1] if lines else "its output is above"
        raise SmokeError(f"training recipe `{args[0]}` failed (exit {done.returncode}): {why}")
    return done.stdout or ""


def _trained_dir() -> Path:
    # `tooling.trainer path` prints {"output_dir": ..., "complete": ...}.
    out = run_trainer("path")
    try:
        return Path(json.loads(out)["output_dir"])
    except (ValueError, KeyError, TypeError):
        printed = out[:200]
        raise SmokeError(f"training recipe `path` printed no run folder: {printed!r}") from None


@dataclass
class TrainedAcceptance:
    data: dict[str, Any]
    """acceptance.json as the measurement wrote it."""
    table: str
    failed: list[str]
    """Engines that did not run."""


def measure_trained(workdir: Path, engines: dict[str, Path]) -> TrainedAcceptance:
    """Train (or reuse) the recipe's pair, then measure each engine (default: the vLLM this
    interpreter imports) against the reference."""
    trained = _trained_dir()
    if not (trained / "summary.json").is_file():
        # About 5 minutes on an H200: its progress goes to this terminal.
        run_trainer("train", "--export", str(workdir), capture=False)
        trained = _trained_dir()
    if not engines:
        import vllm  # the interpreter's own vLLM

        engines = {"this": Path(vllm.__file__).parent.parent}
    # One engine at a time: vLLM profiles free GPU memory at start-up and fails
    # when another engine grows or shrinks beside it.
    reference, rows = measure_engines(trained, engines, workdir, workers=1)
    return TrainedAcceptance(
        data=json.loads((workdir / "acceptance.json").read_text()),
        table=table_markdown(reference, rows),
        failed=[r.engine for r in rows if r.error],
    )
