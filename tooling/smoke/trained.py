"""``tooling smoke --trained``: the recipe's trained pair (trained when not cached), and each
vLLM install's acceptance on it measured against the reference ``dflash``; ``--trained-hybrid``:
the same for the hybrid recipe's pair, with the strict lossless check and decode speed."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SmokeError
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


@dataclass
class TrainedHybrid:
    data: dict[str, Any]
    text: str
    ok: bool


def measure_trained_hybrid(
    workdir: Path, engines: dict[str, Path], cache_dir: Path, time_limit_s: float
) -> TrainedHybrid:
    """Train (or reuse) the hybrid recipe's pair, then run every engine of
    ``trained_pair.variants`` on it, one call (one K) at a time, the engines of a call side by
    side on this GPU, and judge them (``trained_pair.report``).

    ``engines`` names a vLLM install for every site the variants use (``patched``, ``stock``
    and ``no-<patch>`` for each of ``trained_pair.ABLATED``); a missing one is refused before
    any training.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .. import procs
    from . import trained_pair

    sites = {"patched", "stock", *(f"no-{p}" for p in trained_pair.ABLATED)}
    missing = sorted(sites - set(engines))
    if missing:
        raise SmokeError(f"--trained-hybrid needs --engine NAME=DIR for {', '.join(missing)}")
    pair = train_in(
        Path(sys.executable), TrainRequest(arch="hybrid", cache_dir=cache_dir, export=workdir)
    )
    work = workdir / "trained"
    chosen = trained_pair.plan(pair.output_dir, work)

    def serve(variant: trained_pair.Variant) -> procs.ChildResult:
        # The variant's own compile cache, so no engine reads another's compiled graphs.
        path = os.pathsep.join(
            filter(None, [str(engines[variant.site]), os.environ.get("PYTHONPATH")])
        )
        env = {
            **os.environ,
            "PYTHONPATH": path,
            "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{variant.name}"),
        }
        return procs.run_child(
            [
                sys.executable,
                "-m",
                "tooling.smoke.serving.trained_run",
                str(work / f"{variant.name}.in.json"),
                str(work / f"{variant.name}.out.json"),
            ],
            log=work / f"{variant.name}.log",
            env=env,
            timeout_s=time_limit_s,
        )

    for call in sorted({v.call for v in chosen}):
        batch = [v for v in chosen if v.call == call]
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            list(pool.map(serve, batch))
    text, ok = trained_pair.report(pair.output_dir, work)
    data = {
        "ok": ok,
        "pair": pair.to_json(),
        "results": str(work),
        "engines": [v.name for v in chosen],
        "report": text,
    }
    return TrainedHybrid(data, text, ok)
