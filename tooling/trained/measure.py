"""``tooling smoke --trained``: the recipe's trained pair (trained when not cached), and each
vLLM install's acceptance on it measured against the reference ``dflash``; ``--trained-hybrid``:
the same for the hybrid recipe's pair, with the strict lossless check and decode speed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import procs
from ..entry import answer, entry_logging
from ..errors import SmokeError
from ..trainer.api import TrainRequest, train_in
from . import hybrid, hybrid_plan
from .acceptance import measure_engines, table_markdown
from .gpu_fit import gpu_memory_gib, turns

logger = logging.getLogger(__name__)


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


def _missing_sites(
    engines: dict[str, Path], chosen: list[hybrid_plan.Variant] | None = None
) -> list[str]:
    """The installs the ``chosen`` variants (all of ``hybrid_plan.variants``: None) use that
    ``engines`` does not name."""
    sites = {v.site for v in chosen} if chosen is not None else set(hybrid_plan.SITES)
    return sorted(sites - set(engines))


def serve_engines(
    work: Path, engines: dict[str, Path], sites: dict[str, str], module: str, time_limit_s: float
) -> None:
    """Run ``python -m module work/NAME.in.json work/NAME.out.json`` for every ``NAME: site`` of
    ``sites`` at once on this GPU, each in a process of its own with ``engines[site]`` first on
    its path and a compile cache of its own (so no engine reads another's compiled graphs), each
    stopped at ``time_limit_s``."""
    logger.debug("%s: %s at once", module, ", ".join(sites))

    def serve(name: str) -> procs.ChildResult:
        path = os.pathsep.join(
            filter(None, [str(engines[sites[name]]), os.environ.get("PYTHONPATH")])
        )
        env = {
            **os.environ,
            "PYTHONPATH": path,
            "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{name}"),
        }
        return procs.run_child(
            [
                sys.executable,
                "-m",
                module,
                str(work / f"{name}.in.json"),
                str(work / f"{name}.out.json"),
            ],
            log=work / f"{name}.log",
            env=env,
            timeout_s=time_limit_s,
        )

    with ThreadPoolExecutor(max_workers=max(len(sites), 1)) as pool:
        list(pool.map(serve, sites))


def run_call(work: Path, engines: dict[str, Path], call: int, time_limit_s: float) -> None:
    """Serve every variant of ``call`` (planned in ``work``) at once (``serve_engines``), or in
    as few turns as fit the GPU, in the plan's order."""
    chosen = [v for v in hybrid_plan.load_variants(work) if v.call == call]
    for turn in turns(chosen, gpu_memory_gib(), f"call {call}"):
        sites = {v.name: v.site for v in turn}
        serve_engines(work, engines, sites, "tooling.trained.serving.trained_run", time_limit_s)


def measure_trained_hybrid(
    workdir: Path, engines: dict[str, Path], cache_dir: Path, time_limit_s: float
) -> TrainedHybrid:
    """Train (or reuse) the hybrid recipe's pair, then run every engine of
    ``hybrid_plan.variants`` on it, one call (one K) at a time, and judge them
    (``hybrid.report``).

    ``engines`` names a vLLM install for every site the variants use (``patched``, ``stock``
    and ``no-<patch>`` for each of ``hybrid_plan.ABLATED``); a missing one is refused before
    any training.
    """
    missing = _missing_sites(engines)
    if missing:
        raise SmokeError(f"--trained-hybrid needs --engine NAME=DIR for {', '.join(missing)}")
    pair = train_in(
        Path(sys.executable), TrainRequest(arch="hybrid", cache_dir=cache_dir, export=workdir)
    )
    work = workdir / "trained"
    chosen = hybrid_plan.plan(pair.output_dir, work)
    for call in sorted({v.call for v in chosen}):
        run_call(work, engines, call, time_limit_s)
    text, ok = hybrid.report(pair.output_dir, work)
    data = {
        "ok": ok,
        "pair": pair.to_json(),
        "results": str(work),
        "engines": [v.name for v in chosen],
        "report": text,
    }
    return TrainedHybrid(data, text, ok)


def main(argv: list[str]) -> int:
    """``run-call PAIR WORK CALL --engines-root DIR``: one call of ``--trained-hybrid`` on a
    GPU host whose commands are bounded in time (``ci/gpu/trained-hybrid.sh``), an install
    per site as ``DIR/<site>``; then the report of every call so far. Exit 0 when it passes."""
    parser = argparse.ArgumentParser(prog="python -m tooling.trained.measure")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run-call")
    p.add_argument("pair", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("call", type=int)
    p.add_argument("--engines-root", type=Path, required=True)
    p.add_argument("--time-limit", type=float, default=540.0)
    p.add_argument("--only", default="", help="Serve and judge only these engines (NAME,...).")
    args = parser.parse_args(argv)
    root = args.engines_root
    engines = {d.name: d for d in root.iterdir() if d.is_dir()} if root.is_dir() else {}
    with entry_logging():
        only = tuple(n for n in args.only.split(",") if n)
        try:
            chosen = hybrid_plan.chosen_variants(args.pair, only)
        except SmokeError as e:
            logger.error("error: %s", e)
            return SmokeError.exit_code
        # Only the installs the call's engines serve: a session builds no other.
        missing = _missing_sites(engines, [v for v in chosen if v.call == args.call])
        if missing:
            logger.error("error: %s lacks %s", root, ", ".join(missing))
            return SmokeError.exit_code
        hybrid_plan.plan(args.pair, args.work, only)
        run_call(args.work, engines, args.call, args.time_limit)
    text, ok = hybrid.report(args.pair, args.work, args.call)
    answer(text.removesuffix("\n"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
