"""The acceptance table across vLLM engines on the trained pair (toolchain side).

``measure_engines`` starts each engine as a child, inside the interpreter whose vLLM is measured
(``python -m tooling.trained.serving.acceptance run IN.json OUT.json`` with that install first on
PYTHONPATH; ``serving.acceptance`` is the engine side). The rest is pure: the engines' figures
beside the reference package's from the same recipe run, as a table and a plot.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import procs
from .serving.acceptance import SPEC

logger = logging.getLogger(__name__)


@dataclass
class EngineFigures:
    engine: str
    vllm_version: str | None
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    prefix_queries_repeat: int
    prefix_hits_repeat: int
    outputs_equal_reference: int
    prompts: int
    startup_s: float
    error: str | None = None

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries_repeat:
            return None
        return self.prefix_hits_repeat / self.prefix_queries_repeat


def figures(
    engine: str, result: dict[str, Any], reference_outputs: list[list[int]]
) -> EngineFigures:
    """The table row for one engine's raw result (pure)."""
    if not result.get("ok", True) or "spec" not in result:
        return EngineFigures(
            engine,
            None,
            0,
            0,
            0,
            [],
            0,
            0,
            0,
            len(reference_outputs),
            0.0,
            error=result.get("error", "no result"),
        )
    spec = result["spec"]
    equal = sum(a == b for a, b in zip(result["outputs"], reference_outputs, strict=False))
    return EngineFigures(
        engine=engine,
        vllm_version=result.get("vllm_version"),
        drafts=spec.get(f"{SPEC}num_drafts", 0),
        draft_tokens=spec.get(f"{SPEC}num_draft_tokens", 0),
        accepted=spec.get(f"{SPEC}num_accepted_tokens", 0),
        accepted_per_pos=spec.get(f"{SPEC}num_accepted_tokens_per_pos", []),
        prefix_queries_repeat=result["prefix_repeat"].get("full_block_tokens", 0),
        prefix_hits_repeat=result["prefix_repeat"].get("cached_tokens", 0),
        outputs_equal_reference=equal,
        prompts=len(reference_outputs),
        startup_s=result.get("startup_s", 0.0),
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_markdown(reference: dict[str, Any], rows: list[EngineFigures]) -> str:
    """The acceptance table (pure): the reference first, then each engine."""
    ref_len = reference["mean_acceptance_length"]
    ref_pos = reference.get("acceptance_per_position", [])
    ref_rate = (
        reference["num_accepted_tokens"] / reference["num_draft_tokens"]
        if reference.get("num_draft_tokens")
        else None
    )
    lines = [
        "| engine | mean acceptance length | acceptance rate | per position | vs reference "
        "| greedy output = reference | prefix cache on repeat |",
        "|---|---|---|---|---|---|---|",
        f"| reference `dflash` package (HF) | {ref_len:.3f} | "
        f"{_fmt(ref_rate)} | "
        f"{', '.join(f'{p:.2f}' for p in ref_pos)} | 1.000 | - | - |",
    ]
    for row in rows:
        if row.error:
            lines.append(f"| {row.engine} | error: {row.error} | | | | | |")
            continue
        ratio = row.acceptance_length / ref_len if row.acceptance_length else None
        hit = row.prefix_hit_rate
        hits = (
            "-"
            if hit is None
            else f"{hit:.1%} ({row.prefix_hits_repeat}/{row.prefix_queries_repeat} block tokens)"
        )
        lines.append(
            f"| {row.engine} | {_fmt(row.acceptance_length)} | {_fmt(row.acceptance_rate)} | "
            f"{', '.join(f'{p:.2f}' for p in row.per_position)} | {_fmt(ratio)} | "
            f"{row.outputs_equal_reference}/{row.prompts} | "
            f"{hits} |"
        )
    return "\n".join(lines) + "\n"


def plot(reference: dict[str, Any], rows: list[EngineFigures], target: Path) -> Path | None:
    """Acceptance per draft position, one line per engine (PNG), when matplotlib is there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ref = reference.get("acceptance_per_position", [])
    ax.plot(range(1, len(ref) + 1), ref, "k--o", label="reference dflash (HF)")
    for row in rows:
        if row.per_position:
            ax.plot(range(1, len(row.per_position) + 1), row.per_position, "-o", label=row.engine)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted fraction of drafts")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(ref), 1) + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("DFlash acceptance per position, trained pair, greedy")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


def measure_engines(
    trained: Path,
    engines: dict[str, Path],
    out_dir: Path,
    timeout_s: float = 420,
    workers: int = 1,
) -> tuple[dict[str, Any], list[EngineFigures]]:
    """Run every engine (a folder holding its vllm, put first on PYTHONPATH) on the trained pair.

    Returns the reference figures and one row per engine; writes each raw
    result, the table (acceptance.md), the rows (acceptance.json) and the
    plot (acceptance.png) into ``out_dir``.
    """
    summary = json.loads((trained / "summary.json").read_text())
    reference = summary["reference"]
    prompts = json.loads((trained / "prompts.json").read_text())
    reference_outputs = [
        r["output_ids"] for r in json.loads((trained / "reference.json").read_text())["prompts"]
    ]
    request = {
        "target": str(trained / "target"),
        "drafter": str(trained / "drafter"),
        "prompts": prompts["prompts"],
        "max_new_tokens": prompts["max_new_tokens"],
        "num_speculative_tokens": prompts["num_speculative_tokens"],
        # A small share each: the models are small and several engines may run at once.
        "gpu_memory_utilization": 0.12,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "acceptance-request.json").write_text(json.dumps(request))

    def measure(name: str, folder: Path) -> EngineFigures:
        raw = out_dir / f"acceptance-{name}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        log = out_dir / f"acceptance-{name}.log"
        log.unlink(missing_ok=True)  # this run's output only
        logger.debug("measure engine %s (%s; log: %s)", name, folder, log)
        # Its own process group: a time-out stops the engine's core process too.
        run = procs.run_child(
            [
                sys.executable,
                "-m",
                "tooling.trained.serving.acceptance",
                "run",
                str(out_dir / "acceptance-request.json"),
                str(raw),
            ],
            log=log,
            env=env,
            timeout_s=timeout_s,
        )
        if run.timed_out:
            raw.write_text(json.dumps({"ok": False, "error": f"timed out ({timeout_s}s)"}))
        result = json.loads(raw.read_text()) if raw.is_file() else {"ok": False}
        return figures(name, result, reference_outputs)

    # Engines are separate processes with a small memory share each, so several
    # can share one GPU.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        rows = list(pool.map(lambda item: measure(*item), engines.items()))
    (out_dir / "acceptance.md").write_text(table_markdown(reference, rows))
    (out_dir / "acceptance.json").write_text(
        json.dumps(
            {
                "reference": reference,
                "engines": [
                    {
                        **asdict(r),
                        "acceptance_length": r.acceptance_length,
                        "acceptance_rate": r.acceptance_rate,
                        "per_position": r.per_position,
                        "prefix_hit_rate": r.prefix_hit_rate,
                    }
                    for r in rows
                ],
            },
            indent=2,
        )
    )
    plot(reference, rows, out_dir / "acceptance.png")
    return reference, rows
